"""OpenAI's Responses API (POST /v1/responses), as a chat completion underneath: the request's
`instructions` and `input` become chat messages, and the chat's deltas become one output
message, whole or as the API's stream of typed events.

What it needs beyond one stateless turn of text and images is refused by name: tools, stored
conversations (`previous_response_id`, `conversation`), background runs, input items other
than messages. `text.format` asks for JSON as chat's `response_format` does (json_object, or
a json_schema whose fields lie flat in the format). `store` is accepted and ignored (nothing is
kept to be fetched later), and so is the request's `reasoning` (its effort: a reasoning model
here reasons as it was trained to, as vLLM ignores it too). A reasoning model's reasoning
comes as a reasoning item before the message.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from epd.api.errors import APIError, bad_request
from epd.api.reasoning import reasoning_of
from epd.api.responses import Reply
from epd.api.schema import (
    MAX_CHAT_ITEMS,
    ChatCompletionRequest,
    Lenient,
    chat_items,
    parse_plain,
    parse_request,
)
from epd.wire.messages import TokenDelta

PART_TYPES = ("input_text", "output_text", "input_image", "refusal")


class InputPart(Lenient):
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None  # the SDK always sends one; "original" too

    @field_validator("type")
    @classmethod
    def known(cls, kind: str) -> str:
        if kind not in PART_TYPES:
            raise ValueError(f"content parts of type {kind!r} are not supported")
        return kind


class InputMessage(Lenient):
    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]

    @field_validator("type")
    @classmethod
    def message(cls, kind: str) -> str:
        if kind != "message":  # function_call_output, reasoning, item_reference...
            raise ValueError(f"input items of type {kind!r} are not supported, only messages")
        return kind


class TextFormat(Lenient):
    """The output's format: chat's `response_format`, its json_schema's fields laid flat."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the output follows the schema either way

    @model_validator(mode="after")
    def schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type json_schema needs a name and a schema")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's `response_format` for this format (None: plain text)."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": self.type}
        fields = self.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": fields}

    def echoed(self) -> dict[str, Any]:
        """As a response object gives it back."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(Lenient):  # `verbosity` and the like: ignored
    format: TextFormat | None = None


Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


# Fields that ask for what a stateless text-and-image turn cannot give: (field, why), refused
# unless absent, null, false or empty.
NOT_DONE = {
    "tools": "tools are not supported on /v1/responses; use /v1/chat/completions",
    "tool_choice": "tool_choice is not supported on /v1/responses",
    "previous_response_id": "responses are not stored: send the whole conversation as input",
    "conversation": "conversations are not stored: send the whole conversation as input",
    "background": "background responses are not supported",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses",
}
# What `include` may ask for and get nothing: this model has no reasoning to encrypt (Codex
# asks for it whenever it does not store)
INCLUDES_WITHOUT_CONTENT = ("reasoning.encrypted_content",)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    stream: bool | None = False
    metadata: Metadata | None = Field(None, max_length=16)  # OpenAI's bounds
    text: TextOptions | None = None
    include: list[str] | None = None  # checked in `refused`
    cache_salt: str | None = None  # vLLM's extra, passed on (and checked) as the chat's

    def echoed(self) -> dict[str, Any]:
        """What a response object repeats of its request."""
        fields = ("instructions", "max_output_tokens", "temperature", "top_p", "metadata")
        echoed = {name: value for name in fields if (value := getattr(self, name)) is not None}
        if self.format is not None:
            echoed["text"] = {"format": self.format.echoed()}
        return echoed

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for what a stateless turn cannot give. Extras are only compared, never
        iterated nor hashed: their types were never checked (what is, `include`, is declared)."""
        extra = self.model_extra or {}
        for name, why in NOT_DONE.items():
            if extra.get(name) not in (None, False, [], {}, "auto", "none"):
                return name, why
        if set(self.include or ()) - set(INCLUDES_WITHOUT_CONTENT):
            return "include", f"include may name only {', '.join(INCLUDES_WITHOUT_CONTENT)}"
        return None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this response is made by."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        messages += [chat_message(item) for item in items]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": bool(self.stream),
        }
        for ours, theirs in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("cache_salt", self.cache_salt),
        ):
            if theirs is not None:
                body[ours] = theirs
        if self.format is not None and (response_format := self.format.response_format()):
            body["response_format"] = response_format
        return body


def chat_message(item: InputMessage) -> dict[str, Any]:
    """An input message as a chat one: `developer` is `system`, parts become text and image
    parts."""
    role = "system" if item.role == "developer" else item.role
    if isinstance(item.content, str):
        return {"role": role, "content": item.content}
    return {"role": role, "content": [chat_part(part) for part in item.content]}


def chat_part(part: InputPart) -> dict[str, Any]:
    if part.type == "input_image":
        if part.file_id or not part.image_url:
            raise bad_request("an input_image needs an image_url (files are not stored)", "input")
        image: dict[str, Any] = {"url": part.image_url}
        if part.detail in ("auto", "low", "high"):
            image["detail"] = part.detail
        return {"type": "image_url", "image_url": image}
    text = part.refusal if part.type == "refusal" else part.text
    if text is None:
        raise bad_request(f"an {part.type} part needs its text", param="input")
    return {"type": "text", "text": text}


def parse_responses(body: Any) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """The request, and the chat request it stands for (validated as any chat request)."""
    if isinstance(body, dict) and (items := chat_items(body.get("input"))) > MAX_CHAT_ITEMS:
        raise bad_request(
            f"the input holds {items} items and content parts, over {MAX_CHAT_ITEMS}",
            param="input",
        )
    request = parse_plain(body, ResponsesRequest)
    if (refused := request.refused()) is not None:
        param, why = refused
        raise bad_request(why, param=param, code="unsupported_parameter")
    try:
        return request, parse_request(request.chat_body())
    except APIError as e:
        raise named_as_responses(e, request) from None


# The chat fields a response's own fields become (`chat_body`), as its errors must name them;
# the longest first, as a format's json_schema fields sit in text.format itself.
RESPONSES_NAMES = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
)


def named_as_responses(error: APIError, request: ResponsesRequest) -> APIError:
    """A chat request's error, naming the field of the response request it came from: the
    chat's messages are `instructions` (if any), then `input`'s items, or `input` itself when
    it is a string."""
    param, named = error.param or "", ""
    for chat, ours in RESPONSES_NAMES:
        if param == chat or param.startswith(chat + "."):
            named = ours + param.removeprefix(chat)
            break
    if message := re.fullmatch(r"messages\.(\d+)(\..*)?", param):
        index = int(message[1]) - (1 if request.instructions else 0)
        if index < 0 or isinstance(request.input, str):
            named = "instructions" if index < 0 else "input"
        else:
            named = f"input.{index}{message[2] or ''}"
    if named:
        error.message, error.param = error.message.replace(param, named, 1), named
    return error


@dataclass
class ResponseReply(Reply):
    """One response object (`response`), or its events streamed: created, the message and its
    text part opened, the text's deltas, then each closed and the response completed. A
    reasoning model's reasoning comes first as a reasoning item (its text, its deltas)."""

    echoed: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    reasoning_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    text: str = ""  # streamed so far
    thought: str = ""  # reasoning streamed so far
    opened: list[str] = field(default_factory=list)  # the items streamed: reasoning, message
    events: int = 0  # sequence numbers given

    def response(
        self,
        status: str,
        text: str | None,
        output_tokens: int,
        finish: str | None,
        thought: str = "",
    ) -> dict[str, Any]:
        """The response object; `text` None while nothing is written yet."""
        cut = finish == "length"
        status = "incomplete" if cut and status == "completed" else status
        output = [self.reasoning_item(thought, status)] if thought else []
        output += [] if text is None else [self.message(text, status)]
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": self.model,
            "output": output,
            "instructions": None,
            "max_output_tokens": None,
            "temperature": None,
            "top_p": None,
            "metadata": {},
            "text": {"format": {"type": "text"}},
            **self.echoed,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "store": False,
            "usage": self.response_usage(output_tokens) if status != "in_progress" else None,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [self.part(text)],
        }

    def reasoning_item(self, thought: str, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": thought}]
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "status": status,
            "summary": [],
            "content": content,
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response_usage(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + output_tokens,
        }

    def completion(self, deltas: list[TokenDelta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        thought = "".join(reasoning_of(d) for d in deltas)
        last = deltas[-1]
        return self.response("completed", text, last.completion_tokens, last.finish_reason, thought)

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.events, **fields}
        self.events += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def opening(self, choices: int) -> list[str]:
        started = self.response("in_progress", None, 0, None)
        events = [
            self.event("response.created", response=started),
            self.event("response.in_progress", response=started),
        ]
        if not self.reasoning:  # the message is the first item; else what comes first opens
            events.append(self.open_message())
        return events

    def where(self, item: str) -> dict[str, Any]:
        """An event's item: its id, its place in the output, its (only) content part."""
        index = self.opened.index(item)
        item_id = self.reasoning_id if item == "reasoning" else self.message_id
        return {"item_id": item_id, "output_index": index, "content_index": 0}

    def open_message(self) -> str:
        self.opened.append("message")
        where = self.where("message")
        added = self.message("", "in_progress")
        return self.event(
            "response.output_item.added", output_index=where["output_index"], item=added
        ) + self.event("response.content_part.added", **where, part=self.part(""))

    def delta_chunk(self, delta: TokenDelta) -> str:
        events = ""
        if thought := reasoning_of(delta):
            if not self.opened:
                self.opened.append("reasoning")
                item = self.reasoning_item("", "in_progress")
                events += self.event("response.output_item.added", output_index=0, item=item)
            self.thought += thought
            events += self.event(
                "response.reasoning_text.delta", **self.where("reasoning"), delta=thought
            )
        if (delta.text or delta.finish_reason) and "message" not in self.opened:
            events += self.close_reasoning() + self.open_message()
        self.text += delta.text
        if delta.text:  # a finish alone has no text to add
            events += self.event(
                "response.output_text.delta", **self.where("message"), delta=delta.text, logprobs=[]
            )
        if delta.finish_reason is None:
            return events
        done = self.response(
            "completed", self.text, delta.completion_tokens, delta.finish_reason, self.thought
        )
        where = self.where("message")
        message = done["output"][where["output_index"]]
        return (
            events
            + self.event("response.output_text.done", **where, text=self.text, logprobs=[])
            + self.event("response.content_part.done", **where, part=self.part(self.text))
            + self.event(
                "response.output_item.done", output_index=where["output_index"], item=message
            )
            + self.event(f"response.{done['status']}", response=done)
        )

    def close_reasoning(self) -> str:
        if "reasoning" not in self.opened:
            return ""
        where = self.where("reasoning")
        item = self.reasoning_item(self.thought, "completed")
        return self.event("response.reasoning_text.done", **where, text=self.thought) + self.event(
            "response.output_item.done", output_index=0, item=item
        )

    def usage_chunk(self, completion_tokens: int) -> str:
        return ""  # the usage goes out with the completed response

    def error_chunk(self, error: APIError) -> str:
        """The API's error event: typed for clients that read events, and with `error` as the
        openai SDK looks for to raise it."""
        failure = error.body()["error"]
        return self.event(
            "error",
            code=failure["code"],
            message=failure["message"],
            param=failure["param"],
            error=failure,
        )

    def closing(self) -> str:
        return ""  # this API's streams end with their last event, not [DONE]
