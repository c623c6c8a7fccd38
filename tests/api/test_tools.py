"""Forced tool calls as stream chunks: arguments as they come, logprobs with them."""

import json

import pytest

from epd.api.schema import Tool
from epd.api.tool_prompts import ForcedTools
from epd.api.tools import ToolReply
from epd.generation.params import TokenLogprob
from epd.wire.messages import TokenDelta

TOOL = Tool.model_validate(
    {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
)


def deltas(pieces, finish):
    """One delta a piece, each with its token's logprob; the last ends the choice."""
    return [
        TokenDelta(
            "r",
            token_ids=(i,),
            text=piece,
            completion_tokens=i + 1,
            finish_reason=finish if i == len(pieces) - 1 else None,
            logprobs=(TokenLogprob(piece, -0.5 * i, tuple(piece.encode())),),
        )
        for i, piece in enumerate(pieces)
    ]


def stream(forced, pieces, finish):
    reply = ToolReply("r", "m", 3, want_logprobs=True, forced=forced)
    chunks = [reply.delta_chunk(d) for d in deltas(pieces, finish)]
    return [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks if c]


def test_a_named_call_cut_short_ends_its_arguments_without_repeating_them():
    choices = stream(ForcedTools((TOOL,), "get"), ['{"', "a", '":1'], "length")
    calls = [c["delta"]["tool_calls"][0] for c in choices]
    assert "".join(call["function"]["arguments"] for call in calls) == '{"a":1'
    assert calls[0]["function"]["name"] == "get" and "name" not in calls[1]["function"]
    assert all("content" not in c["delta"] for c in choices)
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]
    assert [c["logprobs"]["content"][0]["token"] for c in choices] == ['{"', "a", '":1']
    assert ["stop_reason" in c for c in choices] == [False, False, True]  # the end's (vLLM)


def test_a_named_call_that_ends_finishes_as_its_text_did():
    choices = stream(ForcedTools((TOOL,), "get"), ['{"a"', ":1}"], "stop")
    assert choices[-1]["finish_reason"] == "stop"  # as OpenAI's API and vLLM finish it


@pytest.mark.parametrize("pieces", [['{"a"', ":1"], ['{"a":1']])
def test_a_named_call_cut_short_is_the_same_call_whole_or_streamed(pieces):
    forced = ForcedTools((TOOL,), "get")
    streamed = stream(forced, pieces, "length")
    whole = ToolReply("r", "m", 3, want_logprobs=False, forced=forced).completion(
        deltas(pieces, "length")
    )
    (choice,) = whole["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == streamed[-1]["finish_reason"] == "length"
    assert choice["message"]["content"] is None and call["function"]["name"] == "get"
    arguments = [c["delta"]["tool_calls"][0]["function"]["arguments"] for c in streamed]
    assert call["function"]["arguments"] == "".join(arguments) == "".join(pieces)


def test_a_list_of_calls_cut_short_is_text():
    whole = ToolReply("r", "m", 3, want_logprobs=False, forced=ForcedTools((TOOL,))).completion(
        deltas(['[{"na', 'me":'], "length")
    )
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": '[{"name":'}
    assert stream(ForcedTools((TOOL,)), ['[{"na', 'me":'], "length")[-1]["delta"] == {
        "content": '[{"name":'
    }


def test_a_list_of_calls_comes_whole_with_every_token_logprob():
    text = ['[{"name":"get",', '"parameters":{}}', "]"]
    choices = stream(ForcedTools((TOOL,)), text, "stop")
    assert len(choices) == 1 and choices[0]["finish_reason"] == "tool_calls"
    assert choices[0]["delta"]["tool_calls"][0]["function"] == {"name": "get", "arguments": "{}"}
    assert [e["token"] for e in choices[0]["logprobs"]["content"]] == text


def test_a_function_dumped_by_the_sdk_with_null_parameters_takes_none():
    from openai.types.shared import FunctionDefinition

    function = FunctionDefinition(name="ping").model_dump()  # {"parameters": None, ...}
    tool = Tool.model_validate({"type": "function", "function": function})
    assert tool.function.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "parameters,schema",
    [
        ({}, {"type": "object"}),  # the usual spelling of "no arguments"
        ({"properties": {"a": {"type": "boolean"}}}, {"type": "object", "properties": {"a": {}}}),
        ({"type": "object", "properties": {}}, {"type": "object", "properties": {}}),
    ],
)
def test_a_function_without_a_type_takes_an_object(parameters, schema):
    """Arguments are a JSON object, as OpenAI's always are: a forced call to a function whose
    parameters give no type must not be sampled as `1` or `"x"`."""
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": parameters}}
    )
    assert tool.function.parameters["type"] == "object"
    assert tool.function.parameters.keys() == schema.keys()
    assert ForcedTools((tool,), name="f").schema()["type"] == "object"


@pytest.mark.parametrize("kind", ["string", "array", ["object", "null"]])
def test_a_function_whose_arguments_are_not_an_object_is_refused(kind):
    with pytest.raises(ValueError, match="a JSON schema of type object"):
        Tool.model_validate(
            {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}
        )
