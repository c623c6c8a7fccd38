"""How `epd bench` spaces its requests: a closed loop of workers, or Poisson arrivals (or all at
once) under an optional bound on those in flight; a run against a legacy completions server;
where a run is saved."""

import asyncio
import json
import math

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tqdm import tqdm

from epd.bench import runner
from epd.bench.client import Timing
from epd.bench.config import BenchConfig
from epd.bench.metrics import table


def most_in_flight(monkeypatch, **settings) -> int:
    """Run 12 requests that each take 20 ms; how many were in flight at once, at most."""
    now, most = 0, 0

    async def stream(client, url, body, origin, limit_s):
        nonlocal now, most
        now += 1
        most = max(most, now)
        await asyncio.sleep(0.02)
        now -= 1
        return Timing(0.0)

    monkeypatch.setattr(runner, "stream", stream)
    config = BenchConfig(**settings)
    requests = [[{}]] * 12  # conversations of one turn
    with tqdm(disable=True) as bar:
        if config.rate:
            asyncio.run(runner.poisson(None, "", requests, config, bar))
        else:
            asyncio.run(runner.closed_loop(None, "", requests, config.concurrency or 1, 1, bar))
    return most


@pytest.mark.parametrize(
    "settings,most",
    [
        ({}, 1),  # a closed loop of one
        ({"concurrency": 3}, 3),
        ({"rate": 10_000.0}, 12),  # arrivals far faster than requests end: no bound
        ({"rate": 10_000.0, "concurrency": 1}, 1),  # at most one, as asked
        ({"rate": math.inf}, 12),  # all at once
        ({"rate": math.inf, "concurrency": 3}, 3),  # vLLM's --max-concurrency 3
    ],
)
def test_concurrency_bounds_requests_in_flight(monkeypatch, settings, most):
    assert most_in_flight(monkeypatch, **settings) == most


@pytest.mark.parametrize(
    ("settings", "connections"),
    [({}, 100), ({"concurrency": 8}, 8), ({"rate": math.inf}, 0), ({"rate": 2.0}, 100)],
)
def test_connections_cap_what_is_in_flight_except_all_at_once(settings, connections):
    """All at once means every request at the server (0: no cap), as vLLM sends them."""

    async def limit() -> int:
        async with runner.session(BenchConfig(**settings)) as client:
            return client.connector.limit

    assert asyncio.run(limit()) == connections


def test_a_negative_concurrency_is_refused():
    with pytest.raises(ValueError, match="concurrency=-1: must not be negative"):
        BenchConfig(concurrency=-1)


def test_a_run_counts_the_clients_cpu_over_the_timed_requests_only(monkeypatch):
    """A client on the server's machine takes cores from it: the run says how much CPU it took
    over the requests it timed, the warm-up left out."""
    clock = 0.0

    async def stream(client, url, body, origin, limit_s):
        nonlocal clock
        clock += 1.0  # each request costs the client one CPU second
        return Timing(start=0.0, first_token=0.1, end=0.2, chunks=[0.1], output_tokens=1)

    monkeypatch.setattr(runner, "stream", stream)
    monkeypatch.setattr(runner.time, "process_time", lambda: clock)
    config = BenchConfig(model="m", requests=5, warmup=2, concurrency=2)
    summary, timings, _ = asyncio.run(runner.run(config))
    assert summary.completed == len(timings) == 5
    assert summary.client_cpu_s == 5.0
    assert "client CPU (s)" in table(summary)


def test_a_conversations_turns_go_one_after_another(monkeypatch):
    order = []

    async def stream(client, url, body, origin, limit_s):
        order.append(body["n"])
        await asyncio.sleep(0.01 * (3 - body["n"] % 3))  # the first turns take longest
        order.append(-body["n"])
        return Timing(0.0)

    monkeypatch.setattr(runner, "stream", stream)
    talks = [[{"n": 1}, {"n": 2}], [{"n": 4}, {"n": 5}]]
    with tqdm(disable=True) as bar:
        timings = asyncio.run(runner.closed_loop(None, "", talks, 2, 1, bar))
    assert order.index(-1) < order.index(2) and order.index(-4) < order.index(5)
    assert sorted(t.turn for t in timings) == [0, 0, 1, 1]


BODIES = web.AppKey("bodies", list)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "kimi"}]})


async def completions(request: web.Request) -> web.StreamResponse:
    """A legacy completions server: a text chunk per token asked for, and usage."""
    body = await request.json()
    request.app[BODIES].append(body)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(body["max_tokens"]):
        await response.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
    usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": body["max_tokens"]}
    await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def test_sharegpt_prompts_go_to_a_legacy_completions_server_named_by_its_root(tmp_path):
    dataset = tmp_path / "sharegpt.json"
    asked = {f"question {i} , please ?": "an answer of " + "word " * i for i in range(2, 5)}
    talks = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        for q, a in asked.items()
    ]
    dataset.write_text(json.dumps(talks))
    app = web.Application()
    app[BODIES] = []
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)

    async def go():
        async with TestServer(app, host="127.0.0.1") as server:
            config = BenchConfig(
                base_url=str(server.make_url("")),  # vLLM's form: the server, no /v1
                endpoint="/v1/completions",
                dataset="sharegpt",
                dataset_path=str(dataset),
                requests=3,
                warmup=1,
                rate=math.inf,
            )
            return await runner.run(config)

    summary, timings, model = asyncio.run(go())
    assert model == "kimi" and summary.completed == 3 and not summary.failed
    sent = app[BODIES]
    assert len(sent) == 4 and all("messages" not in body for body in sent)
    # Each prompt asks for its reply's length: "an answer of" and its words.
    assert {body["prompt"]: body["max_tokens"] for body in sent} == {
        q: 3 + i for i, q in enumerate(asked, 2)
    }
    assert sorted(t.output_tokens for t in timings) == [5, 6, 7]


def test_a_saved_run_says_inf_for_all_at_once_and_leaves_the_api_key_out(tmp_path, monkeypatch):
    done = Timing(start=0.0, first_token=0.1, end=0.2, chunks=[0.1], output_tokens=1)

    async def run(config):
        return runner.summarise([done], 0.0, 0.0), [done], "org/kimi-vl"

    monkeypatch.setattr(runner, "run", run)
    runner.main(
        BenchConfig(
            rate=math.inf,
            concurrency=4,
            save_result=True,
            result_dir=str(tmp_path),
            api_key="sk-secret",
        )
    )
    (saved,) = tmp_path.iterdir()
    assert saved.name.startswith("epd-infqps-c4-org_kimi-vl-") and saved.suffix == ".json"
    record = json.loads(saved.read_text())
    assert record["config"]["rate"] == "inf" and record["config"]["api_key"] == ""
    assert "sk-secret" not in saved.read_text()
    named = BenchConfig(json="run.json", result_dir=str(tmp_path / "out"))
    assert runner.result_path(named, "m") == tmp_path / "out" / "run.json"
    assert runner.result_path(BenchConfig(), "m") is None  # nothing asked: nothing written


def test_the_api_key_comes_from_the_flag_else_openais_variable(monkeypatch):
    async def authorization(**settings):
        async with runner.session(BenchConfig(model="m", **settings)) as client:
            return client.headers.get("Authorization")

    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    assert asyncio.run(authorization()) == "Bearer sk-env"
    assert asyncio.run(authorization(api_key="sk-flag")) == "Bearer sk-flag"
    monkeypatch.delenv("OPENAI_API_KEY")
    assert asyncio.run(authorization()) is None


def test_a_routers_requests_by_prefill_become_each_prefills_share_of_the_run():
    """The share counts only the run's requests: what the router had sent before is left out."""
    counts = {"a": 5.0, "b": 1.0}

    async def metrics(request: web.Request) -> web.Response:
        lines = [
            f'epd:router_requests_total{{model_name="m",prefill="http://{p}",reason="{r}"}} {n}'
            for p, n in counts.items()
            for r in ("cache_hit", "load")
        ]
        return web.Response(text="# TYPE epd:router_requests_total counter\n" + "\n".join(lines))

    async def go():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with (
            TestServer(app, host="127.0.0.1") as server,
            runner.session(BenchConfig()) as client,
        ):
            before = await runner.routed(client, str(server.make_url("/v1")))
            counts["a"] += 3.0
            after = await runner.routed(client, str(server.make_url("/v1")))
            return before, after

    before, after = asyncio.run(go())
    assert before == {"http://a": 10.0, "http://b": 2.0}  # both reasons summed
    assert after == {"http://a": 16.0, "http://b": 2.0}


def test_without_a_router_there_is_no_share():
    async def go():
        app = web.Application()
        async with (
            TestServer(app, host="127.0.0.1") as server,
            runner.session(BenchConfig()) as client,
        ):
            return await runner.routed(client, str(server.make_url("/v1")))

    assert asyncio.run(go()) == {}
