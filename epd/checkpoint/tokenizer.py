"""The checkpoint's tokenizer and chat template, read natively from the layout it ships.

- `tokenizer.json` (the tokenizers library), its special tokens inside the vocabulary or added
  after it: what most checkpoints ship, and what `epd make-checkpoint` writes.
- Kimi's tiktoken files (`tiktoken.model` and the special tokens of `tokenizer_config.json`, no
  `tokenizer.json`): what the real Kimi-VL checkpoints ship (`tiktoken_files.py`).

The chat template comes from the checkpoint: `chat_template.jinja`, else `chat_template.json`,
else `tokenizer_config.json`; `--chat-template` replaces it. A checkpoint's own tokenizer code
(its `auto_map`) runs only when `trust_remote_code` asks for it and neither layout is there.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from epd.checkpoint.config import CheckpointError, load_generation_config, read_json
from epd.checkpoint.tiktoken_files import TiktokenFiles, byte_alphabet, has_ranks

log = logging.getLogger(__name__)

SPECIAL_TOKENS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "[PAD]",
)
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(
    checkpoint: str | Path, trust_remote_code: bool = False, chat_template: str = ""
) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with `chat_template` (a file or the template itself, as
    `given_template` reads it) in place of the checkpoint's own if one is given."""
    path = Path(checkpoint)
    try:
        if (path / "tokenizer.json").is_file():
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        elif has_ranks(path):
            tokenizer = tiktoken_tokenizer(path)
        elif trust_remote_code:
            tokenizer = remote_tokenizer(path)
        else:
            raise CheckpointError(
                f"{path} has no tokenizer.json nor tiktoken.model; --trust-remote-code would "
                "run the tokenizer code it names"
            )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer of {checkpoint}: {e}") from e
    if chat_template:
        tokenizer.chat_template = given_template(chat_template)
    if not tokenizer.chat_template:
        raise CheckpointError(f"the tokenizer of {checkpoint} has no chat template")
    return tokenizer


def given_template(value: str) -> str:
    """`--chat-template` as vLLM takes it: the template itself where it holds a brace or a line
    break, else the file it names; checked as Jinja now rather than at the first request."""
    if any(c in value for c in "{}\n"):
        template = value
    else:
        try:
            template = Path(value).read_text()
        except OSError as e:
            raise CheckpointError(
                f"--chat-template {value!r} is neither a template nor a file to read: {e.strerror}"
            ) from None
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"--chat-template is not a Jinja template: {e}") from None
    return template


def remote_tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    """The tokenizer the checkpoint's own code builds (its `auto_map`), where it ships no files
    epd reads: asked for by `trust_remote_code`."""
    log.warning("running the tokenizer code of %s (--trust-remote-code)", checkpoint)
    try:
        return AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=True)
    except Exception as e:  # whatever the checkpoint's code raises
        raise CheckpointError(f"its tokenizer code failed: {type(e).__name__}: {e}") from e


def tiktoken_tokenizer(checkpoint: Path) -> PreTrainedTokenizerFast:
    """Kimi's tiktoken files as a fast tokenizer; `tokenizer.tiktoken_files` keeps what they
    hold for llguidance's tiktoken path."""
    config = read_json(checkpoint / "tokenizer_config.json")
    files = TiktokenFiles.read(checkpoint, config)
    named = {key: token_name(config[key]) for key in NAMED_SPECIALS if config.get(key)}
    for key, name in named.items():
        if name not in files.specials:
            raise CheckpointError(f"tokenizer_config.json: {key} {name!r} is not a special token")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=files.tokenizer(),
        chat_template=chat_template(checkpoint, config),
        model_max_length=config.get("model_max_length", int(1e30)),
        clean_up_tokenization_spaces=False,
        **named,
    )
    tokenizer.tiktoken_files = files
    return tokenizer


def token_name(value: Any) -> str:
    """A special token as tokenizer_config.json spells it: its text, or {"content": text}."""
    name = value.get("content") if isinstance(value, dict) else value
    if not isinstance(name, str):
        raise CheckpointError(f"tokenizer_config.json: {value!r} is not a token")
    return name


def chat_template(checkpoint: Path, config: dict[str, Any]) -> str | None:
    """The checkpoint's chat template: its own file, or the one in its configs (a list of
    named templates gives the one named "default")."""
    if (checkpoint / "chat_template.jinja").is_file():
        return (checkpoint / "chat_template.jinja").read_text()
    if (checkpoint / "chat_template.json").is_file():
        config = read_json(checkpoint / "chat_template.json")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"chat_template is not text: {json.dumps(template)[:80]}")
    return template


STOP_TOKENS = ("<|im_end|>", "[EOS]")  # Kimi-VL ends a reply on either


def stop_token_ids(checkpoint: str | Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """generation_config.json's eos ids, plus <|im_end|> and [EOS] should it omit one."""
    ids = list(load_generation_config(checkpoint).eos_token_ids)
    for token in STOP_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def decode_text(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool = False
) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert isinstance(text, str)
    return text


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The bytes a token stands for, though they may end inside a character (what OpenAI's
    logprobs give as `bytes`): a special token's text, a byte-level token's bytes,
    sentencepiece's `<0xAB>` byte; else the text it decodes to."""
    specials, byte_level = spelling(tokenizer)
    if token_id in specials:
        return specials[token_id]
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and byte_level and all(c in BYTE_VALUES for c in piece):
        return bytes(BYTE_VALUES[c] for c in piece)
    if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
        return bytes.fromhex(piece[3:5])
    return decode_text(tokenizer, [token_id]).encode()


def vocabulary_bytes(tokenizer: PreTrainedTokenizerBase, size: int) -> list[bytes]:
    """`token_bytes` of every id below `size` (b"" for ids the tokenizer lacks), at once."""
    known = min(size, len(tokenizer))
    return [token_bytes(tokenizer, i) for i in range(known)] + [b""] * (size - known)


BYTE_VALUES = {c: b for b, c in enumerate(byte_alphabet())}


@lru_cache(maxsize=8)
def spelling(tokenizer: PreTrainedTokenizerBase) -> tuple[dict[int, bytes], bool]:
    """A tokenizer's added tokens' bytes by id, and whether its other tokens are byte-level
    strings (GPT-2's alphabet); read once."""
    specials = {i: str(t).encode() for i, t in tokenizer.added_tokens_decoder.items()}
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return specials, type(decoder).__name__ == "ByteLevel"
