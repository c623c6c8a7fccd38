"""vLLM's tokenizer routes, as lm-eval's remote tokenizer calls them."""

import pytest

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
        ("/detokenize", {"tokens": [5] * 1_000_000}, 400, "more than the context length"),
        ("/detokenize", [5], 400, "JSON object"),
    ],
)
def test_bad_requests_get_openai_errors(client, route, body, status, fragment):
    reply = client.post(route, json=body)
    assert reply.status_code == status
    assert fragment in reply.json()["error"]["message"]
