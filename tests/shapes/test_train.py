"""Training is seeded and resumable: stopping and resuming gives the same weights."""

import torch

from epd.checkpoint.weights import load_model
from epd.shapes.train import train


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
    untrained = load_model(tmp_path / "straight").state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert untrained.keys() == straight.keys()


def test_a_few_steps_lower_the_loss(tmp_path):
    from epd.shapes.train import Trainer

    trainer = Trainer(tmp_path / "c", seed=0)
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=3e-3)
    batch = trainer.batch(0, 8)
    first = trainer.loss(batch)[0].item()
    for _ in range(5):
        loss, _ = trainer.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert trainer.loss(batch)[0].item() < first - 0.25
