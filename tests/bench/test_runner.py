"""How `epd bench` spaces its requests: a closed loop of workers, or Poisson arrivals under an
optional bound on those in flight."""

import asyncio

import pytest
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
    ],
)
def test_concurrency_bounds_requests_in_flight(monkeypatch, settings, most):
    assert most_in_flight(monkeypatch, **settings) == most


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
