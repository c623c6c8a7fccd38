import pytest

from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.detokenizer import Detokenizer


@pytest.fixture(scope="module", params=["appended", "inside", "tiktoken"])
def tokenizer(request, checkpoint_in):
    """Each tokenizer layout, Kimi's tiktoken files among them."""
    return load_tokenizer(checkpoint_in(request.param))


@pytest.mark.parametrize(
    "text",
    ["plain words", "héllo wörld", "日本語 🙂 emoji 👩‍💻!", "a\nb\tc", "中文English混合 I'LL"],
)
def test_pieces_join_to_the_text_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_characters_wait_for_their_last_byte(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the byte-level vocabulary has no token for it
    detokenizer = Detokenizer(tokenizer)
    assert [detokenizer.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_special_tokens_add_no_text(tokenizer):
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.add(tokenizer.convert_tokens_to_ids("<|im_end|>")) == ""
