"""How `epd bench` spaces its requests: a closed loop of workers, or Poisson arrivals under an
optional bound on those in flight."""

import asyncio

import pytest
from tqdm import tqdm

from epd.bench import runner
from epd.bench.config import BenchConfig


def most_in_flight(monkeypatch, **settings) -> int:
    """Run 12 requests that each take 20 ms; how many were in flight at once, at most."""
    now, most = 0, 0

    async def stream(client, url, body, origin, limit_s):
        nonlocal now, most
        now += 1
        most = max(most, now)
        await asyncio.sleep(0.02)
        now -= 1

    monkeypatch.setattr(runner, "stream", stream)
    config = BenchConfig(**settings)
    requests = [{}] * 12
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
