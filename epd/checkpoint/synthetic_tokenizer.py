"""Tokenizers for random checkpoints, in each layout real checkpoints ship them.

- `appended`: `tokenizer.json`, Kimi's special tokens added after the BPE vocabulary.
- `inside`: `tokenizer.json`, the special tokens inside the vocabulary (ids 0-11) and listed
  as added tokens too, as `BpeTrainer(special_tokens=...)` writes them (many published ones).
- `tiktoken`: Kimi-VL's own: `tiktoken.model` (the BPE ranks), 256 special tokens above them
  in `tokenizer_config.json` (Kimi's at their places, the rest `<|reserved_token_N|>`), an
  `auto_map` to tokenizer code that raises if anything imports it, and no `tokenizer.json`.
- `wordpiece`: a BERT-style `tokenizer.json`, which serves text but which llguidance cannot
  read: a checkpoint whose grammar engine cannot be built.
"""

from __future__ import annotations

import base64
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from epd.checkpoint.tiktoken_files import as_string, byte_alphabet
from epd.checkpoint.tokenizer import SPECIAL_TOKENS

LAYOUTS = ("appended", "inside", "tiktoken", "wordpiece")
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text().strip()
CORPUS = """
the a an is are what which how many colour color shape image picture photo in on of and
red green blue yellow purple orange black white grey gray circle square triangle star
one two three four five six first second third last there this that it show shows see
you can describe answer question please tell me who where when why hello world yes no
"""
KIMI_SPECIALS = 256  # special token ids above Kimi's ranks
# Where Kimi-VL puts its special tokens among those 256 ([BOS] at the first, [PAD] at the last).
KIMI_SPECIAL_PLACES = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 10,
    "<|im_middle|>": 17,
    "<|media_start|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "[PAD]": 255,
}
REMOTE_CODE = (
    'raise RuntimeError("epd ran the checkpoint\'s tokenizer code: it must read the files")\n'
)


@dataclass(frozen=True)
class Vocabulary:
    """What a written tokenizer tells the model's config: its size and its special tokens' ids."""

    size: int
    ids: dict[str, int]


def sentences(corpus: list[str] | None) -> list[str]:
    words = CORPUS.split()
    return corpus or [" ".join(words[i:] + words[:i]) for i in range(len(words))]


def build_tokenizer(vocab_size: int, corpus: list[str] | None = None) -> Tokenizer:
    """A byte-level BPE trained on `corpus` (default: a fixed word list), then Kimi's special
    tokens at the end."""
    tokenizer = train_bpe(vocab_size - len(SPECIAL_TOKENS), corpus)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def train_bpe(
    vocab_size: int, corpus: list[str] | None = None, specials: tuple[str, ...] = ()
) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens; `specials` take its first ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(specials),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences(corpus), trainer)
    return tokenizer


def write_tokenizer(
    out: Path, layout: str, vocab_size: int, max_length: int, ranks: int = 0
) -> Vocabulary:
    """Write a tokenizer of about `vocab_size` tokens in `layout` into `out`; `ranks` gives a
    tiktoken layout that many BPE ranks (Kimi-VL's 163584), filled up past the trained ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tokenizer layout {layout!r}; expected one of {LAYOUTS}")
    if layout == "tiktoken":
        return write_tiktoken(out, train_bpe(vocab_size), max(ranks, vocab_size), max_length)
    if layout == "wordpiece":
        tokenizer = wordpiece()
    elif layout == "inside":
        tokenizer = train_bpe(vocab_size, specials=SPECIAL_TOKENS)
    else:
        tokenizer = build_tokenizer(vocab_size)
    write_fast(out, tokenizer, max_length)
    return vocabulary(tokenizer)


def vocabulary(tokenizer: Tokenizer) -> Vocabulary:
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    return Vocabulary(tokenizer.get_vocab_size(), ids)  # type: ignore[arg-type]


def write_fast(out: Path, tokenizer: Tokenizer, max_length: int) -> None:
    """`tokenizer.json` and its `tokenizer_config.json`."""
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"} | kimi_config(max_length)
    dump(out / "tokenizer_config.json", config)


def kimi_config(max_length: int) -> dict[str, Any]:
    """What every layout's `tokenizer_config.json` says of Kimi's tokens and template."""
    return {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def wordpiece() -> Tokenizer:
    """A BERT-style tokenizer: whole words and `##` pieces, then Kimi's special tokens."""
    words = sorted(set(CORPUS.split()))
    pieces = ["[UNK]", *words, *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"), *"?.,!'"]
    pieces += list("abcdefghijklmnopqrstuvwxyz0123456789")
    tokenizer = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tiktoken(out: Path, trained: Tokenizer, ranks: int, max_length: int) -> Vocabulary:
    """Kimi-VL's tokenizer layout (see the module's docstring): the trained BPE's tokens as
    ranks in merge order, filler tokens up to `ranks`, and the 256 special tokens above."""
    tokens = trained_tokens(trained)
    tokens += itertools.islice(fillers(set(tokens)), max(0, ranks - len(tokens)))
    lines = (f"{base64.b64encode(token).decode()} {rank}" for rank, token in enumerate(tokens))
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    first = len(tokens)
    places = {first + offset: name for name, offset in KIMI_SPECIAL_PLACES.items()}
    added = {
        str(i): special(places.get(i, f"<|reserved_token_{i}|>"))
        for i in range(first, first + KIMI_SPECIALS)
    }
    config = {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
    }
    dump(out / "tokenizer_config.json", config | kimi_config(max_length))
    (out / "tokenization_moonshot.py").write_text(REMOTE_CODE)
    ids = {name: first + offset for name, offset in KIMI_SPECIAL_PLACES.items()}
    return Vocabulary(first + KIMI_SPECIALS, ids)


def trained_tokens(trained: Tokenizer) -> list[bytes]:
    """A byte-level BPE's tokens as bytes, in id order (single bytes, then merges in order)."""
    values = {c: b for b, c in enumerate(byte_alphabet())}
    by_id = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    tokens = [bytes(values[c] for c in text) for text, _ in by_id]
    assert all(as_string(t) == text for t, (text, _) in zip(tokens, by_id, strict=True))
    return tokens


def fillers(taken: set[bytes]) -> Iterator[bytes]:
    """Tokens to fill a vocabulary up to a real one's size: pairs of Hangul syllables, which
    text may spell (a pre-token that is one is that token, as in tiktoken) but which no merge
    reaches, since no part of one is a token."""
    syllables = [chr(c) for c in range(0xAC00, 0xD7A4)]
    for a, b in itertools.product(syllables, repeat=2):
        token = (a + b).encode()
        if token not in taken:
            yield token


def special(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def dump(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
