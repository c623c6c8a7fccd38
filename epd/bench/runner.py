"""Run a benchmark: warm up, send the requests closed-loop, all at once or as Poisson arrivals,
summarise, and save the run where asked."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import re
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from epd.bench.client import Timing, stream
from epd.bench.config import BenchConfig
from epd.bench.metrics import Summary, summarise, table
from epd.bench.sharegpt import Sample, read
from epd.bench.workload import bodies, conversations


async def served_model(client: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with client.get(f"{base_url}/models", raise_for_status=True) as response:
            return str((await response.json(content_type=None))["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ValueError(f"cannot list {base_url}/models ({e}): name the model with --model") from e


async def converse(
    client: aiohttp.ClientSession,
    url: str,
    turns: list[dict[str, Any]],
    origin: float,
    limit_s: float,
    bar: tqdm,
) -> list[Timing]:
    """A conversation's requests, each sent once the one before has ended."""
    timings = []
    for turn, body in enumerate(turns):
        timing = await stream(client, url, body, origin, limit_s)
        timing.turn = turn
        timings.append(timing)
        bar.update()
    return timings


async def closed_loop(
    client: aiohttp.ClientSession,
    url: str,
    requests: list[list[dict[str, Any]]],
    workers: int,
    limit_s: float,
    bar: tqdm,
) -> list[Timing]:
    """`workers` clients, each starting its next conversation as soon as its last one ends."""
    origin, queue, timings = time.perf_counter(), list(reversed(requests)), []

    async def worker() -> None:
        while queue:
            timings.extend(await converse(client, url, queue.pop(), origin, limit_s, bar))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return timings


async def poisson(
    client: aiohttp.ClientSession,
    url: str,
    requests: list[list[dict[str, Any]]],
    config: BenchConfig,
    bar: tqdm,
) -> list[Timing]:
    """Conversations arriving at `config.rate` a second on average (inf: all at once), at most
    `concurrency` at once."""
    origin, gaps = time.perf_counter(), random.Random(config.seed)
    limit = asyncio.Semaphore(config.concurrency or len(requests))

    async def one(turns: list[dict[str, Any]]) -> list[Timing]:
        async with limit:
            return await converse(client, url, turns, origin, config.timeout_s, bar)

    tasks = []
    for turns in requests:
        tasks.append(asyncio.create_task(one(turns)))
        if math.isfinite(config.rate):
            await asyncio.sleep(gaps.expovariate(config.rate))
    return [timing for done in await asyncio.gather(*tasks) for timing in done]


def session(config: BenchConfig) -> aiohttp.ClientSession:
    """The run's client (made in its event loop)."""
    # Each request's whole time is bounded by `stream`; here connecting and each read.
    timeout = aiohttp.ClientTimeout(sock_connect=30.0, sock_read=config.timeout_s)
    # The key from the flag, else the environment's, as vLLM's benchmark and OpenAI's clients
    # read it (a command line's flags are visible to anyone on the machine).
    key = config.api_key or os.environ.get("OPENAI_API_KEY", "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # A connection per request in flight, up to 100 where nothing bounds them (httpx's cap),
    # except all at once: every request then (0: no cap), or the server sees fewer than vLLM's.
    everyone = 0 if math.isinf(config.rate) else 100
    connector = aiohttp.TCPConnector(limit=config.concurrency or everyone)
    return aiohttp.ClientSession(
        timeout=timeout, headers=headers, connector=connector, trust_env=True
    )


async def run(config: BenchConfig) -> tuple[Summary, list[Timing], str]:
    async with session(config) as client:
        model = config.model or await served_model(client, config.api_base)
        url, samples = config.request_url, dataset(config)
        if config.warmup:
            warm = bodies(config, model, config.warmup, config.requests, samples)
            await asyncio.gather(
                *(stream(client, url, b, time.perf_counter(), config.timeout_s) for b in warm)
            )
        requests = conversations(config, model, config.requests, samples=samples)
        before = await routed(client, config.api_base)
        cpu_s = time.process_time()
        with tqdm(total=config.requests, desc="requests", unit="req") as bar:
            if config.rate:
                timings = await poisson(client, url, requests, config, bar)
            else:
                workers = config.concurrency or 1
                timings = await closed_loop(client, url, requests, workers, config.timeout_s, bar)
        cpu_s = time.process_time() - cpu_s
        after = await routed(client, config.api_base)
    summary = summarise(timings, config.goodput_ttft_ms, config.goodput_tpot_ms)
    sent = {p: n - before.get(p, 0.0) for p, n in after.items()}
    total = sum(sent.values())
    shares = {p: n / total for p, n in sorted(sent.items())} if total else {}
    return dataclasses.replace(summary, client_cpu_s=cpu_s, prefill_share=shares), timings, model


ROUTED = re.compile(r"^epd:router_requests_total\{([^}]*)\} (\S+)$", re.M)


async def routed(client: aiohttp.ClientSession, api_base: str) -> dict[str, float]:
    """Requests a router (`epd route`) has sent each prefill, from its /metrics beside the API;
    nothing where the server is no router."""
    root = api_base.removesuffix("/v1")
    try:
        async with client.get(f"{root}/metrics") as response:
            text = await response.text() if response.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return {}
    counts: dict[str, float] = {}
    for labels, value in ROUTED.findall(text):
        prefill = re.search(r'prefill="([^"]*)"', labels)
        if prefill:
            counts[prefill[1]] = counts.get(prefill[1], 0.0) + float(value)
    return counts


def dataset(config: BenchConfig) -> Sequence[Sample]:
    """The ShareGPT samples the requests take their text from (none: random words)."""
    if config.dataset != "sharegpt":
        return ()
    return read(config.dataset_path, config.seed, config.sharegpt_output_tokens)


def result_path(config: BenchConfig, model: str) -> Path | None:
    """Where the run is saved: --json, or with --save-result a name that says what ran and
    when (as vLLM's: label, load, model, time), in --result-dir."""
    if not (config.json or config.save_result):
        return None
    name = config.json or "-".join(
        [config.label or "epd", load_name(config), model, f"{datetime.now():%Y%m%d-%H%M%S}"]
    )
    if not config.json:  # a model's name may hold a / or worse: keep to one plain file name
        name = re.sub(r"[^\w.-]+", "_", name) + ".json"
    return Path(config.result_dir or ".") / name


def load_name(config: BenchConfig) -> str:
    rate = "inf" if math.isinf(config.rate) else f"{config.rate:g}"
    most = f"-c{config.concurrency}" if config.concurrency else ""
    return f"{rate}qps{most}" if config.rate else f"c{config.concurrency or 1}"


def save(
    path: Path, config: BenchConfig, model: str, summary: Summary, timings: list[Timing]
) -> None:
    settings = dataclasses.asdict(config) | {"endpoint": config.route, "api_key": ""}
    if math.isinf(config.rate):
        settings["rate"] = "inf"  # as vLLM writes it: JSON has no infinity
    record = {
        "config": settings,
        "model": model,
        "label": config.label or model,
        "summary": dataclasses.asdict(summary),
        "requests": [dataclasses.asdict(t) for t in timings],
    }
    path.write_text(json.dumps(record, indent=1))


def describe_load(config: BenchConfig) -> str:
    most = f", at most {config.concurrency} at once" if config.concurrency else ""
    if math.isinf(config.rate):
        return f"all at once{most}"
    if config.rate:
        return f"rate {config.rate}/s{most}"
    return f"concurrency {config.concurrency or 1}"


def main(config: BenchConfig) -> Summary:
    summary, timings, model = asyncio.run(run(config))
    print(f"epd bench: {config.request_url} ({model}), {describe_load(config)}")
    print(table(summary))
    errors = sorted({t.error for t in timings if t.error})
    for error in errors[:5]:
        print(f"  failed: {error}")
    path = result_path(config, model)
    if path is not None:
        save(path, config, model, summary, timings)
        print(f"wrote {path}")
    return summary
