"""A Responses API request as the chat request it stands for."""

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from epd.api.errors import APIError
from epd.api.responses_api import ResponseReply, parse_responses
from epd.wire.messages import TokenDelta

EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)


def test_input_messages_become_chat_messages():
    asked, chat = parse_responses(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Answer in English."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is it?"},
                        {
                            "type": "input_image",
                            "image_url": "data:image/png;base64,AA==",
                            "detail": "low",
                        },
                    ],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "A circle."}]},
            ],
            "max_output_tokens": 9,
            "top_p": 0.5,
            "store": True,  # nothing is stored; accepted as OpenAI's default
            "tool_choice": "auto",  # and the empty defaults clients send
            "tools": [],
            "reasoning": {"effort": "low"},  # no reasoning to do: ignored, as vLLM does
            "include": ["reasoning.encrypted_content"],  # Codex's, when it does not store
            "text": {"format": {"type": "text"}, "verbosity": "low"},
        }
    )
    assert asked.chat_body() == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Answer in English."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is it?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,AA==", "detail": "low"},
                    },
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A circle."}]},
        ],
        "stream": False,
        "max_tokens": 9,
        "top_p": 0.5,
    }
    assert chat.max_tokens == 9 and len(chat.messages) == 4  # validated as a chat request


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"input": []}, "input"),
        ({"input": "hi", "conversation": "conv_1"}, "not stored"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "temperature": float("nan")}, "temperature"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "image_url"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "files are not stored",
        ),
        ({"input": [{"type": "function_call_output", "role": "user", "content": "x"}]}, "items"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "'input_file'"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "needs its text"),
        ({"input": "hi", "text": {"format": "text"}}, "text.format"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "a name and a schema"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include may name"),
        ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": [{"role": "user", "content": "a"}] * 70000}, "70000 items and content parts"),
    ],
)
def test_what_cannot_be_served_is_a_400(body, fragment):
    with pytest.raises(APIError) as refused:
        parse_responses(body)
    assert refused.value.status == 400 and fragment in str(refused.value.body())


def events(chunks: str) -> list[dict]:
    return [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: ")]


def test_the_bodies_and_events_are_the_sdks_types():
    reply = ResponseReply("r", "m", 5, want_logprobs=False, echoed={"metadata": {"k": "v"}})
    deltas = [TokenDelta("r", (7,), "Hi", 1), TokenDelta("r", (8,), "", 2, "length")]
    whole = Response.model_validate(reply.completion(deltas))
    assert whole.status == "incomplete" and whole.output[0].status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.output_text == "Hi"
    assert whole.usage.output_tokens == 2 and whole.metadata == {"k": "v"}
    stream = "".join(reply.opening(1)) + "".join(reply.delta_chunk(d) for d in deltas)
    sent = [EVENT.validate_python(e) for e in events(stream)]
    assert [e.type for e in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",  # the finish alone adds no empty delta
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in sent] == list(range(9)) and reply.closing() == ""


def test_an_error_midway_is_the_apis_event_and_raises_in_the_sdk():
    reply = ResponseReply("r", "m", 5, want_logprobs=False)
    chunk = reply.error_chunk(APIError(500, "decode died", code="internal"))
    assert chunk.startswith("event: error\n")
    (body,) = events(chunk)
    assert EVENT.validate_python(body).message == "decode died"
    assert body["error"]["message"] == "decode died"  # what the openai SDK raises on


ITEMS = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
PART = "input.0.content.0.text"


@pytest.mark.parametrize(
    "chat,body,ours",
    [
        ("max_tokens", {"input": "hi"}, "max_output_tokens"),
        ("response_format", {"input": "hi"}, "text.format"),
        ("response_format.json_schema.name", {"input": "hi"}, "text.format.name"),  # flat
        ("messages.0", {"input": "hi"}, "input"),
        ("messages.0", {"input": "hi", "instructions": "be brief"}, "instructions"),
        ("messages.1.content.0.text", {"input": ITEMS, "instructions": "x"}, PART),
        ("messages.0.role", {"input": ITEMS}, "input.0.role"),
        ("model", {"input": "hi"}, "model"),  # the same field in both
    ],
)
def test_a_chat_error_names_the_responses_field(chat, body, ours):
    from epd.api.errors import bad_request
    from epd.api.responses_api import named_as_responses

    request, _ = parse_responses({"model": "m", **body})
    error = named_as_responses(bad_request(f"invalid {chat}: why", param=chat), request)
    assert (error.param, error.message) == (ours, f"invalid {ours}: why")


def test_a_cache_salt_reaches_the_chat_and_an_empty_one_is_refused_by_name():
    _, chat = parse_responses({"model": "m", "input": "hi", "cache_salt": "tenant-a"})
    assert chat.cache_salt == "tenant-a"
    with pytest.raises(APIError) as error:
        parse_responses({"model": "m", "input": "hi", "cache_salt": ""})
    assert error.value.status == 400 and error.value.param == "cache_salt"
