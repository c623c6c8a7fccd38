"""What a conversation's turns hand to decode: KV tokens sent against the turns' new tokens.

    .venv/bin/python scripts/bench_handoff.py [--checkpoint DIR] [--turns 4] [--runs 3]

Starts `epd serve` (prefix caching on, the default) and holds one conversation per run: a
900-word system prompt and a 448x448 image in the first user turn, then turns that each add
the previous reply and a new question, greedy, replies of `--reply-tokens` (ignore_eos). Around
each turn it reads prefill's counters from the API's /metrics: KV tokens handed off, tokens the
decoder held already, bytes. A turn's new tokens are its prompt's tokens less the turn before's
(the previous reply, the new question and the template's markers). Before this change every
hand-off carried its whole prompt, so the prompt's tokens are that figure.
"""

from __future__ import annotations

import argparse
import base64
import io
import random
import re
import sys
import tempfile
from pathlib import Path

import openai
import requests
from bench_serving import start, stop  # the same server start as the serving benchmark
from PIL import Image, ImageDraw

PORT = 8350
COUNTERS = ("kv_handoff_tokens", "kv_handoff_reused_tokens", "kv_handoff_bytes")
VOCABULARY = ("shape", "colour", "circle", "square", "triangle", "red", "green", "blue", "left")


def counter(text: str, name: str) -> float:
    found = re.search(rf'^epd:{name}_total\{{[^}}]*role="prefill"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def counters(url: str) -> dict[str, float]:
    text = requests.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return {name: counter(text, name) for name in COUNTERS}


def picture(seed: int) -> str:
    """A 448x448 PNG of a few shapes, as a data URL."""
    rng = random.Random(seed)
    image = Image.new("RGB", (448, 448), (240, 240, 240))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x, y, r = rng.randrange(60, 388), rng.randrange(60, 388), rng.randrange(20, 60)
        colour = tuple(rng.randrange(256) for _ in range(3))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    data = io.BytesIO()
    image.save(data, "PNG")
    return "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(count))


def conversation(client: openai.OpenAI, model: str, url: str, seed: int, turns: int, reply: int):
    """Each turn's prompt tokens, new tokens and counters' growth."""
    rng = random.Random(seed)
    messages = [
        {"role": "system", "content": words(rng, 900)},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": picture(seed)}},
                {"type": "text", "text": "What is in this picture? " + words(rng, 20)},
            ],
        },
    ]
    rows, previous = [], 0
    for turn in range(turns):
        before = counters(url)
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=reply,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        after = counters(url)
        prompt = answer.usage.prompt_tokens
        grown = {name: after[name] - before[name] for name in COUNTERS}
        rows.append((turn + 1, prompt, prompt - previous, grown))
        previous = prompt
        text = answer.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "And then? " + words(rng, 40)},
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/kimi-vl-shapes"))
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, default=64)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{PORT}/v1"
    command = [sys.executable, "-m", "epd.cli", "serve", str(args.checkpoint)]
    command += ["--port", str(PORT), "--internal-base-port", "7450"]
    log = Path(tempfile.mkdtemp()) / "epd.log"
    server = start(command, url, log)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        print("run turn prompt_tokens new_tokens handed_off reused bytes handed/new")
        for run in range(args.runs):
            for turn, prompt, new, grown in conversation(
                client, model, url, run, args.turns, args.reply_tokens
            ):
                handed = grown["kv_handoff_tokens"]
                print(
                    f"{run} {turn} {prompt} {new} {handed:.0f} "
                    f"{grown['kv_handoff_reused_tokens']:.0f} {grown['kv_handoff_bytes']:.0f} "
                    f"{handed / new:.2f}"
                )
    finally:
        stop(server)


if __name__ == "__main__":
    main()
