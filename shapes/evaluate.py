"""Exact-match accuracy of a checkpoint on held-out shapes questions, per question kind.

Questions go through `LocalPipeline`, the same encoder, prefill engine and decode scheduler that
the three processes run, greedy, with images sent as PNG data URLs.

    python -m shapes.evaluate checkpoints/kimi-vl-shapes --per-kind 200 --card
"""

from __future__ import annotations

import argparse
import base64
import io
import random
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from epd.local import LocalPipeline
from shapes.questions import KINDS, sample

CARD = "README.md"
DESCRIPTIONS = {
    "colour": "colour of the one shape in one image",
    "shape": "kind of the one shape in one image",
    "count": "how many shapes (1-4) in one image",
    "multi": "colour or shape in the first/second/third of 2-3 images",
}


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def evaluate(checkpoint: Path, per_kind: int) -> dict[str, tuple[int, int]]:
    pipeline = LocalPipeline(checkpoint)
    model = checkpoint.resolve().name
    scores = {}
    for kind in KINDS:
        correct = 0
        for i in tqdm(range(per_kind), desc=kind, leave=False):
            question = sample(random.Random(f"held-out-{kind}-{i}"), kind)
            body = {
                "model": model,
                "messages": question.messages(data_url),
                "max_tokens": 4,
                "temperature": 0,
            }
            correct += pipeline.chat(body).text.strip() == question.answer
        scores[kind] = (correct, per_kind)
    return scores


def table(scores: dict[str, tuple[int, int]]) -> str:
    lines = ["| question kind | what is asked | exact match |", "|---|---|---|"]
    for kind, (correct, total) in scores.items():
        lines.append(
            f"| {kind} | {DESCRIPTIONS[kind]} | {correct / total:.1%} ({correct}/{total}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--per-kind", type=int, default=200)
    parser.add_argument("--card", action="store_true", help="write the table into the model card")
    args = parser.parse_args()
    result = table(evaluate(args.checkpoint, args.per_kind))
    print(result, end="")
    if args.card:
        card = args.checkpoint / CARD
        text = card.read_text()
        start, end = "<!-- accuracy:start -->\n", "<!-- accuracy:end -->"
        card.write_text(text[: text.index(start) + len(start)] + result + text[text.index(end) :])


if __name__ == "__main__":
    main()
