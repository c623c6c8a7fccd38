import pytest

from epd.checkpoint.config import load_generation_config, load_model_config
from epd.checkpoint.tokenizer import load_tokenizer
from epd.checkpoint.weights import load_model
from epd.prefill.engine import PrefillEngine


@pytest.fixture(scope="module")
def parts(tiny_checkpoint):
    """The tiny checkpoint's language model, tokenizer, prefill engine and eos ids."""
    lm = load_model(tiny_checkpoint, role="language").language_model
    tokenizer = load_tokenizer(tiny_checkpoint)
    eos = load_generation_config(tiny_checkpoint).eos_token_ids
    placeholder = load_model_config(tiny_checkpoint).media_placeholder_token_id
    engine = PrefillEngine(lm, tokenizer, placeholder, eos)
    return lm, tokenizer, engine, eos
