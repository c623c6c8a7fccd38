"""Training is seeded and resumable: stopping and resuming gives the same weights."""

import random

import torch

from epd.checkpoint.weights import load_model
from epd.multimodal.prompt import expand_placeholders
from epd.shapes.questions import sample
from epd.shapes.scenes import COLOURS, SHAPES
from epd.shapes.train import IGNORE, Trainer, train


def test_resumed_training_equals_uninterrupted(tmp_path):
    train(
        tmp_path / "straight", steps=2, batch_size=2, lr=1e-3, seed=3, state_path=tmp_path / "a.pt"
    )
    train(
        tmp_path / "resumed", steps=1, batch_size=2, lr=1e-3, seed=3, state_path=tmp_path / "b.pt"
    )
    train(
        tmp_path / "resumed", steps=2, batch_size=2, lr=1e-3, seed=3, state_path=tmp_path / "b.pt"
    )
    straight = load_model(tmp_path / "straight").state_dict()
    resumed = load_model(tmp_path / "resumed").state_dict()
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_two_workers_train_the_model_one_process_does(tmp_path):
    for workers in (1, 2):
        train(
            tmp_path / f"w{workers}",
            steps=2,
            batch_size=4,
            lr=1e-3,
            seed=5,
            state_path=tmp_path / f"w{workers}.pt",
            workers=workers,
        )
    alone = load_model(tmp_path / "w1").state_dict()
    shared = load_model(tmp_path / "w2").state_dict()
    initial = Trainer(tmp_path / "init", seed=5).model.state_dict()
    # The same weights up to summation order, and not because training left them alone.
    assert all(torch.allclose(alone[k], shared[k], atol=1e-6) for k in alone)
    assert not torch.equal(
        alone["language_model.lm_head.weight"], initial["language_model.lm_head.weight"]
    )


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
