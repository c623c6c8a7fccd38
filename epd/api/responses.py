"""OpenAI chat-completion and legacy completion bodies and stream chunks, from TokenDeltas."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from msgspec.structs import replace

from epd.api.errors import APIError
from epd.api.reasoning import reasoning_of
from epd.generation.params import TokenLogprob
from epd.generation.sampling import Scored
from epd.wire.messages import TokenDelta


def prompt_logprobs_json(
    scored: Sequence[Scored], alternatives: int, spell: Callable[[int], str]
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the prompt's first token (nothing comes before it),
    then for each other token {token id: {logprob, rank, decoded_token}} for the token itself
    and its `alternatives` likeliest (ranked 1, 2, ...)."""

    def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": spell(token)}

    found: list[dict[str, Any] | None] = [None]
    for score in scored:
        ranked = {str(score.token_id): entry(score.token_id, score.logprob, score.rank)}
        for rank, (token, logprob) in enumerate(score.top[:alternatives], start=1):
            ranked.setdefault(str(token), entry(token, logprob, rank))
        found.append(ranked)
    return found


def logprob_json(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
            for t in entry.top_logprobs
        ],
    }


@dataclass
class Reply:
    """Shapes one request's deltas into OpenAI JSON."""

    request_id: str
    model: str
    prompt_tokens: int
    want_logprobs: bool
    stream_usage: bool = False  # every chunk has `usage`: null but in the last (OpenAI's rule)
    created: int = field(default_factory=lambda: int(time.time()))
    # Each prompt's `prompt_logprobs_json`, if the request asked for them (vLLM's extra)
    prompt_logprobs: list[list[dict[str, Any] | None]] = field(default_factory=list)
    echo_text: str = ""  # a chat's `echo`: the text each choice's content begins with
    reasoning: bool = False  # a reasoning parser splits the text (`ReasonedDelta`s come)
    # Prompt tokens whose KV came from prefill's prefix cache (each prompt's once, whatever its
    # n): what clients, as with OpenAI's and vLLM's, read as the part of the prompt not computed.
    cached_tokens: int = 0
    system_fingerprint: str | None = None  # the server's (`fingerprint.py`)
    chunk_object = "chat.completion.chunk"

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def logprobs(self, deltas: list[TokenDelta]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {"content": [logprob_json(e) for d in deltas for e in d.logprobs]}

    def completion(self, deltas: list[TokenDelta]) -> dict[str, Any]:
        groups = by_choice(deltas)
        choices = [
            {
                "index": index,
                "message": self.message_of(mine),
                "logprobs": self.logprobs(mine),
                "finish_reason": mine[-1].finish_reason,
                "stop_reason": mine[-1].stop_reason,
            }
            for index, mine in groups
        ]
        completion_tokens = sum(mine[-1].completion_tokens for _, mine in groups)
        body = {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": self.system_fingerprint,
            "usage": self.usage(completion_tokens),
        }
        if self.prompt_logprobs:  # vLLM puts a chat's beside its choices
            body["prompt_logprobs"] = self.prompt_logprobs[0]
        return body

    def message_of(self, deltas: list[TokenDelta]) -> dict[str, Any]:
        """A choice's message; with a reasoning parser, its reasoning beside its content
        (vLLM's `reasoning`, and `reasoning_content` as clients still read it), null if none."""
        content = self.echo_text + "".join(d.text for d in deltas)
        if not self.reasoning:
            return {"role": "assistant", "content": content}
        thought = "".join(reasoning_of(d) for d in deltas) or None
        return {
            "role": "assistant",
            "content": content or None,
            "reasoning": thought,
            "reasoning_content": thought,
        }

    def opening(self, choices: int) -> list[str]:
        """The chunks a stream starts with: each choice's role."""
        return [self.first_chunk(index) for index in range(choices)]

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or self.stream_usage:
            body["usage"] = usage
        if self.system_fingerprint and self.last_of_stream(choices, usage):
            body["system_fingerprint"] = self.system_fingerprint
        return f"data: {json.dumps(body)}\n\n"

    def last_of_stream(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bool:
        """Whether a chunk is one vLLM stamps with its fingerprint: the usage chunk where the
        stream ends in one, else each chunk that ends a choice."""
        if self.stream_usage:
            return usage is not None
        return any(choice["finish_reason"] is not None for choice in choices)

    def first_chunk(self, index: int = 0) -> str:
        delta = {"role": "assistant", "content": self.echo_text}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self.chunk([choice])

    def delta_chunk(self, delta: TokenDelta) -> str:
        content = {"content": delta.text} if delta.text else {}
        content |= thinking(delta)
        choice = {
            "index": delta.index,
            "delta": content,
            "logprobs": self.logprobs([delta]),
            "finish_reason": delta.finish_reason,
        }
        return self.chunk([choice | ended(delta)])

    def usage_chunk(self, completion_tokens: int) -> str:
        return self.chunk([], self.usage(completion_tokens))

    def error_chunk(self, error: APIError) -> str:
        """An error after the stream began: in-band, as OpenAI sends it."""
        return f"data: {json.dumps(error.body())}\n\n"

    def closing(self) -> str:
        return "data: [DONE]\n\n"


@dataclass(frozen=True)
class Echo:
    """A legacy completion's prompt, given back before each of its choices (`echo`): its
    text and, for `logprobs`, its tokens: the first has no logprob (nothing comes before
    it), each other one its logprob after those before (`scored`)."""

    text: str
    first_token: str
    scored: tuple[TokenLogprob, ...] = ()

    @cached_property
    def tokens(self) -> list[str]:
        return [self.first_token, *(e.token for e in self.scored)]

    @cached_property
    def logprobs(self) -> dict[str, list[Any]]:
        """The prompt's part of a choice's `logprobs`, made once for all its choices."""
        return {
            "tokens": self.tokens,
            "token_logprobs": [None, *(e.logprob for e in self.scored)],
            "top_logprobs": [
                None,
                *({t.token: t.logprob for t in e.top_logprobs} for e in self.scored),
            ],
            "text_offset": offsets(self.tokens, 0, len(self.text)),
        }


def offsets(tokens: list[str], start: int, length: int) -> list[int]:
    """Where each token begins in the `length` characters of text they make, which have
    `start` characters before them: each token after the spelling of those before it, but
    never past the text's end. (A token that ends inside a character spells "\ufffd", a
    character the text holds only once, when the character is whole; a stop string cuts the
    text short.)"""
    found, spelled = [], 0
    for token in tokens:
        found.append(start + min(spelled, length))
        spelled += len(token)
    return found


def thinking(delta: TokenDelta) -> dict[str, str]:
    """A stream delta's reasoning fields, if it carries reasoning."""
    thought = reasoning_of(delta)
    return {"reasoning": thought, "reasoning_content": thought} if thought else {}


def ended(delta: TokenDelta) -> dict[str, Any]:
    """A chat chunk's `stop_reason`, which vLLM gives only in the chunk that ends its choice."""
    return {} if delta.finish_reason is None else {"stop_reason": delta.stop_reason}


def by_choice(deltas: list[TokenDelta]) -> list[tuple[int, list[TokenDelta]]]:
    grouped: dict[int, list[TokenDelta]] = {}
    for delta in deltas:
        grouped.setdefault(delta.index, []).append(delta)
    return sorted(grouped.items())


@dataclass
class TextReply(Reply):
    """The legacy /v1/completions shapes: text choices, logprobs as that API lays them out."""

    chunk_object = "text_completion"
    offsets: dict[int, int] = field(default_factory=dict)  # streamed: each choice's text so far
    # With `echo`: each prompt's, before each of its `n` choices (choice i is prompt i // n's)
    echoes: list[Echo] = field(default_factory=list)
    n: int = 1
    prompt_only: bool = False  # `max_tokens: 0`: the token generated is not told

    def opening(self, choices: int) -> list[str]:
        return []  # no role chunk in this API

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return super().usage(0 if self.prompt_only else completion_tokens)

    def shown(self, delta: TokenDelta) -> TokenDelta:
        """The delta as the client sees it: with `prompt_only`, without its text and logprobs."""
        return replace(delta, text="", logprobs=()) if self.prompt_only else delta

    def echo_for(self, index: int) -> Echo | None:
        """The echo of choice `index`'s prompt, if asked."""
        return self.echoes[index // self.n] if self.echoes else None

    def text_logprobs(
        self, deltas: list[TokenDelta], offset: int = 0, echo: Echo | None = None
    ) -> dict[str, Any] | None:
        """tokens, token_logprobs, top_logprobs (token → logprob) and each token's offset in
        the choice's text; an echoed prompt's first, the generated tokens' after its text."""
        if not self.want_logprobs:
            return None
        entries = [e for d in deltas for e in d.logprobs]
        begins, offset = [], offset + (len(echo.text) if echo else 0)
        for delta in deltas:  # each delta's tokens within the text it brought
            begins += offsets([e.token for e in delta.logprobs], offset, len(delta.text))
            offset += len(delta.text)
        generated: dict[str, list[Any]] = {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
            "text_offset": begins,
        }
        if echo is None:
            return generated
        return {key: echo.logprobs[key] + generated[key] for key in generated}

    def completion(self, deltas: list[TokenDelta]) -> dict[str, Any]:
        groups = by_choice(deltas)
        choices = [self.choice(index, [self.shown(d) for d in mine]) for index, mine in groups]
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": self.system_fingerprint,
            "usage": self.usage(sum(mine[-1].completion_tokens for _, mine in groups)),
        }

    def choice(self, index: int, deltas: list[TokenDelta]) -> dict[str, Any]:
        """Choice `index` whole, after its echoed prompt if asked."""
        echo = self.echo_for(index)
        choice = {
            "index": index,
            "text": (echo.text if echo else "") + "".join(d.text for d in deltas),
            "logprobs": self.text_logprobs(deltas, echo=echo),
            "finish_reason": deltas[-1].finish_reason,
            "stop_reason": deltas[-1].stop_reason,
        }
        if self.prompt_logprobs:  # in each choice, its prompt's (as vLLM's)
            choice["prompt_logprobs"] = self.prompt_logprobs[index // self.n]
        return choice

    def delta_chunk(self, delta: TokenDelta) -> str:
        """A choice's chunk; its first also carries the echoed prompt, if asked."""
        delta = self.shown(delta)
        echo = self.echo_for(delta.index) if delta.index not in self.offsets else None
        offset = self.offsets.get(delta.index, 0)
        logprobs = self.text_logprobs([delta], offset, echo)
        offset += len(echo.text) if echo else 0
        self.offsets[delta.index] = offset + len(delta.text)
        choice = {
            "index": delta.index,
            "text": (echo.text if echo else "") + delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,  # in every legacy chunk, null until the last (vLLM)
        }
        return self.chunk([choice])
