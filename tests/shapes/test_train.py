"""Training is seeded, resumable and data-parallel: workers compute the one-process gradient."""

import random
from pathlib import Path

import pytest
import torch

from epd.checkpoint.weights import load_model
from epd.multimodal.prompt import expand_placeholders
from shapes import data_parallel
from shapes.questions import sample
from shapes.scenes import COLOURS, SHAPES
from shapes.train import IGNORE, Run, Trainer, gradients, train


@pytest.mark.parametrize("workers", [1, 2])
def test_resumed_training_equals_uninterrupted(tmp_path, workers):
    def run(name: str, steps: int) -> None:
        state = tmp_path / f"{name}.pt"
        train(Run(tmp_path / name, steps, batch_size=2, lr=1e-3, seed=3, state_path=state), workers)

    run("straight", 2)
    run("resumed", 1)
    run("resumed", 2)
    straight = load_model(tmp_path / "straight").state_dict()
    resumed = load_model(tmp_path / "resumed").state_dict()
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def _gradients_of_a_share(rank: int, workers: int, out: Path, result: Path) -> None:
    trainer = Trainer(out, seed=1, write_files=rank == 0)
    gradients(trainer, trainer.batch(0, 6, slice(rank, None, workers)))
    if rank == 0:
        torch.save({n: p.grad for n, p in trainer.model.named_parameters()}, result)


def test_workers_sharing_a_batch_each_get_the_whole_batchs_gradient(tmp_path):
    data_parallel.launch(_gradients_of_a_share, 2, tmp_path / "shared", tmp_path / "shared.pt")
    data_parallel.launch(_gradients_of_a_share, 1, tmp_path / "alone", tmp_path / "alone.pt")
    shared = torch.load(tmp_path / "shared.pt", weights_only=True)
    alone = torch.load(tmp_path / "alone.pt", weights_only=True)
    assert shared.keys() == alone.keys()
    # Equal up to float32 summation order: a relative error of about 1e-7 per tensor.
    assert all((shared[n] - alone[n]).norm() <= 1e-5 * alone[n].norm() for n in alone)
    assert all(g.abs().sum() > 0 for n, g in alone.items() if "lm_head" in n)


def test_a_few_steps_lower_the_loss(tmp_path):
    trainer = Trainer(tmp_path / "c", seed=0)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=3e-3)
    batch = trainer.batch(0, 8)

    def mean_loss() -> torch.Tensor:
        summed, tokens, _ = trainer.loss(batch)
        return summed / tokens

    first = mean_loss().item()
    for _ in range(5):
        loss = mean_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert mean_loss().item() < first - 0.25


def test_a_conversation_is_the_chat_template_with_only_its_answers_labelled(tmp_path):
    trainer = Trainer(tmp_path / "d", seed=0)
    s = sample(random.Random(5), "multi", followups=2)
    assert len(s.followups) >= 1
    ids, labels = trainer.conversation(s, [3] * len(s.images))

    messages, last = s.turns()[-1]
    whole = [*messages, {"role": "assistant", "content": last}]
    text = trainer.tokenizer.apply_chat_template(whole, tokenize=False)
    expected = trainer.tokenizer.encode(text, add_special_tokens=False)
    pad = trainer.config.media_placeholder_token_id
    assert ids == expand_placeholders(expected, pad, [3] * len(s.images))

    labelled = trainer.tokenizer.decode([t for t in labels if t != IGNORE])
    answers = [s.answer, *(answer for _, answer in s.followups)]
    assert labelled == "".join(f"{answer}<|im_end|>" for answer in answers)
    assert all(t in (IGNORE, i) for t, i in zip(labels, ids, strict=True))


def test_the_first_stage_asks_about_one_image_at_a_time(tmp_path):
    trainer = Trainer(tmp_path / "e", seed=0, first_stage=2)
    first, later = trainer.batch(1, 64), trainer.batch(2, 64)
    assert all(len(s.images) == 1 for s in first)
    assert sum(s.kind == "shape" for s in first) > sum(s.kind == "shape" for s in later)
    assert any(len(s.images) > 1 for s in later)


def test_every_answer_and_template_word_is_one_token(tmp_path):
    tokenizer = Trainer(tmp_path / "f", seed=0).tokenizer
    for word in [*COLOURS, *SHAPES, "1", "2", "3", "4", "system", "user", "assistant"]:
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
    question = tokenizer.encode("What colour is the shape in the second image?")
    assert len(question) == 10  # one token per word, and the question mark
