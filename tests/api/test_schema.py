"""What the chat schema takes from ordinary clients, beyond the fields it reads."""

import pytest

from epd.api.errors import APIError
from epd.api.schema import MAX_CACHE_SALT_CHARS, parse_request

IMAGE = "data:image/png;base64,iVBORw0KGgo="  # parsed here, not decoded


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_image_parts_take_any_detail_the_sdk_knows_and_keys_of_their_own():
    """openai's SDK lists "original"; LiteLLM adds `format`: vLLM takes both, so do we."""
    for extra in ({"detail": "original"}, {"detail": "low"}, {"format": "image/png", "uuid": "x"}):
        part = {"type": "image_url", "image_url": {"url": IMAGE, **extra}}
        request = parse_request(chat(messages=[{"role": "user", "content": [part]}]))
        assert request.messages[0].content[0].image_url.url == IMAGE


def test_a_null_include_usage_is_unset():
    request = parse_request(chat(stream=True, stream_options={"include_usage": None}))
    assert request.include_usage is False
    assert parse_request(chat(stream=True, stream_options={"include_usage": True})).include_usage


def test_a_problem_in_a_content_part_names_the_parameter_once():
    """pydantic puts a part's `type` in the location: "content.0.text.text" is not a field."""
    cases = [
        ({"type": "text", "text": 5}, "messages.0.content.0.text"),
        (
            {"type": "image_url", "image_url": {"url": IMAGE, "detail": "x"}},
            "messages.0.content.0.image_url.detail",
        ),
        ({"type": "image_url"}, "messages.0.content.0.image_url"),
    ]
    for part, param in cases:
        with pytest.raises(APIError) as error:
            parse_request(chat(messages=[{"role": "user", "content": [part]}]))
        assert error.value.status == 400 and error.value.param == param


def test_a_cache_salt_is_a_non_empty_string_as_in_vllm():
    assert parse_request(chat(cache_salt="tenant-a")).cache_salt == "tenant-a"
    assert parse_request(chat(cache_salt=None)).cache_salt is None  # null: none given
    for bad in ("", 5, ["a"], "x" * (MAX_CACHE_SALT_CHARS + 1)):
        with pytest.raises(APIError) as error:
            parse_request(chat(cache_salt=bad))
        assert error.value.status == 400 and error.value.param == "cache_salt"
