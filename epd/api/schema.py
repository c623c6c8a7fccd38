"""The chat-completions request as the API accepts it; anything else is a 400."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from epd.api.errors import APIError, bad_request


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]
    name: str | None = None

    @model_validator(mode="after")
    def images_only_from_users(self) -> ChatMessage:
        parts = self.content if isinstance(self.content, list) else []
        if self.role != "user" and any(isinstance(p, ImagePart) for p in parts):
            raise ValueError(f"{self.role} messages cannot hold images")
        return self


class StreamOptions(Strict):
    include_usage: bool = False


class ChatCompletionRequest(Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or -1: no limit
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's generators take
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False  # vLLM's extra: exactly max_tokens, as benchmark clients ask
    n: Literal[1] = 1
    user: str | None = None
    frequency_penalty: Literal[0] = 0
    presence_penalty: Literal[0] = 0

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else stop or []
        if len(values) > 4 or any(not s for s in values):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stop

    @model_validator(mode="after")
    def consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options requires stream=true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def parse_request(body: Any) -> ChatCompletionRequest:
    """Validate a JSON body; the first problem becomes an OpenAI-style 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _as_api_error(e) from None


def _as_api_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return bad_request(
            f"unsupported parameter: {param}", param=param, code="unsupported_parameter"
        )
    if param in ("n", "frequency_penalty", "presence_penalty"):
        return bad_request(
            f"{param} is not supported (only its default)", param, "unsupported_parameter"
        )
    if not param:  # a check across several fields
        return bad_request(f"invalid request: {first['msg']}")
    return bad_request(f"invalid {param}: {first['msg']}", param=param)
