"""vLLM's tokenizer routes, as lm-eval's remote tokenizer calls them."""

import base64
import io

import pytest
from PIL import Image

from epd.api.prepare import PromptBuilder
from epd.api.schema import parse_request
from epd.checkpoint.tokenizer import load_tokenizer
from tests.api.test_app import api


@pytest.fixture(scope="module")
def client(tiny_checkpoint, tmp_path_factory):
    with api(tiny_checkpoint, tmp_path_factory.mktemp("sockets")) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def test_tokenize_gives_the_ids_a_completion_would_prefill(client, tokenizer):
    reply = client.post("/tokenize", json={"prompt": "The red circle", "return_token_strs": True})
    assert reply.status_code == 200
    body = reply.json()
    ids = tokenizer.encode("The red circle")
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert body["max_model_len"] > len(ids)
    plain = client.post("/tokenize", json={"model": "tiny", "prompt": "x"}).json()
    assert plain["token_strs"] is None


def png(width, height):
    image = io.BytesIO()
    Image.new("RGB", (width, height), "red").save(image, format="PNG")
    return "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()


def test_tokenize_chat_messages_gives_what_the_chat_route_would_prefill(
    client, tiny_checkpoint, tokenizer
):
    """vLLM's chat form, images' tokens included: what a client counts before it sends."""
    builder = PromptBuilder.from_checkpoint(tiny_checkpoint, tokenizer, 512)
    content = [{"type": "text", "text": "What shape?"}, {"type": "image_url", "image_url": {}}]
    content[1]["image_url"]["url"] = png(56, 84)
    chat = {"messages": [{"role": "user", "content": content}]}
    reply = client.post("/tokenize", json=chat | {"return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    image_tokens = builder.processor.tokens(builder.processor.grid_for_size(56, 84))
    expected = builder.prompt_ids(builder.read(parse_request(chat)), [image_tokens])
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["tokens"].count(builder.placeholder_id) == image_tokens > 1
    assert body["token_strs"][-3:] == tokenizer.convert_ids_to_tokens(expected[-3:])
    begun = {"messages": [*chat["messages"], {"role": "assistant", "content": "A"}]}
    continued = client.post(
        "/tokenize", json=begun | {"add_generation_prompt": False, "continue_final_message": True}
    ).json()
    assert continued["count"] == body["count"] + 1  # the assistant turn begun, then "A"
    refused = client.post("/tokenize", json=begun | {"continue_final_message": True})
    assert refused.status_code == 400 and "continue_final_message" in refused.text


def test_detokenize_gives_the_text_back(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    assert client.post("/detokenize", json={"tokens": ids}).json() == {
        "prompt": tokenizer.decode(ids)
    }


def test_tokenizer_info_names_what_lm_eval_checks_for(client, tokenizer):
    info = client.get("/tokenizer_info").json()
    assert "eos_token" in info and info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] > 0


@pytest.mark.parametrize(
    "route,body,status,fragment",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "other"),
        ("/tokenize", {"prompt": "x" * 10_000_000}, 400, "characters"),
        ("/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [5] * 100_000}, 400, "more than the context length"),
        ("/detokenize", {"tokens": [5] * 1_000_000}, 413, "JSON values"),
        ("/detokenize", [5], 400, "JSON object"),
    ],
)
def test_bad_requests_get_openai_errors(client, route, body, status, fragment):
    reply = client.post(route, json=body)
    assert reply.status_code == status
    assert fragment in reply.json()["error"]["message"]
