"""A Responses API request as the chat request it stands for."""

import pytest

from epd.api.errors import APIError
from epd.api.responses_api import parse_responses


def test_input_messages_become_chat_messages():
    asked = parse_responses(
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
                        {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
                    ],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "A circle."}]},
            ],
            "max_output_tokens": 9,
            "top_p": 0.5,
            "store": True,  # nothing is stored; accepted as OpenAI's default
            "tool_choice": "auto",  # and the empty defaults clients send
            "tools": [],
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
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A circle."}]},
        ],
        "stream": False,
        "max_tokens": 9,
        "top_p": 0.5,
    }


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"input": []}, "input"),
        ({"input": "hi", "conversation": "conv_1"}, "not stored"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "temperature": float("nan")}, "temperature"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "image_url"),
    ],
)
def test_what_cannot_be_served_is_a_400(body, fragment):
    with pytest.raises(APIError) as refused:
        parse_responses(body).chat_body()
    assert refused.value.status == 400 and fragment in str(refused.value.body())
