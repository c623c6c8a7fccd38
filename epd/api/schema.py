"""The chat-completions request as the API accepts it.

vLLM's policy: an unknown top-level field is ignored with a warning (clients send fields of
their own), a known one asking for what this server does not do is a 400 naming it, and every
value is checked (a NaN is a float).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from epd.api.errors import APIError, bad_request
from epd.generation.params import (
    LOGIT_BIAS_LIMIT,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)
from epd.multimodal.prompt import Opening

log = logging.getLogger(__name__)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Lenient(BaseModel):
    """An object clients fill with fields of their own (vLLM ignores those too)."""

    model_config = ConfigDict(extra="ignore")


class ImageURL(Lenient):  # clients add keys of their own, e.g. LiteLLM's format
    url: str
    detail: Literal["auto", "low", "high", "original"] | None = None  # all read at full size


class TextPart(Lenient):  # clients add keys of their own, e.g. cache_control (vLLM ignores them)
    type: Literal["text"]
    text: str


class ImagePart(Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(Lenient):  # an earlier assistant turn's refusal, sent back as history
    type: Literal["refusal"]
    refusal: str


Part = Annotated[TextPart | ImagePart | RefusalPart, Field(discriminator="type")]


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionSpec(Lenient):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def an_object(cls, value: Any) -> Any:
        """A call's arguments are a JSON object, as OpenAI's always are: `parameters: null`
        (as the openai SDK dumps a function without them) takes none, a schema without a type
        (`{}` among them) is one for an object, and a schema of any other type is refused."""
        if value is None:
            return {"type": "object", "properties": {}}
        if isinstance(value, dict) and "type" not in value:
            return {"type": "object", **value}
        if isinstance(value, dict) and value["type"] != "object":
            raise ValueError(
                f"a function's parameters must be a JSON schema of type object, not "
                f"{str(value['type'])[:40]!r}: its arguments are a JSON object"
            )
        return value


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(Lenient):
    name: FunctionName
    arguments: str


class ToolCall(Lenient):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionChoice(Lenient):
    name: FunctionName


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: FunctionChoice


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an earlier assistant turn's calls
    tool_call_id: str | None = Field(None, max_length=256)  # a tool turn: which call it answers
    # What else the openai client sends back of an earlier reply (`message.model_dump()`).
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None

    @model_validator(mode="after")
    def check_content(self) -> ChatMessage:
        parts = self.content if isinstance(self.content, list) else []
        if self.role != "user" and any(isinstance(p, ImagePart) for p in parts):
            raise ValueError(f"{self.role} messages cannot hold images")
        if self.role != "assistant" and any(isinstance(p, RefusalPart) for p in parts):
            raise ValueError(f"{self.role} messages cannot hold refusals")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"{self.role} messages need content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool messages need the tool_call_id they answer")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages hold tool_calls")
        return self


class StreamOptions(Lenient):
    include_usage: bool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def null_is_false(cls, value: Any) -> Any:
        return False if value is None else value  # vLLM takes null here as unset


class JsonSchema(Lenient):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # true: any JSON value
    strict: bool | None = None  # always kept: the output follows the schema either way


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"type {self.type} takes no json_schema")  # it would not apply
        return self


MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024  # templates take flags and short settings
MAX_TEMPLATE_KWARGS_DEPTH = 8


def json_depth(value: Any) -> int:
    """How deep a parsed JSON value nests (a scalar: 0), without recursing."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack += [(child, depth + 1) for child in children]
    return deepest


# vLLM's request fields that would change the output, and the value of each that asks for what
# this server does: any other is a 400, not a reply silently unlike vLLM's.
# (None: no value is; nulls never get here, `null_is_absent` drops them.)
VLLM_EXTRAS_NOT_DONE: dict[str, Any] = {
    "chat_template": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "return_tokens_as_token_ids": False,
    "functions": None,  # OpenAI's legacy form of tools
}
# vLLM sets no bound; a salt is hashed on the engine's thread, and 43 characters (256 random
# bits in base64) are what vLLM suggests.
MAX_CACHE_SALT_CHARS = 4096
# Messages and content parts a request may hold in all: each costs pydantic ~3 µs under the
# GIL, so 3 million of them (93 MB) held the event loop, and every stream, for 9 s.
MAX_CHAT_ITEMS = 1 << 16
# vLLM's `structured_outputs` keys → the guided_* field each stands for; `json_object` asks
# for any JSON object, as response_format's.
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}
STRUCTURED_OUTPUTS |= {"grammar": "guided_grammar"}
# Flags of it that ask for what every grammar here already does: compact JSON, no whitespace.
STRUCTURED_OUTPUTS_MET = {"disable_any_whitespace", "disable_fallback"}


def structured_outputs_as_guided(data: dict[str, Any]) -> dict[str, Any]:
    """A body's `structured_outputs` (vLLM's current name) as the guided_* fields; what of it
    has no such field is left there, for `unsupported` to name."""
    asked = data.get("structured_outputs")
    if not isinstance(asked, dict):
        return data
    data, left = dict(data), {}
    for key, value in asked.items():
        if value is None or (key in STRUCTURED_OUTPUTS_MET and isinstance(value, bool)):
            continue
        field = STRUCTURED_OUTPUTS.get(key)
        if key == "json_object" and value is True:
            field, value = "guided_json", {"type": "object"}
        if field is None or field in data:  # unknown, or the same asked twice
            left[key] = value
        else:
            data[field] = value
    data["structured_outputs"] = left
    return data


def structured_outputs_left(left: Any) -> str | None:
    """Why what is left of `structured_outputs` once `structured_outputs_as_guided` ran is
    refused (None: nothing is)."""
    takes = "one of json, regex, choice, grammar, json_object, and no guided_* field beside it"
    if not isinstance(left, dict):
        return f"structured_outputs must be an object: it takes {takes}"
    if not left:
        return None
    keys = ", ".join(str(k)[:40] for k in list(left)[:5])
    return f"structured_outputs: {keys} not supported; it takes {takes}"


class GenerationRequest(BaseModel):
    """What chat and legacy completions share: OpenAI's sampling fields and vLLM's extras;
    unknown fields are ignored (and logged)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the served model (vLLM's default too)
    max_tokens: int | None = Field(None, ge=1)
    # None: the checkpoint's generation_config.json default, else the usual one.
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # 0 or -1: no limit
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's generators take
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # vLLM's extra: exactly max_tokens, as benchmark clients ask
    include_stop_str_in_output: bool = False  # vLLM's extra: the stop string ends the text
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    response_format: ResponseFormat | None = None  # OpenAI's chat field; vLLM's legacy one too
    # vLLM's structured-output extras; at most one of them (or a JSON response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    user: str | None = None  # accepted without effect
    # vLLM's extra: only requests of the same salt share the prefix and image caches' entries
    # (one per tenant keeps its prompts from being timed by another); non-empty, as in vLLM
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's extra: each prompt token's logprob and rank after those before it, with this
    # many likeliest alternatives
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def scores_asked(cls, asked: Any) -> Any:
        """`true` asks for the prompt's scores with one alternative, as vLLM reads it (a bool
        is an int there); `false` for none."""
        return {True: 1, False: None}.get(asked, asked) if isinstance(asked, bool) else asked

    @model_validator(mode="before")
    @classmethod
    def null_is_absent(cls, data: Any) -> Any:
        """A top-level null means the field's default, as OpenAI's API and vLLM take it
        (clients and proxies send unset options as null), and vLLM's `structured_outputs`
        stands for the guided_* field it names."""
        if not isinstance(data, dict):
            return data
        data = {key: value for key, value in data.items() if value is not None}
        return structured_outputs_as_guided(data)

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else stop or []
        if len(values) > MAX_STOP_STRINGS or any(not s for s in values):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def token_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens")
        for key, value in bias.items():
            if not key.isdigit() or not key.isascii() or len(key) > 9:
                raise ValueError(f"keys must be token ids, not {key[:20]!r}")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # NaN fails this too
                raise ValueError(f"biases must be in [-100, 100], not {value}")
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids and min(ids) < 0:
            raise ValueError("token ids must be ≥ 0")
        return ids

    @model_validator(mode="after")
    def streaming_options(self) -> GenerationRequest:
        # vLLM tests its truth: an empty object asks for nothing
        asks = self.stream_options is not None and self.stream_options.include_usage
        if asks and not self.stream:
            raise ValueError("stream_options requires stream=true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))

    @property
    def asked_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def asked_tokens_param(self) -> str:
        """The field `asked_tokens` came from, for errors to name."""
        return "max_tokens"

    @property
    def wants_logprobs(self) -> bool:
        return False

    @property
    def top_logprob_count(self) -> int:
        return 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field that asks for what this server does not do (yet). What it
        reads is declared, so its type was checked; extras are only compared (`!=`),
        and structured_outputs is looked at by its type: any JSON value passes either."""
        extra = self.model_extra or {}
        for field, done in VLLM_EXTRAS_NOT_DONE.items():
            if field in extra and extra[field] != done:
                only = "" if done is None else f" (only {json.dumps(done)})"
                return field, f"{field} is not supported{only}"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs cannot be streamed (nor in vLLM)"
        if why := structured_outputs_left(extra.get("structured_outputs", {})):
            return "structured_outputs", why
        if len(self.output_constraints()) > 1:
            return self.output_constraints()[0], (
                "give one of tool_choice (required or a function), response_format, guided_json, "
                "guided_regex, guided_choice, guided_grammar"
            )
        return None

    def output_constraints(self) -> list[str]:
        """The structured-output fields the request sets."""
        json_format = self.response_format is not None and self.response_format.type != "text"
        named = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return ["response_format"] * json_format + [
            n for n in named if getattr(self, n) is not None
        ]


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras: the prompt ends after the last turn, not in a new assistant turn, or
    # inside the last turn, for the model to go on with it (an answer the client began).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's extra: variables for the chat template, such as Qwen's `enable_thinking`.
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    # vLLM's extra: the reply begins with the last message's text where that is the
    # assistant's, so a client that had the model go on with it reads the answer whole.
    echo: bool = False
    # Accepted and without effect here: bookkeeping for OpenAI's platform.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # OpenAI's audio output: refused in `unsupported`, declared so their types are checked.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in kwargs or {}:
            if not name.isidentifier():
                raise ValueError(f"names must be template variable names, not {name[:40]!r}")
        try:
            size = len(json.dumps(kwargs, ensure_ascii=False))
        except RecursionError:
            size = MAX_TEMPLATE_KWARGS_CHARS + 1
        if size > MAX_TEMPLATE_KWARGS_CHARS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON")
        if json_depth(kwargs) > MAX_TEMPLATE_KWARGS_DEPTH:  # before anything recurses into it
            raise ValueError(f"values may nest at most {MAX_TEMPLATE_KWARGS_DEPTH} deep")
        return kwargs

    @model_validator(mode="after")
    def consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:  # as vLLM refuses it
            raise ValueError("continue_final_message requires add_generation_prompt=false")
        return self

    @property
    def opening(self) -> Opening:
        if self.continue_final_message:
            return "continue"
        return "generation_prompt" if self.add_generation_prompt else "none"

    @property
    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def asked_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def named_tool(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    @property
    def echoed(self) -> str:
        """What `echo` puts before each choice's text: the last message's, if the assistant's."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        if isinstance(last.content, list):
            return "".join(p.text for p in last.content if isinstance(p, TextPart))
        return last.content or ""

    @property
    def forces_tools(self) -> bool:
        return self.tool_choice == "required" or self.named_tool is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def top_logprob_count(self) -> int:
        return self.top_logprobs or 0

    def unsupported(self) -> tuple[str, str] | None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            return "tools", "tool names must be unique"
        if self.forces_tools and not names:
            return "tool_choice", f"tool_choice {self.tool_choice!r} needs tools"
        if self.named_tool is not None and self.named_tool not in names:
            return "tool_choice", f"tool_choice names {self.named_tool!r}, which is not in tools"
        if self.forces_tools and (self.stop or self.stop_token_ids):
            return "stop", "stop and stop_token_ids would cut a forced tool call short"
        if self.forces_tools and self.echoed:
            return "echo", "echo would put text before a forced tool call"
        for i, message in enumerate(self.messages):
            if message.function_call:
                return f"messages.{i}.function_call", "function_call is replaced by tool_calls"
            if message.audio is not None:
                return f"messages.{i}.audio", "audio is not supported"
        if self.audio is not None or "audio" in (self.modalities or ()):
            return "audio", "audio output is not supported"
        return super().unsupported()

    def output_constraints(self) -> list[str]:
        return ["tool_choice"] * self.forces_tools + super().output_constraints()


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: a raw prompt (text or token ids) continued, no chat template."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=20)  # the top alternatives to report
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    @property
    def prompt_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the prompt (and its scores) back, nothing new, as vLLM
        and older lm-eval do. One token is still generated, as prefill always samples the
        first: the reply leaves it out."""
        return self.max_tokens == 0

    @property
    def asked_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_logprob_count(self) -> int:
        return self.logprobs or 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts the request holds: one text or token list, or a list of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def unsupported(self) -> tuple[str, str] | None:
        if len(self.prompts) * self.n > MAX_CHOICES:  # each prompt's n choices are the reply's
            return "prompt", (
                f"{len(self.prompts)} prompts of n={self.n} choices each are more than "
                f"{MAX_CHOICES} choices in one reply"
            )
        if self.prompt_only and not self.echo:
            return "max_tokens", "max_tokens 0 asks for nothing: it is allowed only with echo"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported"
        return super().unsupported()


class TokenizeRequest(Lenient):
    """POST /tokenize (vLLM's): a text prompt's token ids, as /v1/completions reads it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """POST /tokenize with `messages` (vLLM's chat form): the conversation as
    /v1/chat/completions reads it, every field of it checked as there."""

    return_token_strs: bool = False


def parse_tokenize(body: Any) -> TokenizeRequest | TokenizeChatRequest:
    if isinstance(body, dict) and "messages" in body:
        return parse(body, TokenizeChatRequest)
    return parse_plain(body, TokenizeRequest)


class DetokenizeRequest(Lenient):
    """POST /detokenize (vLLM's): token ids → their text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


M = TypeVar("M", bound=BaseModel)


def parse_plain(body: Any, kind: type[M]) -> M:
    """A request of a route beside generation; the first problem is an OpenAI-style 400."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return kind.model_validate(body, strict=True)
    except ValidationError as e:
        raise _as_api_error(e) from None


def parse_request(body: Any) -> ChatCompletionRequest:
    """A chat request from a JSON body; the first problem is an OpenAI-style 400 naming it."""
    return parse(body, ChatCompletionRequest)


def parse_completion(body: Any) -> CompletionRequest:
    return parse(body, CompletionRequest)


def chat_items(messages: Any) -> int:
    """Messages and their content parts, counted on the parsed JSON before pydantic reads it."""
    if not isinstance(messages, list):
        return 0
    parts = (m.get("content") for m in messages if isinstance(m, dict))
    return len(messages) + sum(len(c) for c in parts if isinstance(c, list))


R = TypeVar("R", bound=GenerationRequest)


def parse(body: Any, kind: type[R]) -> R:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if (items := chat_items(body.get("messages"))) > MAX_CHAT_ITEMS:
        raise bad_request(
            f"the messages hold {items} messages and content parts, over {MAX_CHAT_ITEMS}",
            param="messages",
        )
    try:
        request = kind.model_validate(body, strict=True)
    except ValidationError as e:
        raise _as_api_error(e) from None
    if (refused := request.unsupported()) is not None:
        param, why = refused
        raise bad_request(why, param=param, code="unsupported_parameter")
    if ignored := sorted(set(request.model_extra or ()) - IGNORED_QUIETLY):
        log.warning("ignored request fields: %s", ", ".join(f[:40] for f in ignored[:20]))
    return request


# checked in `unsupported`
IGNORED_QUIETLY = {"structured_outputs", *VLLM_EXTRAS_NOT_DONE}


def _as_api_error(error: ValidationError) -> APIError:
    """The first problem, or where a value fits none of a union's forms, the form it came
    nearest to (the deepest problem: a named tool_choice without its function, not "should be
    'none', 'auto' or 'required'"). Union forms are left out of the parameter's name."""
    problems = error.errors()
    first = max(problems, key=lambda p: len(p["loc"]))
    if len(first["loc"]) == len(problems[0]["loc"]):
        first = problems[0]
    loc = first["loc"]
    param = ".".join(str(p) for i, p in enumerate(loc) if not _union_form(p) and not _tag(loc, i))
    if not param:  # a check across several fields
        return bad_request(f"invalid request: {first['msg']}")
    return bad_request(f"invalid {param}: {first['msg']}", param=param)


def _tag(loc: tuple[int | str, ...], i: int) -> bool:
    """Whether loc[i] is the tag of an item of a list of tagged unions (a content part's
    `type`), which pydantic puts in the location of a problem inside the item: "content.0.text
    .text" would name the part's `text` twice."""
    return i >= 2 and isinstance(loc[i - 1], int) and "tagged-union[" in str(loc[i - 2])


def _union_form(part: int | str) -> bool:
    """Whether a part of an error's location names one of a union's forms (pydantic puts
    them there: "literal['none','auto']", "NamedToolChoice", "str"), not a field or index."""
    if isinstance(part, int):
        return False
    return not part.isidentifier() or part[0].isupper() or part in ("str", "int", "list", "dict")
