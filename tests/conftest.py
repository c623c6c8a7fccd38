from pathlib import Path

import pytest
import torch

from epd.checkpoint.synthetic import make_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_q_lora_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shape with q_lora_rank set: q_proj becomes q_a_proj, q_a_layernorm, q_b_proj."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_q_lora"), "tiny", seed=1, q_lora_rank=24)


@pytest.fixture(scope="session")
def checkpoint_in(tmp_path_factory: pytest.TempPathFactory):
    """A tiny checkpoint whose tokenizer has the given layout (`synthetic_tokenizer.LAYOUTS`),
    made once a session."""
    made: dict[str, Path] = {}

    def make(layout: str) -> Path:
        if layout not in made:
            out = tmp_path_factory.mktemp(f"tiny_{layout}")
            made[layout] = make_checkpoint(out, "tiny", seed=0, tokenizer=layout)
        return made[layout]

    return make
