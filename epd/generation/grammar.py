"""Grammar-constrained decoding with llguidance: which tokens may come next, per request.

A request's grammar travels as llguidance's grammar text (`SamplingParams.grammar`, built by
the API from a JSON schema, a regex, a choice or a Lark grammar). Each process that samples for
it (prefill for the first token, decode for the rest) turns it into a matcher over its own
tokenizer; a compiled matcher is kept per grammar text and copied for each request. The mask
sets every token the grammar forbids to -inf before sampling; a token the matcher refuses
anyway fails that request alone. JSON grammars use compact separators and no free whitespace,
so a small model cannot loop on whitespace.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import secrets
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
from transformers import PreTrainedTokenizerBase

from epd.checkpoint.tiktoken_files import TiktokenFiles
from epd.checkpoint.tokenizer import vocabulary_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
CACHED_GRAMMARS = 256
# llguidance's own limits, but errors without its parser state: that dump is kilobytes long
# and would go back to the client in every error about its grammar.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A grammar that cannot be used, or output the grammar does not allow."""


class GrammarUnavailable(GrammarError):
    """No grammar can be used: llguidance cannot read this checkpoint's tokenizer."""


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """llguidance grammar text for output valid against a JSON schema, compact JSON. The
    schema `true` allows any JSON value, as `{}` does; `false` allows none."""
    if schema is False:
        raise GrammarError("the schema false allows no value")
    schema = {} if schema is True else schema
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema),
        overrides=COMPACT_JSON,  # type: ignore[arg-type]
    )


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Sequence[str]) -> str:
    return llguidance.grammar_from("choice", json.dumps(list(choices)))


def lark_grammar(text: str) -> str:
    return llguidance.grammar_from("grammar", text)


class Grammars:
    """One process's matchers: its tokenizer seen by llguidance, compiled grammars by text.

    Structured outputs are an optional part: where llguidance cannot read the tokenizer, the
    process says so once and serves everything else, and each grammar asked for is refused with
    the reason (`GrammarUnavailable`)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Collection[int]
    ) -> None:
        self.unavailable = ""  # why no grammar can be used, if none can
        try:
            self.tokenizer = llguidance_tokenizer(tokenizer, vocab_size, sorted(eos_ids))
        except (ValueError, RuntimeError) as e:  # what llguidance raises: the part is optional
            self.unavailable = f"llguidance cannot read this model's tokenizer: {e}"
            log.warning("structured outputs are unavailable: %s", self.unavailable)
        self.compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()  # the API checks grammars on its loop, prefill on its thread
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self.markers: dict[bytes, list[int]] = {}  # `marker_tokens`, by the marker's rest

    @cached_property
    def vocabulary_bytes(self) -> list[bytes]:
        return vocabulary_bytes(self.hf_tokenizer, self.vocab_size)

    def token_bytes(self, token: int) -> bytes:
        return self.vocabulary_bytes[token]

    def tokenize(self, data: bytes) -> list[int]:
        """Text as llguidance tokenises it for this process's tokenizer."""
        return list(self.tokenizer.tokenize_bytes(data))

    def marker_tokens(self, rest: bytes) -> list[int]:
        """The tokens a reply may write where `rest` is what is left of a marker it began:
        those whose bytes begin `rest`, or begin with it (made once per `rest`)."""
        with self.lock:
            found = self.markers.get(rest)
            if found is None:
                found = self.markers[rest] = [
                    i
                    for i, data in enumerate(self.vocabulary_bytes)
                    if data and (rest.startswith(data) or data.startswith(rest))
                ]
            return found

    def check(self, grammar: str) -> None:
        """Raise GrammarError naming the problem if `grammar` cannot be used."""
        self.compile(grammar)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `grammar`."""
        return self.compile(grammar).deep_copy()

    def forget(self, grammar: str) -> None:
        """Drop a grammar whose matcher failed. Copies share their lexer with the compiled
        matcher: once one hits a lexer limit (say, `a{999999}`), every later copy fails at its
        first token, and only a fresh compile tells that again."""
        with self.lock:
            self.compiled.pop(grammar, None)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The cached matcher at the start of `grammar` (not to be fed tokens: copy it)."""
        if self.unavailable:
            raise GrammarUnavailable(f"structured outputs are unavailable: {self.unavailable}")
        with self.lock:
            template = self.compiled.get(grammar)
            if template is None:
                problem = llguidance.LLMatcher.validate_grammar(
                    grammar, self.tokenizer, limits=LIMITS
                )
                if problem and "unknown special token" in problem:
                    # their names are not theirs here (`unspellable_specials`)
                    raise GrammarError("unusable grammar: name special tokens by id, as <[12]>")
                if problem:
                    raise GrammarError(f"unusable grammar: {problem}")
                template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
                if template.is_error():
                    raise GrammarError(f"unusable grammar: {template.get_error()}")
                self.compiled[grammar] = template
                if len(self.compiled) > CACHED_GRAMMARS:
                    self.compiled.popitem(last=False)
            self.compiled.move_to_end(grammar)
            return template


def llguidance_tokenizer(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: list[int]
) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it, its special tokens renamed so that no text spells
    them (`unspellable`): tiktoken's ranks where the checkpoint ships them (read by epd,
    `tiktoken_files`, or by its own tokenizer code, whose `.model` is a tiktoken encoding),
    else the fast tokenizer's JSON."""
    files = getattr(tokenizer, "tiktoken_files", None)
    encoding: Any = getattr(tokenizer, "model", None)
    if files is None and type(encoding).__module__.startswith("tiktoken"):
        files = TiktokenFiles(
            encoding._mergeable_ranks, encoding._special_tokens, encoding._pat_str
        )
    if files is not None:
        mark = unspellable()
        return llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]
            encoder=files.ranks,
            special_tokens={name + mark: i for name, i in files.specials.items()},
            pattern=files.pattern,
            eos_token=eos_ids,
            n_vocab=vocab_size,
        )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return llguidance.LLTokenizer(
            unspellable_specials(backend), n_vocab=vocab_size, eos_token=eos_ids
        )
    raise GrammarError(
        f"structured outputs need a fast or a tiktoken tokenizer, not {type(tokenizer).__name__}"
    )


def unspellable() -> str:
    """A suffix no output can spell, for special tokens' names. llguidance tokenises text a
    grammar forces with its tokenizer, and where the text spells a special token ("<|im_end|>"
    in a JSON enum), it allowed only that token, then refused it: the text itself could not be
    written. Special tokens keep their ids (the eos ids still end a grammar); their names lose
    nothing a grammar of ours refers to."""
    return f"\x00{secrets.token_hex(8)}"


def unspellable_specials(backend: Any) -> str:
    """The tokenizers library's JSON of `backend`, each special token renamed (`unspellable`)
    where it is added and, where it is also in the model's vocabulary under the same id (as
    `BpeTrainer(special_tokens=...)` writes them), there too: llguidance reads both, and would
    count a token renamed in one place only twice."""
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    mark, renamed = unspellable(), {}
    for token in spec.get("added_tokens", ()):
        if token.get("special"):
            renamed[token["content"]] = (token["id"], token["content"] + mark)
            token["content"] += mark
    model = spec.get("model", {})
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: text → id
        inside = {text: new for text, (i, new) in renamed.items() if vocab.get(text) == i}
        model["vocab"] = {inside.get(text, text): i for text, i in vocab.items()}
        if model.get("merges"):  # a merge naming a renamed token would no longer load
            model["merges"] = [renamed_merge(inside, merge) for merge in model["merges"]]
    elif isinstance(vocab, list):  # Unigram: [text, score], the id is the place
        for i, entry in enumerate(vocab):
            if renamed.get(entry[0], (None,))[0] == i:
                entry[0] = renamed[entry[0]][1]
    return json.dumps(spec)


def renamed_merge(inside: dict[str, str], merge: Any) -> Any:
    """A merge ("a b" or ["a", "b"]) with its renamed tokens' new names."""
    parts = [
        inside.get(part, part) for part in (merge.split(" ") if isinstance(merge, str) else merge)
    ]
    return " ".join(parts) if isinstance(merge, str) else parts


def mask_forbidden(
    logits: torch.Tensor,
    rows: list[int],
    matchers: list[Any],
    also_allowed: Sequence[Sequence[int]] = (),
) -> None:
    """Set, in place, the logits (B, vocab) of tokens each row's matcher forbids to -inf; a
    row's `also_allowed` tokens are allowed besides (a row without a matcher: only those).

    Raises GrammarError for a matcher that failed (a lexer limit, say): its mask would allow
    only a stop token, and the output would end there, short of what the grammar asks for."""
    import torch  # here: requests' grammars are checked where no torch is imported (`epd route`)

    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), logits.shape[-1])  # (n, words)
    bitmask.fill(0)
    for i, matcher in enumerate(matchers):
        if matcher is None:
            continue
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, i)
        if matcher.is_error():
            raise GrammarError(f"the grammar failed: {matcher.get_error()}")
    index = torch.tensor(rows, device=logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    # (n, words, 1): bit j of word w is token 32w+j
    words = torch.from_numpy(bitmask).to(logits.device)[:, :, None]
    allowed = ((words >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]  # (n, vocab)
    for i, extra in enumerate(also_allowed):
        if extra:
            allowed[i, torch.tensor(extra, device=logits.device)] = True
    logits[index] = logits[index].masked_fill(~allowed, -math.inf)


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feed the matcher a sampled token; True once the grammar allows nothing more."""
    if not matcher.consume_token(token) or matcher.is_error():
        raise GrammarError(f"the grammar refused token {token}: {matcher.get_error()}")
    return bool(matcher.is_stopped())
