"""A request's tools where they shape the prompt and the grammar, before any reply: the calls a
reply is forced to be (`tool_choice` "required" or a named function), and the note that describes
the tools to a model whose chat template does not show them. The replies that carry the calls
are `tools.py`'s."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from epd.api.schema import ChatCompletionRequest, Tool

MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ForcedTools:
    """The calls a reply must be: one named function's arguments, or a list of calls."""

    tools: tuple[Tool, ...]
    name: str = ""  # a named function; "" for `required`
    parallel: bool = True

    @classmethod
    def of(cls, request: ChatCompletionRequest) -> ForcedTools | None:
        tools, parallel = tuple(request.tools or ()), request.parallel_tool_calls is not False
        if request.named_tool is not None:
            return cls(tools, request.named_tool, parallel)
        return cls(tools, parallel=parallel) if request.tool_choice == "required" else None

    def schema(self) -> dict[str, Any]:
        """The JSON schema the reply's text must follow."""
        if self.name:
            return next(t.function.parameters for t in self.tools if t.function.name == self.name)
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": t.function.parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        most = MAX_PARALLEL_CALLS if self.parallel else 1  # a bound, so any model ends the list
        return {"type": "array", "minItems": 1, "maxItems": most, "items": {"anyOf": calls}}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls a complete reply's text holds (None if it is not one: the grammar
        makes that a bug, but a bug must not cost the reply)."""
        try:
            if self.name:
                json.loads(text)
                named = [(self.name, text)]
            else:
                named = [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for name, arguments in named
        ]


def describe_tools(tools: list[Tool]) -> str:
    """A system message for a template that does not show tools itself."""
    specs = [t.function.model_dump(exclude_none=True) for t in tools]
    return "You may call these functions (JSON schemas of their parameters):\n" + json.dumps(specs)
