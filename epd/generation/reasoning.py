"""A reasoning model's reply: its reasoning between two markers, then its answer.

Kimi-VL-A3B-Thinking writes `◁think▷ reasoning ◁/think▷ answer`. A reply that does not begin
with the start marker is all answer; one whose prompt already opened the reasoning (a template
that ends in the start marker, or an assistant message continued from inside its reasoning)
begins in it; one cut short before the end marker is all reasoning.

- `Split` follows a reply's text as it grows and says which part each piece belongs to,
  holding back text that may be the start of a marker (the API's `reasoning` and `content`).
- `Gate` follows the same reply token by token, in bytes, for its grammar: structured outputs
  apply to the answer, not to the reasoning (what vLLM does with a reasoning parser).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd.checkpoint.config import read_json
from epd.generation.grammar import GrammarError, Grammars, advance
from epd.generation.params import SamplingParams

START, THINKING, ANSWER = "start", "thinking", "answer"


@dataclass(frozen=True)
class Markers:
    start: str
    end: str


PARSERS = {"kimi_vl": Markers("◁think▷", "◁/think▷")}  # vLLM's --reasoning-parser names


def opened(markers: Markers, text: str) -> bool:
    """Whether a prompt whose reply follows `text` (what comes after its last control token)
    leaves the reasoning open: a start marker with no end marker after it."""
    return text.rfind(markers.start) > text.rfind(markers.end)


class Split:
    """A reply's text as (reasoning, answer) pieces, fed as it grows."""

    def __init__(self, markers: Markers, open_: bool = False) -> None:
        self.markers = markers
        self.state = THINKING if open_ else START
        self.held = ""  # text that may still be the start of the marker the state waits for

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        if self.state == START:
            start = self.markers.start
            if text.startswith(start):
                self.state, text = THINKING, text[len(start) :]
            elif start.startswith(text):
                self.held = text
                return "", ""
            else:
                self.state = ANSWER
        if self.state == ANSWER:
            return "", text
        end = self.markers.end
        if end in text:
            self.state = ANSWER
            before, after = text.split(end, 1)
            return before, after
        kept = partial_suffix(text, end)
        self.held = text[len(text) - kept :]
        return text[: len(text) - kept], ""

    def finish(self) -> tuple[str, str]:
        """What is held, once the reply has ended: a start cut short is answer, an end
        cut short reasoning."""
        held, self.held = self.held, ""
        return (held, "") if self.state == THINKING else ("", held)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Gate:
    """Where a reply's grammar applies when its model reasons first (see the module's doc).

    Until the reply shows whether it reasons, it may write a token the grammar allows (the
    answer has begun: the grammar applies from it) or one that begins the start marker (taken
    as the marker, even where the grammar would allow it too); once it has begun the marker,
    only tokens that go on with it. While it reasons nothing is masked, but it may not end
    (`waits`: its answer would be missing); from the first token after the end marker, the
    grammar applies, and what the token that ends the marker holds after it (whitespace aside)
    is the grammar's first text."""

    def __init__(
        self,
        matcher: Any,
        markers: Markers | None = None,
        open_: bool = False,
        token_bytes: Callable[[int], bytes] = lambda _: b"",
        marker_tokens: Callable[[bytes], Sequence[int]] = lambda _: (),
        tokenize: Callable[[bytes], Sequence[int]] = lambda _: (),
    ) -> None:
        self.grammar, self.token_bytes, self.marker_tokens = matcher, token_bytes, marker_tokens
        self.tokenize = tokenize
        self.state = ANSWER if markers is None else THINKING if open_ else START
        self.start = markers.start.encode() if markers else b""
        self.end = markers.end.encode() if markers else b""
        self.seen = b""  # START: the reply's bytes so far; THINKING: its last few

    @property
    def matcher(self) -> Any:
        """The grammar where it applies to the next token, else None."""
        applies = self.state == ANSWER or (self.state == START and not self.seen)
        return self.grammar if applies else None

    @property
    def waits(self) -> bool:
        """Whether the answer the grammar is for has not begun: the reply may not end yet."""
        return self.state == THINKING or (self.state == START and bool(self.seen))

    @property
    def also_allowed(self) -> Sequence[int]:
        """Tokens allowed besides what the grammar allows: those that go on with the start
        marker, while the reply may still be beginning it."""
        return self.marker_tokens(self.start[len(self.seen) :]) if self.state == START else ()

    def accept(self, token: int) -> bool:
        """Follow the reply with `token`; True once the grammar allows nothing more."""
        if self.state == ANSWER:
            return advance(self.grammar, token)
        seen = self.seen + self.token_bytes(token)
        if self.state == START:
            if seen.startswith(self.start):
                self.state, seen = THINKING, seen[len(self.start) :]
            elif self.start.startswith(seen):
                self.seen = seen
                return False
            else:  # no reasoning: the grammar allowed this token
                self.state, self.seen = ANSWER, b""
                return advance(self.grammar, token)
        if self.end not in seen:  # keep what may be the end marker's beginning
            self.seen = seen[max(0, len(seen) - len(self.end) + 1) :]
            return False
        self.state, self.seen = ANSWER, b""
        begun = seen.split(self.end, 1)[1].lstrip()  # the answer's first text, in this token
        done = False
        for t in self.tokenize(begun):
            if done:
                raise GrammarError("the answer goes on past what its grammar allows")
            done = advance(self.grammar, t)
        return done


def gate(grammars: Grammars, sampling: SamplingParams) -> Gate | None:
    """The request's grammar, following its reasoning if it has any (None: no grammar)."""
    if not sampling.grammar:
        return None
    matcher = grammars.matcher(sampling.grammar)
    if sampling.reasoning is None:
        return Gate(matcher)
    markers = Markers(*sampling.reasoning)
    if markers not in PARSERS.values():  # a peer's: only the parsers' (their tokens are cached)
        raise GrammarError(f"unknown reasoning markers {sampling.reasoning}")
    return Gate(
        matcher,
        markers,
        sampling.reasoning_open,
        grammars.token_bytes,
        grammars.marker_tokens,
        grammars.tokenize,
    )


def prepare(grammars: Grammars) -> None:
    """Find, at start, the tokens every parser's start marker may go on with (a scan of the
    vocabulary each), rather than at a reasoning model's first grammar."""
    if grammars.unavailable:
        return
    for markers in PARSERS.values():
        start = markers.start.encode()
        for begun in range(len(start)):
            grammars.marker_tokens(start[begun:])


def markers_for(parser: str, checkpoint: str | Path, chat_template: str) -> Markers | None:
    """The markers of `parser` ("auto": kimi_vl's for a thinking checkpoint), or None."""
    if parser == "auto":
        thinking = PARSERS["kimi_vl"].start in chat_template or thinking_name(Path(checkpoint))
        return PARSERS["kimi_vl"] if thinking else None
    return PARSERS.get(parser)


def thinking_name(checkpoint: Path) -> bool:
    """Whether the checkpoint's name is a -Thinking model's: config.json's `_name_or_path`,
    its folder, or the folder of the Hugging Face cache's repository it is a snapshot of."""
    named = str(read_json(checkpoint / "config.json").get("_name_or_path", ""))
    folders = [checkpoint.resolve().name]
    if checkpoint.resolve().parent.name == "snapshots":  # models--org--Name/snapshots/<hash>
        folders.append(checkpoint.resolve().parent.parent.name)
    return any("-thinking" in name.lower() for name in (named, *folders))
