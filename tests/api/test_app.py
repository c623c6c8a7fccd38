"""The API in-process: request validation and error bodies, without peers."""

import base64
import io
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from starlette.requests import ClientDisconnect

from epd.api.app import create_app, parse_json
from epd.api.errors import APIError, as_api_error
from epd.api.prepare import PromptBuilder
from epd.api.schema import parse_request
from epd.api.server import build_service
from epd.checkpoint.config import load_model_config
from epd.config.roles import PrefillConfig


def api(checkpoint, sockets, **settings):
    """The API in-process, its peers' sockets unserved."""
    peers = {"encoders": (f"ipc://{sockets}/encode",), "decoders": (f"ipc://{sockets}/decode",)}
    config = PrefillConfig(
        model=str(checkpoint),
        bind=f"ipc://{sockets}/prefill",
        **({"served_model_name": ("tiny",)} | peers | settings),
    )
    return TestClient(create_app(build_service(config)))


@pytest.fixture(scope="module")
def client(tiny_checkpoint, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("sockets")
    limits = {"max_images": 2, "image_fetch_timeout_s": 1.0}
    with api(tiny_checkpoint, sockets, allowed_media_domains=("127.0.0.1",), **limits) as client:
        yield client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "tiny", **body})


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"]
)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(client, field, value):
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "%s": %s}'
    response = client.post(
        "/v1/chat/completions",
        content=body % (field, value),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400 and field in response.json()["error"]["message"]


def test_models_and_health_that_names_the_missing_peers(client, tiny_checkpoint):
    (card,) = client.get("/v1/models").json()["data"]
    assert 0 < time.time() - card["created"] < 600  # when it started, not 1970
    assert card["id"] == "tiny" and card["root"] == str(tiny_checkpoint)
    assert card["max_model_len"] == load_model_config(tiny_checkpoint).text.max_position_embeddings
    health = client.get("/health")  # no encoder or decoder answers this prefill
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert client.head("/health").status_code == 503 and client.head("/health/live").is_success
    problems = " ".join(health.json()["problems"])
    assert "no encode server answers" in problems and "no decode server answers" in problems
    assert set(health.json()["peers"].values()) == {"down"}
    assert client.get("/health/live").status_code == 200  # alive, only not ready


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        ({"messages": USER, "n": 17}, 400, "over this server's limit of 16 (max_n)"),
        ({"messages": USER, "n": 129}, 400, "invalid n"),
        ({"messages": USER, "n": 16, "logprobs": True, "top_logprobs": 20}, 400, "n × (top"),
        (
            {"messages": USER, "response_format": {"type": "json_schema"}},
            400,
            "needs a json_schema",
        ),
        ({"messages": USER, "response_format": {"type": "xml"}}, 400, "invalid response_format"),
        (  # a schema beside type text would not apply: refused rather than silently applied
            {
                "messages": USER,
                "response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}},
            },
            400,
            "type text takes no json_schema",
        ),
        (
            {
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": False},
                },
            },
            400,
            "the schema false allows no value",
        ),
        ({"messages": USER, "tools": [{"type": "function"}]}, 400, "invalid tools.0.function"),
        ({"messages": USER, "tool_choice": "required"}, 400, "tool_choice 'required' needs tools"),
        (
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            400,
            "invalid tools.0.function.name",
        ),
        ({"messages": USER, "modalities": ["text", "audio"]}, 400, "audio output"),
        (
            {"messages": USER, "structured_outputs": {"whitespace_pattern": " "}},
            400,
            "structured_outputs: whitespace_pattern not supported",
        ),
        (
            {"messages": USER, "structured_outputs": {"regex": "a"}, "guided_regex": "b"},
            400,
            "structured_outputs: regex not supported",
        ),
        (  # vLLM refuses the two together too: the prompt cannot end in both places
            {"messages": USER, "continue_final_message": True},
            400,
            "continue_final_message requires add_generation_prompt=false",
        ),
        ({"messages": USER, "chat_template": "{{ 1 }}"}, 400, "chat_template is not supported"),
        (
            {"messages": USER, "chat_template_kwargs": {"not a name": 1}},
            400,
            "invalid chat_template_kwargs: Value error, names must be template variable names",
        ),
        (
            {"messages": USER, "chat_template_kwargs": {"a": [[[[[[[[[1]]]]]]]]]}},
            400,
            "values may nest at most 8 deep",
        ),
        (
            {"messages": USER, "chat_template_kwargs": {"messages": []}},
            400,
            "chat_template_kwargs may not set messages: the server gives it",
        ),
        ({"messages": USER, "chat_template": "{{ 1 }}"}, 400, "chat_template is not supported"),
        ({"messages": USER, "allowed_token_ids": [5]}, 400, "allowed_token_ids is not supported"),
        ({"messages": USER, "use_beam_search": True}, 400, "use_beam_search is not supported"),
        ({"messages": USER, "bad_words": ["x"]}, 400, "bad_words is not supported"),
        (  # counted before pydantic reads them: 3 million held every stream up for 9 s
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 70000}]},
            400,
            "the messages hold 70001 messages and content parts, over 65536",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]},
            400,
            "cannot hold refusals",
        ),
        ({"messages": USER, "guided_choice": []}, 400, "invalid guided_choice"),
        ({"messages": USER, "guided_regex": "x" * 40000}, 400, "invalid guided_regex"),
        (
            {"messages": USER, "guided_json": {"enum": ["x" * 40000]}},
            400,
            "a grammar may have up to 24576 bytes",
        ),
        (  # few characters, many bytes: the limit is the hand-off header's, in bytes
            {"messages": USER, "guided_regex": "\U0001f600" * 8000},
            400,
            "a grammar may have up to 24576 bytes",
        ),
        (
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "stop": ["}"],
            },
            400,
            "would cut a forced tool call short",
        ),
        ({"messages": USER, "guided_json": "[" * 100000}, 400, "invalid guided_json"),
        ({"messages": USER, "presence_penalty": 2.5}, 400, "invalid presence_penalty"),
        ({"messages": USER, "repetition_penalty": 0}, 400, "invalid repetition_penalty"),
        ({"messages": USER, "logit_bias": {"x": 1}}, 400, "keys must be token ids"),
        ({"messages": USER, "logit_bias": {"５": 1}}, 400, "keys must be token ids"),
        ({"messages": USER, "logit_bias": {"3": 101}}, 400, "biases must be in [-100, 100]"),
        ({"messages": USER, "logit_bias": {"99999": 1}}, 400, "outside the vocabulary"),
        ({"messages": USER, "stop_token_ids": [99999]}, 400, "outside the vocabulary"),
        ({"messages": USER, "stop_token_ids": [-1]}, 400, "invalid stop_token_ids"),
        ({"messages": USER, "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
            400,
            "invalid messages.1.tool_calls.0.function",
        ),
        ({"messages": [{"role": "user", "content": None}]}, 400, "need content"),
        ({"messages": USER, "temperature": 3}, 400, "invalid temperature"),
        ({"messages": USER, "top_p": 0}, 400, "invalid top_p"),
        ({"messages": USER, "max_tokens": 0}, 400, "invalid max_tokens"),
        ({"messages": USER, "top_logprobs": 2}, 400, "top_logprobs requires logprobs"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, 400, "requires stream"),
        ({"messages": USER, "stop": [str(i) for i in range(17)]}, 400, "up to 16 non-empty"),
        ({"messages": USER, "stop": ["x" * 300]}, 400, "stop takes up to 16 strings of 1 to 256"),
        ({"messages": []}, 400, "invalid messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid messages"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "invalid messages"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                    }
                ]
            },
            400,
            "cannot hold images",
        ),
        ({"messages": USER, "max_tokens": 100000}, 400, "over the context length"),
        ({"messages": USER, "seed": 2**64}, 400, "invalid seed"),
        ({"messages": USER, "top_k": 10**30}, 400, "invalid top_k"),  # past what the wire holds
        (  # the union's form it came nearest to, not "should be 'none', 'auto' or 'required'"
            {"messages": USER, "tool_choice": {"type": "function"}},
            400,
            "invalid tool_choice.function: Field required",
        ),
        ({"messages": USER, "tool_choice": "any"}, 400, "invalid tool_choice: Input should be"),
        # Values of the wrong JSON type are refused, as OpenAI refuses them, not coerced.
        ({"messages": USER, "logprobs": "yes"}, 400, "invalid logprobs: Input should be a valid"),
        ({"messages": USER, "max_tokens": True}, 400, "invalid max_tokens: Input should be"),
        ({"messages": USER, "n": 2.0}, 400, "invalid n: Input should be a valid integer"),
        ({"messages": USER, "stream": 1}, 400, "invalid stream: Input should be a valid bool"),
        ({"messages": USER, "temperature": "0.5"}, 400, "invalid temperature: Input should"),
        ({"messages": USER, "seed": "7"}, 400, "invalid seed: Input should be a valid integer"),
        ({"messages": USER, "prompt_logprobs": 21}, 400, "invalid prompt_logprobs"),
        (
            {
                "messages": [*USER, {"role": "assistant", "content": "{"}],
                "echo": True,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
            },
            400,
            "echo would put text before a forced tool call",
        ),
        ({"messages": USER, "prompt_logprobs": -1}, 400, "invalid prompt_logprobs"),
        (
            {"messages": USER, "prompt_logprobs": 1, "stream": True},
            400,
            "prompt_logprobs cannot be streamed",
        ),
        (
            {"messages": [{"role": "user", "content": "word " * 1200}], "prompt_logprobs": 20},
            400,
            "prompt_logprobs would reply with",
        ),
    ],
)
def test_invalid_requests_get_openai_errors(client, body, status, fragment):
    response = chat(client, **body)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_fields_clients_send_routinely_are_accepted(client, caplog):
    """What the openai client, LangChain and agents send; an earlier reply echoed back."""
    echoed = {
        "role": "assistant",
        "content": "hello",
        "refusal": None,
        "tool_calls": None,
        "function_call": None,
        "audio": None,
        "annotations": [],
    }
    body = {
        "messages": [*USER, echoed, {"role": "user", "content": "again"}],
        "response_format": {"type": "text"},
        "metadata": {"k": "v"},
        "store": False,
        "parallel_tool_calls": True,
        "user": "u1",
        "service_tier": "auto",
        "tool_choice": "none",
        "tools": [],
        "n": 1,
        "temperature": 1,  # an integer where a number is asked is a number
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "min_tokens": 1,
        "logit_bias": {"5": -100, "7": 3.5},
        "stop_token_ids": [3],
        "skip_special_tokens": False,
        "some_future_field": {"x": 1},
    }
    with caplog.at_level("WARNING"):
        response = chat(client, **body)
    # No peers run here: a request that passed validation gets as far as looking for encode.
    assert response.status_code == 503, response.json()
    assert "ignored request fields: some_future_field" in caplog.text


def test_null_fields_mean_their_defaults_and_vllms_names_are_taken(client, caplog):
    """Clients and proxies send unset options as null; vLLM's current `structured_outputs`,
    a request without `model`, a part with keys of the client's own, an echoed refusal."""
    history = [
        *USER,
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
    ]
    nulls = dict.fromkeys(["stream", "n", "presence_penalty", "frequency_penalty", "logprobs"])
    nulls |= dict.fromkeys(["max_tokens", "stop", "temperature", "tools", "stream_options"])
    body = {"messages": history, "structured_outputs": {"choice": ["a", "b"]}, **nulls}
    body |= {"stream_options": {}}  # vLLM tests its truth: asks for nothing without stream
    with caplog.at_level("WARNING"):
        response = client.post("/v1/chat/completions", json=body)  # no model
    # One token ends a choice of "a" or "b": prefill answers it alone, without peers.
    assert response.status_code == 200, response.json()
    assert response.json()["choices"][0]["message"]["content"] in ("a", "b")
    assert "ignored request fields" not in caplog.text


@pytest.mark.parametrize("asked,alternatives", [(True, 1), (False, None), (0, 0), (5, 5)])
def test_prompt_logprobs_true_asks_for_one_alternative_as_in_vllm(asked, alternatives):
    """vLLM reads the field as an int, so its clients send `true` (a bool is an int there)."""
    assert parse_request({"messages": USER, "prompt_logprobs": asked}).prompt_logprobs == (
        alternatives
    )


def test_structured_outputs_are_the_guided_fields_they_name():
    from epd.api.schema import parse_completion, parse_request

    asked = {"json": {"type": "object"}, "disable_any_whitespace": True, "regex": None}
    chat = parse_request({"messages": USER, "structured_outputs": asked})
    assert chat.guided_json == {"type": "object"} and chat.guided_regex is None
    legacy = parse_completion({"prompt": "a", "structured_outputs": {"json_object": True}})
    assert legacy.guided_json == {"type": "object"} and legacy.model is None
    grammar = parse_completion({"prompt": "a", "structured_outputs": {"grammar": "start: 'a'"}})
    assert grammar.guided_grammar == "start: 'a'"


def test_the_checkpoint_path_names_the_model_too(client, tiny_checkpoint):
    response = client.post(
        "/v1/chat/completions",
        json={"model": str(tiny_checkpoint), "messages": USER, "ignore_eos": True},
    )
    assert response.status_code == 503  # found: it looked for a decoder (the first token
    # sampled cannot end it)
    assert client.get(f"/v1/models/{tiny_checkpoint}").json()["id"] == "tiny"


def test_version(client):
    assert client.get("/version").json()["version"]


def test_unknown_model_is_404(client):
    response = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": USER})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_body_nested_too_deeply_is_a_400(client):
    body = '{"model": "tiny", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = client.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert (
        response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]
    )


def test_body_that_is_not_json(client):
    response = client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def image(url):
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}


@pytest.mark.parametrize(
    "url,fragment",
    [
        (
            "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
            "image 0: not a readable",
        ),
        ("data:image/png;base64,@@@", "image 0: invalid base64"),
        ("data:image/png,raw", "image 0: data URL must be base64"),
        (
            "file:///etc/passwd",
            "image 0: file: URLs are refused; start the server with --allowed-local",
        ),
        ("http://127.0.0.1:9/none.png", "image 0: http://127.0.0.1:9/none.png could not be"),
        ("http://localhost/a.png", "image 0: host 'localhost' is not in the allowed media"),
    ],
)
def test_bad_images_are_400_naming_the_image(client, url, fragment):
    response = chat(client, messages=[image(url)])
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]


def test_too_many_images(client):
    url = "data:image/png;base64,AAAA"
    response = chat(client, messages=[image(url), image(url), image(url)])
    assert (
        response.status_code == 400 and "over the limit of 2" in response.json()["error"]["message"]
    )


def test_images_the_encoders_cannot_take_in_time_are_refused_before_the_prompt_is_built(
    tiny_checkpoint, tmp_path, monkeypatch
):
    service = build_service(
        PrefillConfig(
            model=str(tiny_checkpoint),
            bind=f"ipc://{tmp_path}/prefill",
            encoders=(f"ipc://{tmp_path}/encode",),
            decoders=(f"ipc://{tmp_path}/decode",),
            served_model_name=("tiny",),
        )
    )
    png = io.BytesIO()
    Image.new("RGB", (56, 56)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    built = []
    monkeypatch.setattr(PromptBuilder, "prepare", lambda *args: built.append(args))
    with TestClient(create_app(service)) as client:
        router = service.coordinator.router
        encoder = router.encoders.current[0]
        monkeypatch.setattr(router.outbox, "is_up", lambda address: True)
        # its pace is not known until these are back, and it holds a request at the limits
        router.load.sending(("first", 0), encoder, router.load.first_patches)
        response = chat(client, messages=[image(url)])
    assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1
    assert "encode_timeout_s" in response.json()["error"]["message"]
    assert built == []  # refused from the image's header, before the prompt was built


def test_image_headers_are_read_once_and_off_the_event_loop(client, monkeypatch):
    """Reading a header can take a while (Pillow reads a JPEG's fill bytes one at a time):
    not on the loop, and not again when the prompt is built."""
    read, given = [], []
    grids = PromptBuilder.grids

    def reading(builder, images):
        read.append(threading.current_thread().name)
        return grids(builder, images)

    def prepare(builder, conversation, images, request_id="", grids=None):
        given.append(grids)
        raise ValueError("stop here")

    monkeypatch.setattr(PromptBuilder, "grids", reading)
    monkeypatch.setattr(PromptBuilder, "prepare", prepare)
    png = io.BytesIO()
    Image.new("RGB", (56, 56)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    response = chat(client, messages=[image(url)])
    assert response.status_code == 400 and "stop here" in response.json()["error"]["message"]
    assert len(read) == 1 and read[0].startswith("prompts")
    assert given == [((4, 4),)]


def test_unreachable_peers_are_503_not_a_hang(client):
    # ignore_eos: a first token that ended the reply would need no decoder (CI met one)
    response = chat(client, messages=USER, max_tokens=2, ignore_eos=True)
    assert response.status_code == 503
    assert "no decode server is reachable" in response.json()["error"]["message"]


def test_a_reply_its_first_token_ends_is_served_by_prefill_alone(client):
    """Prefill samples the first token; a request it ends never needs a decoder (none runs)."""
    whole = chat(client, messages=USER, max_tokens=1, n=2, logprobs=True, temperature=0)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["usage"]["completion_tokens"] == 2
    for choice in body["choices"]:
        assert choice["finish_reason"] == "length" and len(choice["logprobs"]["content"]) == 1
    streamed = chat(client, messages=USER, max_tokens=1, stream=True, temperature=0)
    assert streamed.status_code == 200
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [choice for event in events[:-1] for choice in json.loads(event)["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    assert content == body["choices"][0]["message"]["content"]


# Prompts of whole 16-token blocks and more, which no other test sends.
LONG, OTHER = (" ".join(f"{word}{i}" for i in range(40)) for word in ("shape", "colour"))


def cached_tokens(usage):
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_gave(client):
    """0 for a new prompt; for the same prompt again its whole cached blocks (never its last
    token), in whole replies, a stream's usage chunk and the Responses API; a legacy
    completion adds each prompt's hit once, whatever its n. No decoder runs: a request that
    goes on past its first token is cached, then refused (503); max_tokens 1 is answered."""
    once = {"max_tokens": 1}  # (a chat prompt begins as the template does: other tests' hit)
    fresh = client.post("/v1/completions", json={"model": "tiny", "prompt": OTHER, **once})
    assert cached_tokens(fresh.json()["usage"]) == 0 and fresh.json()["usage"]["prompt_tokens"] > 48
    ask = {"messages": [{"role": "user", "content": LONG}]}
    assert chat(client, **ask, max_tokens=2, ignore_eos=True).status_code == 503
    streamed = chat(client, **ask, **once, stream=True, stream_options={"include_usage": True})
    usage = json.loads(streamed.text.split("data: ")[-2])["usage"]
    hit = cached_tokens(usage)
    assert hit > 32 and hit % 16 == 0 and hit < usage["prompt_tokens"]
    whole = chat(client, **ask, **once).json()
    assert cached_tokens(whole["usage"]) == hit
    assert whole["system_fingerprint"].startswith("epd-")  # the server's, in every reply
    assert fresh.json()["system_fingerprint"] == whole["system_fingerprint"]
    responses = client.post("/v1/responses", json={"input": LONG, "max_output_tokens": 1})
    assert responses.json()["usage"]["input_tokens_details"]["cached_tokens"] == hit
    legacy = {"model": "tiny", "prompt": LONG, "max_tokens": 2, "ignore_eos": True}
    assert client.post("/v1/completions", json=legacy).status_code == 503
    legacy |= once
    both = client.post("/v1/completions", json=legacy | {"prompt": [LONG, LONG], "n": 2})
    alone = client.post("/v1/completions", json=legacy).json()["usage"]
    assert cached_tokens(both.json()["usage"]) == 2 * cached_tokens(alone) > 0


def test_developer_messages_are_system_turns(client, tiny_checkpoint):
    from epd.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    builder = PromptBuilder.from_checkpoint(tiny_checkpoint, tokenizer, 16)
    request = parse_request(
        {"model": "tiny", "messages": [{"role": "developer", "content": "Be brief."}, *USER]}
    )
    text = tokenizer.decode(builder.prepare(builder.read(request), []).prompt_ids)
    assert text.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>")


@pytest.fixture
def trickling_server():
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/slow.png"
    server.shutdown()


def test_image_fetch_has_a_total_deadline(client, trickling_server):
    import time

    start = time.monotonic()
    response = chat(client, messages=[image(trickling_server)])
    assert response.status_code == 400 and "took over 1.0s" in response.json()["error"]["message"]
    assert time.monotonic() - start < 3


def test_request_ids_are_echoed_or_made(client):
    response = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": []},
        headers={"x-request-id": "trace-42.a:b"},
    )
    assert response.status_code == 400 and response.headers["x-request-id"] == "trace-42.a:b"
    made = client.get("/v1/models").headers["x-request-id"]
    assert len(made) == 32 and made != client.get("/v1/models").headers["x-request-id"]
    odd = client.get("/v1/models", headers={"x-request-id": "a b\t" + "x" * 300})
    assert odd.headers["x-request-id"] != "a b\t" + "x" * 300  # not echoed into logs or headers
    assert client.get("/nowhere").headers["x-request-id"]


def test_every_served_name_is_listed_and_replies_carry_the_first(tiny_checkpoint, tmp_path):
    with api(tiny_checkpoint, tmp_path, served_model_name=("kimi", "org/kimi-vl")) as client:
        listed = client.get("/v1/models").json()["data"]
        assert [card["id"] for card in listed] == ["kimi", "org/kimi-vl"]
        assert client.get("/v1/models/org/kimi-vl").json()["id"] == "org/kimi-vl"
        assert client.get("/v1/models/tiny").status_code == 404
        for name in ("kimi", "org/kimi-vl", str(tiny_checkpoint)):
            body = {"model": name, "prompt": "a", "max_tokens": 1}
            assert client.post("/tokenize", json=body).status_code == 200


def test_one_model_by_id(client):
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    response = client.get("/v1/models/org/other-model")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_unknown_routes_and_methods_get_openai_errors(client):
    missing = client.get("/v1/embeddings")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no such route: GET /v1/embeddings"
    wrong = client.get("/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def preflight(client):
    return client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_no_origin_is_allowed_by_default(client):
    assert "access-control-allow-origin" not in preflight(client).headers
    response = client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in response.headers


def test_allowed_origins_get_cors_answers(tiny_checkpoint, tmp_path):
    with api(tiny_checkpoint, tmp_path, allowed_origins=("https://app.example",)) as client:
        answer = preflight(client)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        other = client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


@pytest.fixture(scope="module")
def locked(tiny_checkpoint, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("locked")
    with api(
        tiny_checkpoint, sockets, api_key="s3cret", allowed_origins=("https://app.example",)
    ) as client:
        yield client


@pytest.mark.parametrize("header", [None, "Bearer nope", "Bearer s3cret2", "s3cret", "Bearer "])
def test_without_the_api_key_v1_is_401(locked, header):
    headers = {"Authorization": header} if header is not None else {}
    for response in (
        locked.get("/v1/models", headers=headers),
        locked.post("/v1/chat/completions", json={"messages": []}, headers=headers),
        locked.get("/v1/nowhere", headers=headers),
        locked.post("/tokenize", json={"prompt": "hi"}, headers=headers),  # vLLM's, outside /v1
        locked.post("/detokenize", json={"tokens": [5]}, headers=headers),
        locked.get("/tokenizer_info", headers=headers),
    ):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["x-request-id"]


def test_with_the_api_key_v1_answers_and_health_is_open(locked):
    ok = locked.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
    assert locked.get("/health").status_code == 503  # open, and truthful: no peers here
    assert preflight(locked).status_code == 200  # a browser's preflight carries no key


@pytest.mark.parametrize("header", [None, "Bearer nope"])
def test_health_shows_its_counts_only_to_a_holder_of_the_key(locked, header):
    """Probes read the state; the caches' and requests' counts would tell one client of a
    shared server about the others' requests."""
    headers = {"Authorization": header} if header is not None else {}
    stranger = locked.get("/health", headers=headers)
    assert stranger.status_code == 503 and stranger.json()["status"] == "unavailable"
    assert stranger.json()["problems"]  # why it is not ready, as a probe's log shows it
    assert not {"image_cache", "prefill", "peers", "in_flight"} & set(stranger.json())
    keyed = locked.get("/health", headers={"Authorization": "Bearer s3cret"})
    assert keyed.status_code == 503
    assert {"image_cache", "prefill", "peers", "in_flight"} <= set(keyed.json())


def test_the_api_key_can_come_from_the_environment(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_API_KEY", "from-env")
    with api(tiny_checkpoint, tmp_path) as client:
        assert client.get("/v1/models").status_code == 401
        headers = {"Authorization": "Bearer from-env"}
        assert client.get("/v1/models", headers=headers).status_code == 200


def test_metrics_are_open_with_an_api_key(locked):
    response = locked.get("/metrics")
    assert response.status_code == 200 and "epd:time_to_first_token_seconds" in response.text
    assert locked.get("/v1/models").status_code == 401


@pytest.fixture(scope="module")
def small_bodies(tiny_checkpoint, tmp_path_factory):
    with api(tiny_checkpoint, tmp_path_factory.mktemp("small"), max_request_bytes=1000) as client:
        yield client


def test_a_body_over_the_limit_is_413_before_it_is_read(small_bodies):
    declared = small_bodies.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}]},
    )
    assert (
        declared.status_code == 413 and "max_request_bytes" in declared.json()["error"]["message"]
    )

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 100

    chunked = small_bodies.post(
        "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert chunked.status_code == 413


def test_a_body_of_too_many_json_values_is_413_before_it_is_parsed(client):
    import time

    from epd.api.middleware import MAX_JSON_VALUES

    junk = b"[], " * 22_000_000  # 88 MB: 22 million arrays, under max_request_bytes
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "junk": [%s[]]}'
    start = time.monotonic()
    response = client.post(
        "/v1/chat/completions", content=body % junk, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413 and time.monotonic() - start < 5
    assert f"over {MAX_JSON_VALUES} JSON values" in response.json()["error"]["message"]
    few = body % (b"[], " * 1000)  # many values, but a number a request may hold
    assert client.post("/v1/chat/completions", content=few).status_code != 413


def test_routes_without_images_take_smaller_bodies(tiny_checkpoint, tmp_path):
    with api(tiny_checkpoint, tmp_path, max_text_request_bytes=2000) as client:
        prompt = {"model": "tiny", "prompt": "x" * 3000, "max_tokens": 1}
        legacy = client.post("/v1/completions", json=prompt)
        assert legacy.status_code == 413
        assert "max_text_request_bytes" in legacy.json()["error"]["message"]
        chat = client.post(  # a route that may carry images keeps max_request_bytes
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x" * 3000}]},
        )
        assert chat.status_code != 413


def test_huge_numbers_and_text_are_400_at_once(client):
    import time

    digits = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": %s}'
    response = client.post(
        "/v1/chat/completions", content=digits % ("9" * 5000), headers={"Content-Type": "json"}
    )
    assert response.status_code == 400 and "4300 digits" in response.json()["error"]["message"]
    start = time.monotonic()
    response = chat(client, messages=[{"role": "user", "content": "a " * 5_000_000}])  # 10 MB
    assert response.status_code == 400 and time.monotonic() - start < 2
    assert response.json()["error"]["code"] == "context_length_exceeded"
    legacy = client.post("/v1/completions", json={"model": "tiny", "prompt": "b " * 5_000_000})
    assert legacy.status_code == 400 and "characters" in legacy.json()["error"]["message"]


def test_peers_named_by_host_follow_their_dns_answers(tiny_checkpoint, tmp_path, monkeypatch):
    import socket
    import time

    import epd.prefill.router as router

    answers: dict[str, list[str]] = {}
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        if host != "decode.epd.svc":
            return real(host, port, *args, **kwargs)
        if not answers.get(host):
            raise OSError("no such host")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(router, "RESOLVE_S", 0.05)
    service = "tcp://decode.epd.svc:7999"
    with api(tiny_checkpoint, tmp_path, decoders=(service,)) as client:

        def decoders():
            peers = client.get("/health").json()["peers"]
            return sorted(a for a in peers if a.endswith(":7999"))

        assert decoders() == []  # nothing resolves yet
        problems = client.get("/health").json()["problems"]
        assert any(f"no decode server answers (tried {service})" in p for p in problems)
        answers["decode.epd.svc"] = ["127.0.0.7", "127.0.0.8"]  # scaled up: two pods
        deadline = time.monotonic() + 5
        while decoders() != ["tcp://127.0.0.7:7999", "tcp://127.0.0.8:7999"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        answers["decode.epd.svc"] = ["127.0.0.8"]  # scaled down: one left
        while decoders() != ["tcp://127.0.0.8:7999"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        metrics = client.get("/metrics").text
        assert 'address="tcp://127.0.0.8:7999"' in metrics
        assert 'address="tcp://127.0.0.7:7999"' not in metrics


@pytest.mark.parametrize(
    "field", ['"messages": [{"role": "user", "content": "\\ud800"}]', '"stop": ["a\\udfff"]']
)
def test_a_lone_surrogate_is_a_400(client, field):
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' + field + "}"
    response = client.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]


def test_json_surrogates_pair_into_characters_and_alone_are_refused():
    assert parse_json(b'"\\ud83d\\ude00 \\\\ud800"') == "\U0001f600 \\ud800"  # an escaped \\
    with pytest.raises(APIError, match="surrogate"):
        parse_json(b'{"a": ["x\\ud83dy"]}')


def test_an_unforeseen_error_is_a_json_500_and_the_connection_lives_on(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """Starlette's handler for any exception raised it again after answering, and uvicorn then
    closed the connection: the client's next request on it failed."""
    peers = {"encoders": (f"ipc://{tmp_path}/e",), "decoders": (f"ipc://{tmp_path}/d",)}
    config = PrefillConfig(
        model=str(tiny_checkpoint), bind=f"ipc://{tmp_path}/p", served_model_name=("tiny",), **peers
    )
    service = build_service(config)

    def read(self, chat):
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(PromptBuilder, "read", read)
    with TestClient(create_app(service)) as client:  # raises what the app raises
        response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER})
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "RuntimeError: unforeseen"
        assert response.headers["x-request-id"]
        assert client.get("/v1/models").status_code == 200


def test_a_client_that_left_mid_body_is_not_a_server_error():
    assert as_api_error(ClientDisconnect()).status == 499


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_too_many_tokens_asked_names_the_field_the_client_sent(client, field):
    response = chat(client, messages=USER, **{field: 2**70})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == field


def test_a_responses_error_names_the_responses_field(client):
    """/v1/responses becomes a chat request: its errors must name the fields the client sent."""
    response = client.post(
        "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2**40}
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "max_output_tokens" and "max_tokens" not in error["message"]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/responses", {"input": "hi", "include": [{}]}, "include.0"),  # unhashable
        ("/v1/responses", {"input": "hi", "include": "reasoning.encrypted_content"}, "include"),
        ("/v1/chat/completions", {"messages": USER, "modalities": 5}, "modalities"),  # no list
        ("/v1/chat/completions", {"messages": USER, "modalities": "audio"}, "modalities"),
        ("/v1/chat/completions", {"messages": USER, "audio": "alloy"}, "audio"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_400_naming_it(client, route, body, param):
    """Fields read only after validation were once never type-checked: a 500."""
    response = client.post(route, json={"model": "tiny", **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["message"]


DOCS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def test_without_the_api_key_the_docs_are_401(locked):
    """The docs list every route: they are the API's, behind its key."""
    for path in DOCS:
        response = locked.get(path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert locked.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    schema = locked.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    assert "/v1/chat/completions" in schema["paths"]


def test_without_an_api_key_the_docs_are_open(client):
    assert all(client.get(path).status_code == 200 for path in DOCS)
