from pathlib import Path

import pytest
import torch

from epd.checkpoint.config import load_generation_config, load_model_config
from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.tokenizer import load_tokenizer
from epd.checkpoint.weights import load_model
from epd.prefill.engine import PrefillEngine

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


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """The tiny checkpoint's prefill engine (prefill's tests, and the router's block names)."""
    lm = load_model(tiny_checkpoint, role="language").language_model
    placeholder = load_model_config(tiny_checkpoint).media_placeholder_token_id
    eos = load_generation_config(tiny_checkpoint).eos_token_ids
    return PrefillEngine(lm, load_tokenizer(tiny_checkpoint), placeholder, eos)
