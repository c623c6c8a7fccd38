"""The router's HTTP side against prefills played by a mock transport: refusals and unreachable
prefills retried before any byte went out, a stream cut off ended with an error event, the API
key checked at the router, and load counted once per request whatever happened to it."""

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from epd.config.roles import RouteConfig
from epd.kv.index import BlockIndex
from epd.route.app import Router, create_app
from epd.route.metrics import RouterMetrics
from epd.route.prefills import PrefillSet

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
HEALTHY = {"status": "ok", "role": "prefill", "pid": 7, "in_flight": 0}


class Unnamed:
    def name(self, path, body):
        return None


class CutOff(httpx.AsyncByteStream):
    """A stream whose prefill dies after its first event."""

    async def __aiter__(self):
        yield b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
        raise httpx.ReadError("connection reset by peer")


def router_for(answers: dict, key: str = "", routing: str = "round-robin") -> tuple[Router, list]:
    """A router over prefills A and B, each answering a chat with answers[url](request)."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            return httpx.Response(200, json=HEALTHY)
        sent.append((url, request))
        return answers[url](request)

    config = RouteConfig(model="m", prefill_urls=(A, B), routing=routing, api_key=key)
    index = BlockIndex()
    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    prefills = PrefillSet(config.prefill_urls, index, key)
    router = Router(config, Unnamed(), prefills, index, RouterMetrics("m"), client=client)
    return router, sent


def routed(router: Router, url: str, reason: str) -> float:
    return router.metrics.routed.labels(url, reason)._value.get()


def test_a_refusal_goes_to_the_next_prefill_before_any_byte_went_out():
    refused = httpx.Response(503, json={"error": {"message": "full"}}, headers={"retry-after": "1"})
    answers = {A: lambda r: refused, B: lambda r: httpx.Response(200, json={"id": "from-b"})}
    router, sent = router_for(answers)
    with TestClient(create_app(router)) as client:
        reply = client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc"})
    assert reply.status_code == 200 and reply.json() == {"id": "from-b"}
    assert [url for url, _ in sent] == [A, B]
    assert all(r.headers["x-request-id"] == "abc" for _, r in sent)  # one id, end to end
    assert reply.headers["x-request-id"] == "abc"
    assert routed(router, B, "retry") == 1 and routed(router, A, "round_robin") == 0
    assert all(p.in_flight == 0 for p in router.prefills.prefills.values())


def test_when_every_prefill_refuses_the_last_refusal_is_the_answer():
    refused = httpx.Response(503, json={"error": {"message": "full"}}, headers={"retry-after": "3"})
    router, sent = router_for({A: lambda r: refused, B: lambda r: refused})
    with TestClient(create_app(router)) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 503 and reply.headers["retry-after"] == "3"
    assert reply.json()["error"]["message"] == "full" and len(sent) == 2


def test_an_unreachable_prefill_is_passed_over_and_marked_down():
    def unreachable(request):
        raise httpx.ConnectError("connection refused", request=request)

    router, _ = router_for({A: unreachable, B: lambda r: httpx.Response(200, json={})})
    with TestClient(create_app(router)) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert not router.prefills.prefills[A].up and router.prefills.prefills[B].up


def test_a_reply_cut_off_before_it_went_out_is_asked_of_the_next_prefill():
    cut = httpx.Response(200, headers={"content-type": "application/json"}, stream=CutOff())
    router, sent = router_for({A: lambda r: cut, B: lambda r: httpx.Response(200, json={"ok": 1})})
    with TestClient(create_app(router)) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
    assert reply.json() == {"ok": 1} and [url for url, _ in sent] == [A, B]


def test_a_stream_cut_off_by_its_prefill_ends_with_an_error_event_and_done():
    stream = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=CutOff())
    router, _ = router_for({A: lambda r: stream, B: lambda r: stream})
    with TestClient(create_app(router)) as client:
        reply = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hel"
    error = json.loads(events[1])["error"]
    assert error["code"] == "service_unavailable" and events[2] == "[DONE]"
    assert router.metrics.failed.labels("upstream")._value.get() == 1
    assert all(p.in_flight == 0 for p in router.prefills.prefills.values())


@pytest.mark.parametrize("given, status", [(None, 401), ("wrong", 401), ("k", 200)])
def test_the_api_key_is_checked_at_the_router_and_passed_on(given, status):
    router, sent = router_for(
        {A: lambda r: httpx.Response(200, json={})} | {B: lambda r: httpx.Response(200, json={})},
        key="k",
    )
    headers = {"Authorization": f"Bearer {given}"} if given else {}
    with TestClient(create_app(router)) as client:
        reply = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert reply.status_code == status
    assert len(sent) == (status == 200)
    if sent:
        assert sent[0][1].headers["authorization"] == "Bearer k"


def test_with_no_prefill_up_the_router_says_so():
    router, _ = router_for({})
    router.prefills.read = _down  # every /health unanswered
    with TestClient(create_app(router)) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
        health = client.get("/health")
        assert client.get("/health/live").status_code == 200
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "service_unavailable"
    assert health.status_code == 503 and health.json()["problems"] == ["no prefill is ready"]


async def _down(client, prefill):
    prefill.up = False


def test_a_path_is_passed_on_as_the_client_spelt_it_and_load_is_always_given_back():
    """Percent-escapes stay escaped (decoded, %3F and %2F would mean something else to the
    prefill, and %01 is no URL at all), and a request that fails in any way leaves no load."""
    router, sent = router_for(
        {A: lambda r: httpx.Response(404, json={}), B: lambda r: httpx.Response(404, json={})}
    )
    with TestClient(create_app(router)) as client:
        client.get("/v1/models/a%2Fb%3Fx?q=%01")
        client.get("/%01")
    assert [r.url.raw_path for _, r in sent] == [b"/v1/models/a%2Fb%3Fx?q=%01", b"/%01"]
    assert all(p.in_flight == 0 for p in router.prefills.prefills.values())


def test_a_body_past_the_bounds_gets_an_openai_error_not_a_plain_500():
    router, sent = router_for(
        {A: lambda r: httpx.Response(200, json={}), B: lambda r: httpx.Response(200, json={})}
    )
    with TestClient(create_app(router)) as client:
        reply = client.post(
            "/v1/completions",
            content=b"[" * (1 << 20),
            headers={"content-type": "application/json"},
        )
    assert 400 <= reply.status_code < 500 and "error" in reply.json() and not sent


def test_a_responses_stream_cut_off_ends_with_that_apis_error_event():
    stream = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=CutOff())
    router, _ = router_for({A: lambda r: stream, B: lambda r: stream})
    with TestClient(create_app(router)) as client:
        reply = client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    assert "event: error" in reply.text and "[DONE]" not in reply.text
    (data,) = [line for line in reply.text.splitlines() if line.startswith('data: {"type"')]
    assert json.loads(data[6:])["code"] == "service_unavailable"


def test_a_prefill_that_restarted_is_forgotten_by_the_index():
    """Told apart by the instance id its /health gives: in a container a restart keeps pid 1."""
    instance = ["first"]

    def health(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, json=HEALTHY | {"kv": {"model_key": "00", "instance": instance[0]}}
        )

    router, _ = router_for({})
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(health))

    async def main() -> list[int]:
        held = []
        await router.prefills.poll(router.client)
        router.index.stored(A, [1, 2])
        await router.prefills.poll(router.client)  # the same process: what it holds is kept
        held.append(router.index.held(A))
        instance[0] = "second"  # restarted (same address, same pid)
        await router.prefills.poll(router.client)
        held.append(router.index.held(A))
        return held

    assert asyncio.run(main()) == [2, 0]
