"""OpenAI's Responses API through the official client, over the three processes: the same
text as the chat it stands for, whole and streamed, and what it cannot do refused by name."""

import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .test_openai_api import PERSON
from .test_stack import CASES, RED, body

INSTRUCTIONS = "Be brief."
QUESTION = "What colour is it?"


def image_input():
    content = [
        {"type": "input_image", "image_url": RED},
        {"type": "input_text", "text": QUESTION},
    ]
    return [{"role": "user", "content": content}]


def test_a_response_is_the_chat_it_stands_for(client, model_name, local):
    reply = client.responses.create(
        model=model_name,
        instructions=INSTRUCTIONS,
        input=image_input(),
        max_output_tokens=12,
        temperature=0,
        metadata={"k": "v"},
    )
    chat = [{"role": "system", "content": INSTRUCTIONS}, *CASES["one image"]]
    expected = local.chat(body(model_name, chat, max_tokens=12, temperature=0))
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == expected.text
    assert reply.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert reply.usage.input_tokens == expected.prompt_tokens
    assert reply.usage.output_tokens == len(expected.token_ids)
    assert reply.instructions == INSTRUCTIONS and reply.metadata == {"k": "v"}
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant"


def test_a_streamed_response_sends_the_events_in_order(client, model_name):
    params = {"model": model_name, "input": "Hello there", "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(**params)
    events = list(client.responses.create(**params, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_response_follows_its_text_format(client, model_name, local):
    """`text.format` is chat's `response_format` with the json_schema's fields laid flat: the
    same JSON as the chat it stands for, and the response repeats the format."""
    schema = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    reply = client.responses.create(
        model=model_name,
        input="Who?",
        max_output_tokens=200,
        temperature=0,
        text={"format": schema},
    )
    jsonschema.validate(json.loads(reply.output_text), PERSON)
    flat = {key: value for key, value in schema.items() if key != "type"}
    chat_format = {"type": "json_schema", "json_schema": flat}
    chat = [{"role": "user", "content": "Who?"}]
    expected = local.chat(
        body(model_name, chat, max_tokens=200, temperature=0, response_format=chat_format)
    )
    assert reply.output_text == expected.text and reply.status == "completed"
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "person"


class Person(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    tags: Annotated[list[Literal["a", "b"]], Field(max_length=2)]
    ok: bool


def test_the_sdks_parse_gets_an_object_of_its_model(client, model_name):
    """`client.responses.parse(text_format=...)`: the SDK sends the model's strict schema and
    reads the reply back into the model."""
    reply = client.responses.parse(
        model=model_name, input="Who?", max_output_tokens=200, temperature=0, text_format=Person
    )
    assert isinstance(reply.output_parsed, Person)
    assert Person.model_validate_json(reply.output_text) == reply.output_parsed


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools are not"),
        ({"previous_response_id": "resp_1"}, "responses are not stored"),
        ({"include": ["message.output_text.logprobs"]}, "include may name only"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "a name and a schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_a_response_cannot_do_is_refused(client, model_name, params, fragment):
    with pytest.raises(openai.BadRequestError, match=fragment):
        client.responses.create(model=model_name, input="hi", **params)
