"""Any JSON a client sends is either a request or a 4xx naming what is wrong, never a 500:
property tests over every request schema, a field of a valid body at a time and whole bodies."""

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd.api.errors import APIError
from epd.api.responses_api import NOT_DONE, ResponsesRequest, parse_responses
from epd.api.schema import (
    VLLM_EXTRAS_NOT_DONE,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    parse_completion,
    parse_plain,
    parse_request,
    parse_tokenize,
)

# Fixed examples, no database: CI sees the same bodies every run, and a run takes seconds.
FUZZ = settings(
    max_examples=100,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Names the schemas read, as object keys, so that generated objects look like requests and
# reach the checks deep inside them.
KEYS = [
    "type", "text", "role", "content", "name", "url", "image_url", "function", "arguments",
    "parameters", "schema", "json_schema", "format", "include_usage", "tool_calls", "id",
    "tool_call_id", "detail", "refusal", "json", "regex", "choice", "grammar", "json_object",
    "properties", "enum", "audio", "file_id",
]  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**100, -(10**100), 2**31])
    | st.floats()  # NaN and ±inf among them: the JSON parser takes NaN and Infinity
    | st.text(max_size=12)
    | st.sampled_from(["", "auto", "none", "required", "user", "text", "function", "audio"])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)

IMAGE = "data:image/png;base64,iVBORw0KGgo="
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SAMPLING = {
    "model": "m",
    "max_tokens": 5,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "logit_bias": {"5": 1.0},
    "min_tokens": 1,
    "seed": 7,
    "stop": ["x"],
    "stop_token_ids": [3],
    "ignore_eos": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "stream": False,
    "stream_options": {"include_usage": False},
    "n": 1,
    "user": "u",
    "prompt_logprobs": 1,
    "guided_regex": "a+",
    # vLLM's extras read after validation, at the values that ask for nothing
    "structured_outputs": {"disable_any_whitespace": True},
    "use_beam_search": False,
    "length_penalty": 1.0,
    "return_tokens_as_token_ids": False,
}
CHAT = SAMPLING | {
    "messages": [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": IMAGE}},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ],
    "max_completion_tokens": 5,
    "logprobs": True,
    "top_logprobs": 2,
    "tools": [TOOL],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template_kwargs": {"enable_thinking": False},
    "echo": False,
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "modalities": ["text"],
    "audio": None,
}  # fmt: skip
COMPLETION = SAMPLING | {
    "prompt": [[1, 2], [3]],
    "logprobs": 1,
    "echo": True,
    "suffix": None,
    "best_of": 1,
}
RESPONSES = {
    "model": "m",
    "instructions": "be brief",
    "input": [
        {"role": "developer", "content": "plain"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what is it?"},
                {"type": "input_image", "image_url": IMAGE, "detail": "low"},
            ],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "a circle"}]},
    ],
    "max_output_tokens": 9,
    "temperature": 0.5,
    "top_p": 0.5,
    "stream": False,
    "metadata": {"k": "v"},
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    "include": ["reasoning.encrypted_content"],
    "tools": [],
    "tool_choice": "auto",
    "store": True,
    "reasoning": {"effort": "low"},
}
TOKENIZE = {"model": "m", "prompt": "hi", "add_special_tokens": True, "return_token_strs": True}
TOKENIZE_CHAT = {"model": "m", "messages": CHAT["messages"][:2], "return_token_strs": True}
DETOKENIZE = {"model": "m", "tokens": [1, 2, 3]}
MODELS = [
    CompletionRequest,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
]


# Every field any schema declares, and the extras they read after validation.
FIELDS = sorted(
    {name for model in MODELS for name in model.model_fields}
    | {*CHAT, *COMPLETION, *RESPONSES, *VLLM_EXTRAS_NOT_DONE, *NOT_DONE}
)


def parse_detokenize(body: Any) -> DetokenizeRequest:
    return parse_plain(body, DetokenizeRequest)


SCHEMAS = {
    "chat": (parse_request, CHAT),
    "completion": (parse_completion, COMPLETION),
    "completion-text": (parse_completion, SAMPLING | {"prompt": "once upon"}),
    "responses": (parse_responses, RESPONSES),
    "tokenize": (parse_tokenize, TOKENIZE),
    "tokenize-chat": (parse_tokenize, TOKENIZE_CHAT),
    "detokenize": (parse_detokenize, DETOKENIZE),
}


def places(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every value inside `value` (keys and list indices), the shallow first."""
    children: Any = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    found = []
    for key, child in children:
        found += [(*at, key), *places(child, (*at, key))]
    return found


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """A copy of `value` with what is at `path` replaced by `new`."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return value | {head: replaced(value[head], rest, new)}
    return [replaced(item, rest, new) if i == head else item for i, item in enumerate(value)]


def parses_or_refuses(parse: Callable[[Any], Any], body: Any) -> None:
    """The property: a request, or an APIError of a 4xx; any other exception fails the test."""
    try:
        parse(body)
    except APIError as e:
        assert 400 <= e.status < 500, (e.status, e.message)
        assert e.message


@pytest.mark.parametrize(("parse", "base"), SCHEMAS.values(), ids=SCHEMAS)
def test_the_base_bodies_are_valid_requests(parse, base):
    parse(base)  # else every mutation below is refused at the same place, and tests little


def in_every_place(parse: Callable[[Any], Any], base: dict[str, Any], value: Any) -> None:
    """`value` in every place of the body in turn: each field, item and nested field."""
    for path in places(base):
        try:
            parses_or_refuses(parse, replaced(base, path, value))
        except Exception as e:  # say where the value was put
            raise AssertionError(f"{value!r} at {'.'.join(map(str, path))}: {e!r}") from e


# A value of each JSON type, each in every place, whatever hypothesis happens to draw.
EACH_TYPE = [None, True, False, 0, -1, 5, 2**64, -(10**100), 1.5, float("nan"), float("inf")]
EACH_TYPE += ["", "x", [], [None], [{}], [[]], {}, {"x": []}, {"type": {}}]


@pytest.mark.parametrize(("parse", "base"), SCHEMAS.values(), ids=SCHEMAS)
def test_a_value_of_each_type_in_any_field_is_a_request_or_a_4xx(parse, base):
    for value in EACH_TYPE:
        in_every_place(parse, base, value)


@pytest.mark.parametrize(("parse", "base"), SCHEMAS.values(), ids=SCHEMAS)
@FUZZ
@given(value=SCALARS | JSON)
def test_any_value_in_any_field_is_a_request_or_a_4xx(parse, base, value):
    in_every_place(parse, base, value)


@pytest.mark.parametrize(("parse", "base"), SCHEMAS.values(), ids=SCHEMAS)
@FUZZ
@given(data=st.data())
def test_any_fields_added_to_a_body_are_a_request_or_a_4xx(parse, base, data):
    added = data.draw(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4), label="added")
    parses_or_refuses(parse, base | added)


@pytest.mark.parametrize("parse", [parse for parse, _ in SCHEMAS.values()], ids=SCHEMAS)
@FUZZ
@given(body=JSON | st.dictionaries(st.text(max_size=8), JSON, max_size=5))
def test_any_body_is_a_request_or_a_4xx(parse, body):
    parses_or_refuses(parse, body)


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_responses, RESPONSES | {"include": [{}]}, "include.0"),
        (parse_responses, RESPONSES | {"include": "reasoning.encrypted_content"}, "include"),
        (parse_request, CHAT | {"modalities": 5}, "modalities"),
        (parse_request, CHAT | {"modalities": {"audio": 1}}, "modalities"),
    ],
)
def test_the_reported_500s_are_400s_naming_the_field(parse, body, param):
    """Fields read only after validation (`unsupported`, `refused`) were never type-checked."""
    with pytest.raises(APIError) as error:
        parse(body)
    assert error.value.status == 400 and error.value.param == param
