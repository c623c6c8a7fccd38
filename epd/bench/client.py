"""One streamed request (chat or legacy completions), timed: when it started, when each token
arrived, what it cost.

aiohttp, as vLLM's and SGLang's benchmarks use: the client shares the machine's cores with the
server it times, and it reads a stream for less CPU than httpx (docs/benchmarks.md, "`epd
bench` reads its streams with aiohttp").
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError


@dataclass
class Timing:
    """One request, times in seconds from the run's start."""

    start: float
    first_token: float | None = None
    end: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with content
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    turn: int = 0  # of its conversation, from 0
    cached_tokens: int = 0  # of the prompt's, served from the prefix cache (its usage says)

    @property
    def ok(self) -> bool:
        return not self.error and self.first_token is not None and self.end is not None


async def stream(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], origin: float, limit_s: float
) -> Timing:
    """POST a streaming request and time its chunks; errors are recorded, not raised.

    `limit_s` bounds the whole request, however slowly its chunks come.
    """
    timing = Timing(time.perf_counter() - origin)
    try:
        async with asyncio.timeout(limit_s):
            await receive(client, url, body, origin, timing)
    # First: aiohttp's own timeouts (connecting, reading) are TimeoutErrors too. A line past
    # the read buffer is an HttpProcessingError; a line that is not JSON a ValueError.
    except (aiohttp.ClientError, HttpProcessingError, ValueError) as e:
        timing.error = f"{type(e).__name__}: {e}"
    except TimeoutError:
        timing.error = f"no answer within {limit_s}s"
    if timing.error:
        return timing
    timing.end = time.perf_counter() - origin
    if timing.first_token is None:
        timing.error = "the stream held no content"
    if not timing.output_tokens:  # no usage chunk: count the chunks
        timing.output_tokens = len(timing.chunks)
    return timing


async def receive(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], origin: float, timing: Timing
) -> None:
    async with client.post(url, json=body) as response:
        if response.status != 200:
            text = (await response.read()).decode(errors="replace")
            timing.error = f"HTTP {response.status}: {text[:200]}"
            return
        async for line in response.content:  # SSE lines, each up to the read buffer
            read(line.decode(errors="replace"), timing, time.perf_counter() - origin)


def read(line: str, timing: Timing, now: float) -> None:
    """Apply one SSE line to the timing."""
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        return
    chunk = json.loads(data)
    if "error" in chunk:
        error = chunk["error"]
        timing.error = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
    if usage := chunk.get("usage"):
        timing.prompt_tokens = usage.get("prompt_tokens", 0)
        timing.output_tokens = usage.get("completion_tokens", 0)
        timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):  # chat's delta, or legacy completions
            timing.chunks.append(now)
            if timing.first_token is None:
                timing.first_token = now
