"""Tool calls: forced ones by constrained decoding, and the replies that carry them.

`tool_choice: "required"` or a named function makes the reply a grammar: a named function's
arguments are its parameters schema; `required` is a JSON array of one or more
`{"name": ..., "parameters": {...}}` objects, one of the tools' each (at most one unless
`parallel_tool_calls`, at most MAX_PARALLEL_CALLS then). The reply then holds
`message.tool_calls` (ids `call_…`, arguments a JSON string). As in OpenAI's API and vLLM, a
named function's reply finishes as its text would (`stop`, or `length` with its arguments cut
short), and a `required` list finishes with `tool_calls`.
`auto` needs tool-call markup in the model's chat template to parse; Kimi-VL's has none, so
`auto` replies are text. A template that does not show the tools gets them described in a
system message, so the model can see what it may call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epd.api.responses import Reply, ended, thinking
from epd.api.tool_prompts import ForcedTools

if TYPE_CHECKING:
    from epd.wire.messages import TokenDelta


@dataclass
class ToolReply(Reply):
    """A chat reply whose choices are tool calls. A named call cut short by max_tokens is the
    call with its arguments cut short, whole or streamed; a `required` list cut short cannot
    be parsed into calls, and stays text, with finish_reason `length`."""

    forced: ForcedTools = field(default_factory=lambda: ForcedTools(()))
    texts: dict[int, str] = field(default_factory=dict)  # streamed text so far, by choice
    opened: set[int] = field(default_factory=set)  # named: choices whose call header went out
    held: dict[int, list[TokenDelta]] = field(default_factory=dict)  # not in a chunk yet

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.forced.name:  # its arguments as they are, whole or cut short
            return {"role": "assistant", "content": None, "tool_calls": [self.call(text)]}, (
                finish_reason
            )
        calls = self.forced.calls(text) if finish_reason == "stop" else None
        if calls is None:  # a list cut short: what there is, as text
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    def call(self, arguments: str) -> dict[str, Any]:
        function = {"name": self.forced.name, "arguments": arguments}
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}

    def completion(self, deltas: list[TokenDelta]) -> dict[str, Any]:
        body = super().completion(deltas)
        for choice in body["choices"]:
            said = choice["message"]
            message, choice["finish_reason"] = self.message(
                said["content"] or "", choice["finish_reason"]
            )
            choice["message"] = message | {k: v for k, v in said.items() if "reasoning" in k}
        return body

    def delta_chunk(self, delta: TokenDelta) -> str:
        """Named: the call's header once, then pieces of its arguments as they come. Required:
        the whole list of calls when the choice ends (it is one JSON array until then)."""
        index = delta.index
        thought = thinking(delta)
        if thought and not delta.text and delta.finish_reason is None:  # the calls come after
            choice = {"index": index, "delta": thought, "logprobs": self.logprobs([delta])}
            return self.chunk([choice | {"finish_reason": None}])
        self.texts[index] = self.texts.get(index, "") + delta.text
        self.held.setdefault(index, []).append(delta)
        finish = delta.finish_reason
        content: dict[str, Any] = {}
        if self.forced.name:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
            if index not in self.opened:
                self.opened.add(index)
                call = {"index": 0, **self.call(delta.text)}
            content = {"tool_calls": [call]}
        elif finish == "stop" and (calls := self.forced.calls(self.texts[index])) is not None:
            content = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        elif finish is not None:  # cut short: what there is, as text
            content = {"content": self.texts[index]}
        elif not thought:
            return ""  # a list of calls is not a call until it is complete
        content |= thought
        listed = "tool_calls" in content and finish == "stop" and not self.forced.name
        reason = "tool_calls" if listed else finish
        logprobs = self.logprobs(self.held.pop(index))
        choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": reason}
        return self.chunk([choice | ended(delta)])
