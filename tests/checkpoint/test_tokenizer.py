"""The tokenizer of every layout real checkpoints ship, read natively: Kimi's tiktoken files
against tiktoken itself, and the remote code they name never run."""

import base64
import json
import random
import shutil

import pytest
import tiktoken

from epd.checkpoint.config import CheckpointError
from epd.checkpoint.synthetic_tokenizer import train_bpe, write_tiktoken
from epd.checkpoint.tiktoken_files import KIMI_PATTERN, TiktokenFiles
from epd.checkpoint.tokenizer import decode_text, load_tokenizer, token_bytes
from epd.multimodal.prompt import render_prompt

LAYOUTS = ("appended", "inside", "tiktoken")
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What colour is the circle? 中文English混合 naïve I'LL 12345"},
]
# Scripts, contractions, digits, whitespace runs and characters at the edges of the pattern's
# classes (marks, modifier letters, letter numbers, Unicode's own line breaks, zero widths).
PIECES = [
    *("the", " cat", "中文", "混合", "English", "naïve", "ÉCOLE", "we'll", "I'M", " they've"),
    *("12345", "١٢٣", "\n\n", "\t", "  ", " ", "😀👍", "가나", "한국어", "日本語のテキスト"),
    *("!?", ".,;", "'", '"', "<|", "|>", "x\r\ny", "Ⅻ", "ǅungla", "αβγ", "—", "ß"),
    *("e\u0301", "ʰ", "ⅷ", "'S", "\u0085", "\u2028", "\u200b", "\ufeff", "\r\n", "\u3000"),
]


def kimi_encoding(files: TiktokenFiles) -> tiktoken.Encoding:
    """tiktoken itself over the same files: the reference the fast tokenizer must equal."""
    return tiktoken.Encoding(
        "kimi", pat_str=KIMI_PATTERN, mergeable_ranks=files.ranks, special_tokens=files.specials
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_the_same_specials_and_template(checkpoint_in, layout):
    tokenizer = load_tokenizer(checkpoint_in(layout))
    assert type(tokenizer).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert decode_text(tokenizer, [pad]) == "<|media_pad|>"
    assert tokenizer.eos_token == "[EOS]" and tokenizer.bos_token == "[BOS]"
    ids = render_prompt(tokenizer, MESSAGES)
    expected = render_prompt(load_tokenizer(checkpoint_in("appended")), MESSAGES)
    assert decode_text(tokenizer, ids) == decode_text(
        load_tokenizer(checkpoint_in("appended")), expected
    )
    assert "<|im_end|>" in decode_text(tokenizer, ids)
    assert "<|im_end|>" not in decode_text(tokenizer, ids, skip_special=True)


def test_specials_inside_the_vocabulary_keep_their_ids(checkpoint_in):
    tokenizer = load_tokenizer(checkpoint_in("inside"))
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("[BOS]", "[EOS]")] == [0, 1]


def test_kimis_layout_puts_256_specials_above_the_ranks(checkpoint_in):
    path = checkpoint_in("tiktoken")
    assert not (path / "tokenizer.json").exists()
    tokenizer = load_tokenizer(path)
    files = tokenizer.tiktoken_files
    first = len(files.ranks)
    assert len(tokenizer) == first + 256
    assert tokenizer.convert_tokens_to_ids("[BOS]") == first
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") == first + 21
    assert tokenizer.convert_tokens_to_ids(f"<|reserved_token_{first + 5}|>") == first + 5


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_kimis_layout_never_runs_its_tokenizer_code(checkpoint_in, trust_remote_code):
    """Its tokenization_moonshot.py raises when imported: loading must not need it, even when
    the operator allows remote code."""
    path = checkpoint_in("tiktoken")
    assert "raise RuntimeError" in (path / "tokenization_moonshot.py").read_text()
    assert load_tokenizer(path, trust_remote_code=trust_remote_code).tiktoken_files


def test_the_fast_tokenizer_equals_tiktoken_on_mixed_text(tmp_path):
    """A BPE of 3,000 ranks trained on mixed scripts, read as Kimi's files: every random text
    tokenises as tiktoken (the library Kimi's own code wraps) tokenises it."""
    rng = random.Random(0)
    corpus = ["".join(rng.choice(PIECES) for _ in range(30)) for _ in range(400)]
    write_tiktoken(tmp_path, train_bpe(3000, corpus), 3000, 8192)
    tokenizer = load_tokenizer(tmp_path)  # the tokenizer's files alone
    reference = kimi_encoding(tokenizer.tiktoken_files)
    for _ in range(2000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(
            text, disallowed_special=()
        ), repr(text)
    text = "hi<|im_end|>there"
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(
        text, allowed_special="all"
    )


def test_a_real_sized_vocabulary_puts_the_specials_at_kimis_ids(tmp_path):
    write_tiktoken(tmp_path, train_bpe(512), 163584, 8192)
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == 163840
    assert tokenizer.convert_tokens_to_ids("[EOS]") == 163585
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") == 163605
    reference = kimi_encoding(tokenizer.tiktoken_files)
    text = "가나, the red circle 한국어 中文"  # 가나 is a filler token, as a pre-token of its own
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert (
        ids == reference.encode(text) and ids[0] == tokenizer.tiktoken_files.ranks["가나".encode()]
    )


def test_the_chat_template_file_comes_first(checkpoint_in, tmp_path):
    path = shutil.copytree(checkpoint_in("tiktoken"), tmp_path / "c")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    tokenizer = load_tokenizer(path)
    assert decode_text(tokenizer, render_prompt(tokenizer, MESSAGES[1:])) == MESSAGES[1]["content"]


@pytest.mark.parametrize("as_file", [False, True])
def test_a_given_chat_template_replaces_the_checkpoints(checkpoint_in, tmp_path, as_file):
    """--chat-template, as vLLM's: the template itself, or a file holding it."""
    template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    if as_file:
        (tmp_path / "t.jinja").write_text(template)
    given = str(tmp_path / "t.jinja") if as_file else template
    tokenizer = load_tokenizer(checkpoint_in("appended"), chat_template=given)
    assert tokenizer.chat_template == template
    assert decode_text(tokenizer, render_prompt(tokenizer, MESSAGES[1:])).startswith("<What")


@pytest.mark.parametrize(
    "given,message",
    [
        ("no/such/template.jinja", "neither a template nor a file to read"),
        ("{% for m in messages %}", "is not a Jinja template"),
    ],
)
def test_a_chat_template_that_cannot_be_used_is_refused_at_start(checkpoint_in, given, message):
    with pytest.raises(CheckpointError, match=message):
        load_tokenizer(checkpoint_in("appended"), chat_template=given)


def broken(checkpoint_in, tmp_path, edit):
    path = shutil.copytree(checkpoint_in("tiktoken"), tmp_path / "c")
    edit(path)
    return path


@pytest.mark.parametrize(
    "edit,problem",
    [
        (
            lambda p: p.joinpath("tiktoken.model").write_text("not base64 at all\n"),
            "tiktoken.model:1",
        ),
        (
            lambda p: p.joinpath("tiktoken.model").write_text(
                "\n".join(f"{base64.b64encode(bytes([b])).decode()} {b + 1}" for b in range(256))
            ),
            "ranks must be 0 to 255",
        ),
        (
            lambda p: p.joinpath("tiktoken.model").write_text(
                "\n".join(f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(100))
            ),
            "every single byte",
        ),
        (
            lambda p: config_edit(
                p, lambda c: c["added_tokens_decoder"].update({"3": {"content": "[X]"}})
            ),
            "not among the 4096 ids after",
        ),
        (  # a far id would make millions of reserved tokens
            lambda p: config_edit(
                p, lambda c: c["added_tokens_decoder"].update({"3000000": {"content": "[X]"}})
            ),
            "not among the 4096 ids after",
        ),
        (  # the same id twice, spelt in another script's digits
            lambda p: config_edit(
                p, lambda c: c["added_tokens_decoder"].update({"٧٦٨": {"content": "[X]"}})
            ),
            "is not 'id'",
        ),
        (  # a special token spelt like a BPE token would take that token's place
            lambda p: config_edit(
                p, lambda c: c["added_tokens_decoder"].update({"1000": {"content": "the"}})
            ),
            "given twice",
        ),
        (lambda p: config_edit(p, lambda c: c.update(added_tokens_decoder=[])), "must map ids"),
        (lambda p: config_edit(p, lambda c: c.update(bos_token="[NOPE]")), "bos_token"),
        (  # every substring of one string: merges that would take gigabytes
            lambda p: substrings_everywhere(p),
            "split in more ways than a BPE's",
        ),
    ],
)
def test_bad_tiktoken_files_are_errors_that_name_them(checkpoint_in, tmp_path, edit, problem):
    with pytest.raises(CheckpointError, match=problem):
        load_tokenizer(broken(checkpoint_in, tmp_path, edit))


def substrings_everywhere(path):
    """A tiktoken.model of every substring of one text, and no special tokens."""
    text = bytes(range(97, 123)) * 4
    tokens = [bytes([b]) for b in range(256)]
    tokens += sorted({text[i:j] for i in range(len(text)) for j in range(i + 2, len(text) + 1)})
    lines = (f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(tokens))
    path.joinpath("tiktoken.model").write_text("\n".join(lines))
    names = ("added_tokens_decoder", "bos_token", "eos_token", "pad_token")
    config_edit(path, lambda c: [c.pop(name) for name in names])


def config_edit(path, change):
    config = json.loads((path / "tokenizer_config.json").read_text())
    change(config)
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_without_tokenizer_files_remote_code_is_the_only_way(checkpoint_in, tmp_path):
    path = broken(checkpoint_in, tmp_path, lambda p: p.joinpath("tiktoken.model").unlink())
    with pytest.raises(CheckpointError, match="no tokenizer.json nor tiktoken.model"):
        load_tokenizer(path)
    with pytest.raises(CheckpointError, match="epd ran the checkpoint's tokenizer code"):
        load_tokenizer(path, trust_remote_code=True)  # asked for, and the only way: it runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_bytes_are_the_tokens_own_even_inside_a_character(checkpoint_in, layout):
    tokenizer = load_tokenizer(checkpoint_in(layout))
    ids = tokenizer.encode("中", add_special_tokens=False)  # 3 bytes, no merge: a token each
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == "中".encode()
    assert len(ids) == 3 and all(decode_text(tokenizer, [i]) == "\ufffd" for i in ids)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(tokenizer, eos) == b"<|im_end|>"
