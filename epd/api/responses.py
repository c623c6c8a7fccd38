"""OpenAI chat-completion bodies and stream chunks built from TokenDeltas."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from epd.generation.params import TokenLogprob
from epd.wire.messages import TokenDelta


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

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def logprobs(self, deltas: list[TokenDelta]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {"content": [logprob_json(e) for d in deltas for e in d.logprobs]}

    def completion(self, deltas: list[TokenDelta]) -> dict[str, Any]:
        by_choice: dict[int, list[TokenDelta]] = {}
        for delta in deltas:
            by_choice.setdefault(delta.index, []).append(delta)
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": "".join(d.text for d in mine)},
                "logprobs": self.logprobs(mine),
                "finish_reason": mine[-1].finish_reason,
            }
            for index, mine in sorted(by_choice.items())
        ]
        completion_tokens = sum(mine[-1].completion_tokens for mine in by_choice.values())
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(completion_tokens),
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or self.stream_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def first_chunk(self, index: int = 0) -> str:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self.chunk([choice])

    def delta_chunk(self, delta: TokenDelta) -> str:
        content = {"content": delta.text} if delta.text else {}
        choice = {
            "index": delta.index,
            "delta": content,
            "logprobs": self.logprobs([delta]),
            "finish_reason": delta.finish_reason,
        }
        return self.chunk([choice])

    def usage_chunk(self, completion_tokens: int) -> str:
        return self.chunk([], self.usage(completion_tokens))
