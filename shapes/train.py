"""Train the bundled demo checkpoint on the shapes task, on this machine's CPU.

The whole Kimi-VL is trained — vision tower, projector and language model — through the same
modules that serve it, with the loss on the answer tokens (and the <|im_end|> that ends them).
Prompts of a batch are packed into one sequence (`DeepseekV3ForCausalLM.prefill(lengths=...)`),
and the batch is shared among `--workers` processes (shapes.data_parallel), one per core.
Seeded and resumable: the batch of step s is a function of (seed, s), and the model, optimiser
and step are saved to `--state` as training goes.

    python -m shapes.train checkpoints/kimi-vl-shapes    # the bundled checkpoint
"""

from __future__ import annotations

import argparse
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from epd.checkpoint.config import load_processor_config
from epd.checkpoint.synthetic import (
    Sizes,
    init_weights,
    make_config,
    save_sharded,
    write_side_files,
)
from epd.checkpoint.synthetic_tokenizer import build_tokenizer, vocabulary, write_fast
from epd.checkpoint.tokenizer import load_tokenizer
from epd.model.config import VisionConfig
from epd.model.kimi_vl import KimiVL
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.prompt import expand_placeholders, render_prompt, scatter_image_embeddings
from shapes import data_parallel
from shapes.questions import FIRST_STAGE_MIX, TRAINING_MIX, Sample, corpus, sample

IGNORE = -100
# The bundled demo model: small enough to train on two CPU cores.
SIZES: Sizes = (
    VisionConfig(96, 4, 4, 256, init_pos_emb_height=16, init_pos_emb_width=16),
    dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe_intermediate_size=96,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
    ),
)
FOLLOWUPS = 2  # most extra questions a training conversation asks about its images


class Trainer:
    def __init__(
        self,
        out: Path,
        seed: int,
        first_stage: int = 0,
        vocab_size: int = 512,
        write_files: bool = True,
    ) -> None:
        """`write_files=False` reads the side files (tokenizer, configs) worker 0 writes."""
        out.mkdir(parents=True, exist_ok=True)
        raw_tokenizer = build_tokenizer(vocab_size, corpus())
        placeholder = raw_tokenizer.token_to_id("<|media_pad|>")
        assert placeholder is not None
        self.config = make_config(SIZES, raw_tokenizer.get_vocab_size(), placeholder, None)
        if write_files:
            write_fast(out, raw_tokenizer, self.config.text.max_position_embeddings)
            write_side_files(out, self.config, vocabulary(raw_tokenizer))
        data_parallel.barrier()  # the files are written before any worker reads them
        self.out, self.seed, self.first_stage = out, seed, first_stage
        self.tokenizer = load_tokenizer(out)
        self.im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.processor = ImageProcessor(load_processor_config(out))
        torch.manual_seed(seed)
        self.model = KimiVL(self.config)
        with torch.no_grad():
            init_weights(self.model, torch.Generator().manual_seed(seed))

    def batch(self, step: int, size: int, part: slice = slice(None)) -> list[Sample]:
        """The samples of step `step`'s batch, or the `part` of them one worker takes."""
        mix = FIRST_STAGE_MIX if step < self.first_stage else TRAINING_MIX
        rngs = [random.Random(f"{self.seed}-{step}-{i}") for i in range(size)[part]]
        return [sample(rng, followups=rng.randint(0, FOLLOWUPS), mix=mix) for rng in rngs]

    def loss(self, samples: list[Sample]) -> tuple[torch.Tensor, int, int]:
        """Over the answer tokens of a packed batch: summed cross-entropy, count, count right.

        Sums, not means, so that workers' shares of a batch add up to the whole batch's loss.
        """
        lm, pad = self.model.language_model, self.config.media_placeholder_token_id
        processed = self.processor([image for s in samples for image in s.images])
        image_embeds = self.model.encode_images(processed.pixel_values, list(processed.grids))
        counts = iter(self.processor.tokens(grid) for grid in processed.grids)
        ids: list[int] = []
        targets: list[int] = []
        lengths: list[int] = []
        for s in samples:
            conversation, labels = self.conversation(s, [next(counts) for _ in s.images])
            ids += conversation
            targets += [*labels[1:], IGNORE]  # position t predicts token t+1
            lengths.append(len(conversation))
        input_ids, target_ids = torch.tensor(ids), torch.tensor(targets)
        embeds = scatter_image_embeddings(lm.embed(input_ids), input_ids, image_embeds, pad)
        hidden, _ = lm.prefill(embeds, lengths)
        keep = target_ids != IGNORE
        logits = lm.logits(hidden[keep])
        correct = int((logits.argmax(-1) == target_ids[keep]).sum())
        return F.cross_entropy(logits, target_ids[keep], reduction="sum"), len(logits), correct

    def conversation(self, s: Sample, image_tokens: list[int]) -> tuple[list[int], list[int]]:
        """Token ids of every turn of `s`, and labels that are the ids on answers, else IGNORE."""
        pad = self.config.media_placeholder_token_id
        ids: list[int] = []
        labels: list[int] = []
        for messages, reply in s.turns():
            prompt = expand_placeholders(render_prompt(self.tokenizer, messages), pad, image_tokens)
            # Each turn's prompt extends the previous turn's ids with the next question.
            assert prompt[: len(ids)] == ids, "chat template is not prefix-stable"
            answer = [*self.tokenizer.encode(reply, add_special_tokens=False), self.im_end]
            labels += [IGNORE] * (len(prompt) - len(ids)) + answer
            ids = prompt + answer
        return ids, labels

    def save(self) -> None:
        state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
        save_sharded(state, self.out, shards=2)


def learning_rate(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def gradients(trainer: Trainer, samples: list[Sample]) -> torch.Tensor:
    """Backpropagate the mean answer-token loss of the batch whose share `samples` is.

    Each worker's parameters end up holding the whole batch's gradient. Returns (answer tokens,
    summed loss, right answers) over the whole batch, float64.
    """
    summed, tokens, correct = trainer.loss(samples)
    whole = data_parallel.all_sum(
        torch.tensor([tokens, summed.item(), correct], dtype=torch.float64)
    )
    (summed / whole[0]).backward()  # divided in float64, as the bundled checkpoint was
    data_parallel.sum_gradients(trainer.model.parameters())
    return whole


@dataclass(frozen=True)
class Run:
    """What to train: the checkpoint to write, the schedule, and the state file to resume from."""

    out: Path
    steps: int
    batch_size: int
    lr: float
    seed: int
    state_path: Path
    first_stage: int = 0


def train(run: Run, workers: int = 1) -> None:
    """Train to `run.steps` (resuming from `run.state_path` if it exists) on `workers` processes."""
    if not 1 <= workers <= run.batch_size:
        raise ValueError(f"workers must be between 1 and the batch size, got {workers}")
    data_parallel.launch(_train, workers, run)


def _train(rank: int, workers: int, run: Run) -> None:
    lead = rank == 0  # writes the files, reports progress
    trainer = Trainer(run.out, run.seed, run.first_stage, write_files=lead)
    params = list(trainer.model.parameters())
    optimizer = torch.optim.AdamW(
        params, lr=run.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=True
    )
    start = 0
    if run.state_path.is_file():
        state = torch.load(run.state_path, weights_only=True)
        trainer.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if lead:
            print(f"resuming at step {start} from {run.state_path}")
    trainer.model.train()
    progress = tqdm(
        range(start, run.steps),
        initial=start,
        total=run.steps,
        desc="training",
        unit="step",
        disable=not lead,
    )
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, run.steps, run.lr)
        optimizer.zero_grad(set_to_none=True)
        tokens, loss, correct = gradients(
            trainer, trainer.batch(step, run.batch_size, slice(rank, None, workers))
        )
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        progress.set_postfix(loss=f"{loss / tokens:.3f}", token_acc=f"{correct / tokens:.2f}")
        if lead and ((step + 1) % 100 == 0 or step + 1 == run.steps):
            state = {
                "model": trainer.model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step + 1,
            }
            save_atomically(state, run.state_path)
            trainer.save()
    if lead and start >= run.steps:  # nothing left to train: write the checkpoint from the state
        trainer.save()


def save_atomically(state: dict[str, Any], path: Path) -> None:
    """Write then rename, so that an interrupted save leaves the previous state whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=11000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workers",
        type=int,
        default=min(2, data_parallel.cores()),
        help="processes sharing each batch, one per core (default: 2, or 1 on one core)",
    )
    parser.add_argument(
        "--first-stage",
        type=int,
        default=1000,
        help="steps of one-image questions (mostly shape) before the full mix",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=Path(".cache/epd/shapes-training.pt"),
        help="training state, for resuming",
    )
    args = parser.parse_args()
    run = Run(
        args.out, args.steps, args.batch_size, args.lr, args.seed, args.state, args.first_stage
    )
    train(run, args.workers)


if __name__ == "__main__":
    main()
