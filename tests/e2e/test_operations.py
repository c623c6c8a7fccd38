"""`epd serve` set up as an operator would put it in front of users: an API key (kept out of
every child's command line), an allowed internal image host, metrics from every role, JSON log
lines with the access log; and set up by hand: overload, a hung peer, a drain, CURVE."""

import http.server
import io
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch
import zmq
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from epd.checkpoint import progress
from epd.local import LocalPipeline
from epd.model.packed import packs_many_rows
from epd.runtime.metrics import FRESH_S
from epd.serve import BRIEF_SPIN, OPENMP_WAITING
from epd.wire.curve import CurveKeys, make_keys

from .stack import (
    DRAINED,
    cluster,
    data_url,
    free_base,
    health,
    image_part,
    serve,
    streams_under_way,
    text_part,
)
from .test_failures import alive

KEY = "k-7f3a"
# The drain these streams need takes ~15 s here, and a slow CI machine has passed the default
# 30 s: the tests are about finishing the work, so the clock must not be what ends it.
DRAIN = ("--drain-timeout-s", "300")


@pytest.fixture(scope="module")
def locked_stack(tiny_checkpoint, tmp_path_factory):
    config = tmp_path_factory.mktemp("auth") / "epd.yaml"
    config.write_text(f"prefill:\n  api_key: {KEY}\n")
    base = free_base()
    flags = ("--allowed-media-domains", "127.0.0.1", "--log-format", "json", "--access-log")
    stack = serve(tiny_checkpoint, base, "--config", str(config), *flags)
    yield stack, base
    assert stack.stop() == 0, stack.output


@pytest.fixture(scope="module")
def client(locked_stack):
    _, base = locked_stack
    return openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key=KEY, max_retries=0)


def test_the_client_needs_the_key(locked_stack):
    _, base = locked_stack
    url = f"http://127.0.0.1:{base + 20}/v1"
    keyed = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    model = keyed.models.list().data[0].id
    reply = keyed.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=url, api_key="k-7f3b", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()
    for docs in ("/docs", "/redoc", "/openapi.json"):  # they list every route
        assert requests.get(f"http://127.0.0.1:{base + 20}{docs}", timeout=5).status_code == 401
    schema = requests.get(
        f"http://127.0.0.1:{base + 20}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert "/v1/chat/completions" in schema.json()["paths"]


def test_the_key_is_in_no_command_line(locked_stack):
    stack, _ = locked_stack
    pids = list(stack.role_pids().values())
    assert len(pids) == 3
    for pid in [stack.popen.pid, *pids]:
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.skipif(
    bool(OPENMP_WAITING & os.environ.keys()), reason="this environment says how OpenMP waits"
)
def test_every_roles_threads_sleep_soon_after_their_work_on_a_cpu(locked_stack):
    """The roles share this machine's cores: serve starts each with a brief OpenMP spin
    (`openmp_env`)."""
    stack, _ = locked_stack
    spins = {}
    for role, pid in stack.role_pids().items():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        given = [e for e in environ if e.startswith(b"GOMP_SPINCOUNT=")]
        spins[role] = given[0].split(b"=")[1].decode() if given else None
    brief = str(BRIEF_SPIN)
    assert spins == {"encode": brief, "prefill": brief, "decode": brief}


def test_each_role_says_what_it_does_until_it_is_ready(locked_stack):
    """Loading, packing and warming up each say when they start and when they end, in order,
    before the role's ready line: as JSON log lines, whole (no progress bar)."""
    stack, _ = locked_stack
    packs_vision = packs_many_rows(torch.float32)  # the tiny checkpoint runs in float32 here
    loads = ["loading", "loaded"]
    phases = {
        "encode": loads + (["packing", "packed"] if packs_vision else []),
        "decode": [*loads, "packing", "packed", "warming", "warmed"],
        "prefill": [*loads, "packing", "packed", "warming", "warmed"],
    }
    for role, expected in phases.items():
        prefix = f"[{role}] "
        lines = [
            line[len(prefix) :] for line in stack.output.splitlines() if line.startswith(prefix)
        ]
        ready = next(i for i, line in enumerate(lines) if line.startswith(f"epd {role} ready"))
        logged = [json.loads(line) for line in lines[:ready] if line.startswith("{")]
        said = [entry["message"] for entry in logged if entry["logger"] == progress.__name__]
        assert [message.split(" ")[0] for message in said] == expected, said


@pytest.fixture(scope="module")
def image_server():
    png = io.BytesIO()
    Image.new("RGB", (300, 200), "purple").save(png, "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/purple.png"
            self.send_response(200 if found else 404)
            self.end_headers()
            if found:
                self.wfile.write(png.getvalue())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_allowed_internal_host_serves_images(client, tiny_checkpoint, image_server):
    local = LocalPipeline(tiny_checkpoint, allowed_media_domains=("127.0.0.1",))
    content = [image_part(f"{image_server}/purple.png"), text_part("Shape?")]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, **body)
    assert reply.choices[0].message.content == local.chat({"model": model, **body}).text
    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        missing = [image_part(f"{image_server}/nope.png")]
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": missing}])
    with pytest.raises(openai.BadRequestError, match="'localhost' is not in the allowed media"):
        other = [image_part(image_server.replace("127.0.0.1", "localhost") + "/purple.png")]
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": other}])


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics on a local port, as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_real_requests_in_every_role_on_one_scrape_target(client, locked_stack):
    """The API port's /metrics carries every role's series, labelled by role, as each role's
    own port gives them; no `_created` series (vLLM has none)."""
    _, base = locked_stack
    api, encode, decode = base + 20, base + 10, base + 12
    before = scrape(api)
    model = client.models.list().data[0].id
    picture = data_url(Image.new("RGB", (112, 84), "orange"))
    for content in ("hello", [image_part(picture), text_part("colour?")]):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
    time.sleep(FRESH_S)  # the peers' series, as the API port last fetched them, are this old
    after, own = scrape(api), {"encode": scrape(encode), "decode": scrape(decode)}

    def key(name: str, role: str = "prefill", **labels: str) -> tuple[str, tuple]:
        return name, tuple(sorted({"model_name": model, "role": role, **labels}.items()))

    def grew(name: str, role: str = "prefill", **labels: str) -> float:
        sample = key(name, role, **labels)
        return after.get(sample, 0.0) - before.get(sample, 0.0)

    # vLLM's label on every series of every role (the served model), and the role's own
    assert {dict(labels)["model_name"] for _, labels in after} == {model}
    assert {dict(labels)["role"] for _, labels in after} == {"encode", "prefill", "decode"}
    assert not [name for name, _ in after if name.endswith("_created")]
    for role, samples in own.items():  # each role's series as its own port has them
        assert {k for k in after if dict(k[1])["role"] == role} == samples.keys()
    assert grew("epd:request_success_total", finished_reason="length") == 2
    assert grew("epd:generation_tokens_total") == 6
    assert grew("epd:prompt_tokens_total") > 2 * 3  # the image alone has 12 tokens
    assert grew("epd:time_to_first_token_seconds_count") == 2
    assert grew("epd:request_prefill_time_seconds_count") == 2
    assert grew("epd:inter_token_latency_seconds_count") >= 2
    assert grew("epd:time_per_output_token_seconds_count") == grew(
        "epd:inter_token_latency_seconds_count"
    )
    assert grew("epd:request_time_per_output_token_seconds_count") == 2
    assert grew("epd:request_decode_time_seconds_count") == 2
    assert grew("epd:request_prompt_tokens_count") == 2
    assert grew("epd:request_prompt_tokens_sum") == grew("epd:prompt_tokens_total")
    assert grew("epd:request_generation_tokens_sum") == 6
    assert grew("epd:e2e_request_latency_seconds_count") == 2
    assert grew("epd:request_queue_time_seconds_count") == 2
    assert grew("epd:images_total") == 1 and grew("epd:encode_wait_seconds_count") == 1
    assert grew("epd:kv_handoff_bytes_total") > 0 and grew("epd:kv_handoff_seconds_count") == 2
    decoder = f"tcp://127.0.0.1:{base + 2}"
    assert after[key("epd:peer_up", address=decoder, peer_role="decode")] == 1
    assert after[key("epd:num_requests_running")] == 0
    # The decoder's KV cache as it reported it with the last delta: empty again, as its own
    # series says too, under the same name.
    assert after[key("epd:kv_cache_usage_perc", decoder=decoder)] == 0
    assert after[key("epd:kv_cache_usage_perc", "decode")] == 0
    assert grew("epd:encode_batch_size_count", "encode") == 1
    assert key("epd:num_preemptions_total", "decode") in after
    assert grew("epd:encode_images_total", "encode") == 1
    assert grew("epd:embedding_bytes_sent_total", "encode") > 0
    assert grew("epd:decode_batch_size_count", "decode") >= 4  # 2 requests × 2 steps each
    handed = grew("epd:kv_handoff_bytes_received_total", "decode")
    assert handed == grew("epd:kv_handoff_bytes_total")


@pytest.fixture(scope="module")
def bounded(tiny_checkpoint):
    """The three roles by hand, prefill admitting at most two waiting requests."""
    flags = ("--max-queued-requests", "2", "--allowed-media-domains", "127.0.0.1")
    with cluster(tiny_checkpoint, role_flags={"prefill": flags}) as started:
        yield started


@pytest.fixture
def held_image():
    """A web server whose one image is sent only once `release` is set: requests for it wait."""
    release = threading.Event()
    png = io.BytesIO()
    Image.new("RGB", (56, 56), "olive").save(png, "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            release.wait(20)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(png.getvalue())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/held.png", release
    release.set()
    server.shutdown()


def wait_for(check, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_overload_is_refused_at_once_while_admitted_requests_finish(bounded, held_image):
    _, client, base = bounded
    url, release = held_image

    def image_request():
        content = [image_part(url), text_part("?")]
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )

    with ThreadPoolExecutor(2) as pool:
        admitted = [pool.submit(image_request) for _ in range(2)]  # both wait for their image
        wait_for(lambda: health(base + 20)[1]["waiting"] == 2)
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert time.monotonic() - start < 5.0  # not the held image's 20 s
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        assert "max_queued_requests" in refused.value.message
        release.set()
        assert [f.result().usage.completion_tokens for f in admitted] == [3, 3]
    metrics = scrape(base + 20)
    labels = (("model_name", "tiny"), ("reason", "overloaded"), ("role", "prefill"))
    refused = ("epd:requests_refused_total", labels)
    assert metrics[refused] == 1


def test_a_hung_decoder_turns_health_to_503_and_back(bounded):
    processes, client, base = bounded
    decoder = processes["decode"].popen
    assert health(base + 20)[0] == 200
    decoder.send_signal(signal.SIGSTOP)  # alive, connected, silent: it stops answering heartbeats
    try:
        wait_for(lambda: health(base + 20)[0] == 503)
        body = health(base + 20)[1]
        assert (
            body["status"] == "unavailable"
            and body["peers"][f"tcp://127.0.0.1:{base + 2}"] == "down"
        )
        assert any("no decode server answers" in p for p in body["problems"])
    finally:
        decoder.send_signal(signal.SIGCONT)
    wait_for(lambda: health(base + 20)[0] == 200)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_sigterm_drains_requests_in_flight_and_refuses_new_ones(tiny_checkpoint):
    base = free_base()
    stack = serve(tiny_checkpoint, base, "--served-model-name", "tiny", *DRAIN)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-", max_retries=0)
    try:
        with ThreadPoolExecutor(3) as pool:
            streams = streams_under_way(pool, client, 3, DRAINED)
            stack.popen.send_signal(signal.SIGTERM)
            wait_for(lambda: health(base + 20)[1].get("status") == "unavailable", timeout=5)
            with pytest.raises(openai.InternalServerError, match="shutting down") as refused:
                client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            assert refused.value.response.headers["retry-after"] == "1"
            assert all(not s.done() for s in streams)  # the drain began while they ran
            assert [s.result() for s in streams] == [(DRAINED, "length")] * 3
        assert stack.popen.wait(30) == 0, stack.output
    finally:
        stack.stop()  # whatever failed: no stack is left running (it has exited if all went well)
    assert "draining: 3 requests in flight" in stack.output


def test_log_lines_are_json_with_the_request_line_and_the_access_log(client, locked_stack):
    stack, _ = locked_stack
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={"x-request-id": "trace-json-1"},
        extra_body={"ignore_eos": True},  # "2 output tokens" below, whatever is sampled
    )
    assert reply.id.startswith("chatcmpl-trace-json-1")
    time.sleep(0.5)  # the relay prints the child's lines
    lines = [
        line.split("] ", 1)[1]
        for line in stack.output.splitlines()
        if line.startswith("[prefill] ") and "epd prefill ready" not in line
    ]
    entries = [json.loads(line) for line in lines]  # every one is a JSON object
    assert all(e["role"] == "prefill" and e["level"] and e["time"] for e in entries)
    ended = [e for e in entries if e["message"].startswith(f"request {reply.id} done")]
    assert len(ended) == 1 and "2 output tokens" in ended[0]["message"]
    access = [e for e in entries if e["logger"] == "uvicorn.access"]
    assert any(
        "POST /v1/chat/completions" in e["message"] and "200" in e["message"] for e in access
    )


def test_with_curve_keys_only_peers_holding_them_reach_a_decoder(tiny_checkpoint, tmp_path):
    keys = make_keys(tmp_path / "keys")
    with cluster(tiny_checkpoint, flags=("--zmq-curve-keys", str(keys))) as (_, client, base):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.usage.completion_tokens >= 1  # the three talk over CURVE
        context = zmq.Context()
        try:
            stranger = context.socket(zmq.PUSH)  # no keys: dropped in the handshake
            stranger.connect(f"tcp://127.0.0.1:{base + 1}")
            stranger.send(b"not a message", zmq.NOBLOCK)
            time.sleep(1.0)
            assert health(base + 20)[1]["refused_messages"] == 0  # never reached the decoder
            member = context.socket(zmq.PUSH)  # the same bytes from a holder of the keys
            CurveKeys.load(keys).connect(member)
            member.connect(f"tcp://127.0.0.1:{base + 1}")
            member.send(b"not a message")
            wait_for(lambda: health(base + 20)[1]["refused_messages"] == 1)
            time.sleep(0.5)  # and the stranger's bytes did not arrive late either
            assert health(base + 20)[1]["refused_messages"] == 1
        finally:
            context.destroy(linger=0)


def test_a_stopping_decoder_finishes_its_sequences_and_refuses_new_ones(tiny_checkpoint):
    with cluster(tiny_checkpoint, role_flags={"decode": DRAIN}) as (processes, client, base):
        with ThreadPoolExecutor(2) as pool:
            streams = streams_under_way(pool, client, 2, DRAINED)
            processes["decode"].popen.send_signal(signal.SIGTERM)
            wait_for(lambda: health(base + 12)[0] == 503, timeout=5)
            assert health(base + 12)[1]["problems"] == ["draining: shutting down"]
            with pytest.raises(openai.InternalServerError, match="decode is shutting down"):
                client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=2,
                    extra_body={"ignore_eos": True},  # a first token that ends it skips decode
                )
            assert all(not s.done() for s in streams)  # the drain began while they ran
            assert [s.result() for s in streams] == [(DRAINED, "length")] * 2
        assert processes["decode"].popen.wait(30) == 0
        assert "draining: finishing the work under way" in processes["decode"].output


def test_a_drain_that_runs_out_ends_what_is_left_with_the_reason(tiny_checkpoint):
    with cluster(tiny_checkpoint, role_flags={"decode": ("--drain-timeout-s", "1")}) as started:
        processes, client, _ = started
        with ThreadPoolExecutor(1) as pool:
            (stream,) = streams_under_way(pool, client, 1)
            processes["decode"].popen.send_signal(signal.SIGTERM)
            with pytest.raises(openai.APIError, match="decode stopped before this request finish"):
                stream.result(timeout=30)  # its own reason, not the lost connection behind it
        assert processes["decode"].popen.wait(30) == 0


def test_ctrl_c_stops_the_idle_stack_within_seconds(locked_stack):
    """Last here: it stops the module's stack. Every process was gone in ~1.5 s on this
    2-core machine, 2.6-2.9 s with other work on its cores; before the roles left their objects
    to the OS at exit, the interpreter's collections made that 3.9 s, and 9-14 s."""
    stack, _ = locked_stack
    pids = [stack.popen.pid, *stack.role_pids().values()]
    asked = time.monotonic()
    stack.popen.send_signal(signal.SIGINT)
    assert stack.popen.wait(30) == 0, stack.output
    wait_for(lambda: not any(alive(pid) for pid in pids))
    took = time.monotonic() - asked
    assert took < 6, f"{took:.1f}s to stop"  # 3 s wanted; room for a busy machine
    assert "Traceback" not in stack.output
