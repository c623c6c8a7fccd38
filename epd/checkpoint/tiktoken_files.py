"""Kimi's tiktoken tokenizer, read from its files without its remote code.

Kimi-VL (like Moonshot's other models) ships `tiktoken.model`, one `base64(token) rank` line per
byte-level BPE token with ranks 0..n-1, and a `tokenizer_config.json` whose
`added_tokens_decoder` names the special tokens above the ranks (Kimi-VL: 256 from 163584, the
unnamed ones `<|reserved_token_N|>`). Its own code (`tokenization_moonshot.py`) wraps tiktoken
with Kimi's split pattern, and does not import on transformers 5. Here the same files become
`TiktokenFiles`: the ranks, the pattern and the special tokens as they are (llguidance's tiktoken
path takes them so), and from them a fast tokenizer that the rest of epd uses like any other.

The fast tokenizer is the ranks as a byte-level BPE: tiktoken merges, again and again, the
adjacent pair whose concatenation has the lowest rank; a BPE that knows every split of every
token into two tokens, ranked by the whole token's rank, merges the same pairs in the same order
(`merges`). A pre-token that is itself a token is that token, as in tiktoken (`ignore_merges`).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from epd.checkpoint.config import CheckpointError

RANKS_FILE = "tiktoken.model"
MAX_RANKS_BYTES = 64 << 20  # Kimi-VL's is 2.5 MB
MAX_TOKEN_BYTES = 1024  # Kimi-VL's longest token has 128
MAX_SPECIAL_TOKENS = 4096  # Kimi-VL has 256, from its ranks on
# Splits of a token into two tokens, on average: a trained BPE's tokens have a few; a file of
# every substring of one string has thousands, and its merges would take gigabytes.
MAX_SPLITS_PER_TOKEN = 8
MAX_RANKS = 1 << 20  # Kimi-VL has 163,584; the largest vocabularies published about 262k

# The split pattern of Kimi's tokenizer code (`pat_str`, public in every Moonshot checkpoint):
# GPT-4o's, with Han runs a piece of their own and Han taken out of the letter classes.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


@dataclass(frozen=True)
class TiktokenFiles:
    """A tiktoken tokenizer as its files give it: BPE ranks, split pattern, special tokens."""

    ranks: dict[bytes, int]  # token bytes → rank, which is the token's id
    specials: dict[str, int]  # name → id, all above the ranks
    pattern: str = KIMI_PATTERN

    @classmethod
    def read(cls, checkpoint: Path, config: dict[str, Any]) -> TiktokenFiles:
        """The files of `checkpoint`, whose `tokenizer_config.json` holds `config`."""
        ranks = read_ranks(checkpoint / RANKS_FILE)
        return cls(ranks, special_tokens(config.get("added_tokens_decoder", {}), ranks))

    def tokenizer(self) -> Tokenizer:
        """The same tokenizer for the tokenizers library (see the module's docstring)."""
        strings = {as_string(token): rank for token, rank in self.ranks.items()}
        bpe = models.BPE(strings, merges(self.ranks), ignore_merges=True)
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(self.pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tokenizer.decoder = decoders.ByteLevel()
        by_id = sorted(self.specials.items(), key=lambda item: item[1])
        tokenizer.add_special_tokens([AddedToken(name, normalized=False) for name, _ in by_id])
        for name, token_id in by_id:  # they follow the ranks without gaps (`special_tokens`)
            if tokenizer.token_to_id(name) != token_id:
                raise CheckpointError(f"special token {name!r} cannot have id {token_id}")
        return tokenizer


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model`: one `base64(token) rank` line per token, ranks 0..n-1 once each."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    if path.stat().st_size > MAX_RANKS_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_RANKS_BYTES} bytes")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            encoded, rank_text = line.split()
            token, rank = base64.b64decode(encoded, validate=True), int(rank_text)
        except (ValueError, binascii.Error):
            raise CheckpointError(f"{path}:{number}: expected 'base64(token) rank'") from None
        if not 0 < len(token) <= MAX_TOKEN_BYTES or token in ranks:
            raise CheckpointError(f"{path}:{number}: an empty, over-long or repeated token")
        ranks[token] = rank
        if len(ranks) > MAX_RANKS:
            raise CheckpointError(f"{path} has more than {MAX_RANKS} tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: the ranks must be 0 to {len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise CheckpointError(f"{path}: every single byte must be a token")
    return ranks


def special_tokens(added: Any, ranks: dict[bytes, int]) -> dict[str, int]:
    """The special tokens of `added_tokens_decoder` ({"163584": {"content": "[BOS]", ...}}),
    all above the ranks and at most MAX_SPECIAL_TOKENS ids on, none spelt like a BPE token,
    and a `<|reserved_token_N|>` for each id between them that it leaves out (tiktoken's ids
    are contiguous)."""
    if not isinstance(added, dict):
        raise CheckpointError("added_tokens_decoder must map ids to tokens")
    first, named = len(ranks), {}
    for key, token in added.items():
        content = token.get("content") if isinstance(token, dict) else token
        if not (key.isascii() and key.isdigit()) or not isinstance(content, str) or not content:
            raise CheckpointError(f"added_tokens_decoder: {key!r} is not 'id': {{'content': ...}}")
        if not first <= int(key) < first + MAX_SPECIAL_TOKENS:
            raise CheckpointError(
                f"special token {content!r} has id {key}, not among the {MAX_SPECIAL_TOKENS} "
                f"ids after the {first} BPE ranks"
            )
        if int(key) in named or content.encode() in ranks:
            raise CheckpointError(f"added_tokens_decoder: {content!r} ({key}) is given twice")
        named[int(key)] = content
    last = max(named, default=first - 1)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, last + 1)}
    if len(specials) != last + 1 - first:
        raise CheckpointError("added_tokens_decoder names one special token twice")
    return specials


def merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ordered by the rank of the whole (tiktoken's
    priority), splits of one token by their left part's rank."""
    found, most = [], MAX_SPLITS_PER_TOKEN * len(ranks)
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], left, right))
        if len(found) > most:
            raise CheckpointError(f"{RANKS_FILE}: its tokens split in more ways than a BPE's")
    found.sort()
    return [(as_string(left), as_string(right)) for _, _, left, right in found]


@cache
def byte_alphabet() -> tuple[str, ...]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's): printable Latin-1 bytes
    stand for themselves, the others for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(0x100, 0x200))
    return tuple(chr(b) if b in printable else chr(next(others)) for b in range(256))


def as_string(token: bytes) -> str:
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token)


def has_ranks(checkpoint: Path) -> bool:
    return (checkpoint / RANKS_FILE).is_file()
