"""Prompts that wait for prefill together run together, packed into one forward.

One model, one queue: the batcher takes the prompts waiting in arrival order up to a token
budget (a longer prompt runs alone) and prefills them in one call on the engine's thread, so a
burst of requests costs one large forward instead of many small ones. A request whose caller has
gone is skipped; at most WAITING_BUDGETS budgets of prompt tokens may wait, and a request beyond
that is refused at once (503) rather than queued without end. When the batcher stops, for any
reason, every request still waiting fails.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from epd.prefill.engine import PrefillEngine, Prompt
from epd.prefill.errors import Unavailable
from epd.prefill.metrics import PrefillMetrics
from epd.wire.messages import KVHandoff

WAITING_BUDGETS = 8


@dataclass
class Job:
    prompt: Prompt
    future: asyncio.Future[KVHandoff]
    queued_at: float = field(default_factory=time.perf_counter)


class PrefillBatcher:
    def __init__(
        self,
        engine: PrefillEngine,
        max_tokens: int,
        reply_to: str,
        metrics: PrefillMetrics | None = None,
    ) -> None:
        self.engine, self.max_tokens, self.reply_to = engine, max_tokens, reply_to
        self.metrics = metrics or PrefillMetrics()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="prefill")  # one model
        self.waiting: deque[Job] = deque()
        self.arrived = asyncio.Event()
        self.busy = False  # a forward is running
        self.sizes: deque[int] = deque(maxlen=1000)  # prompts per forward, for /health

    async def prefill(self, prompt: Prompt) -> KVHandoff:
        """The prompt's hand-off, once a forward has taken it; Unavailable if too many wait."""
        waiting = sum(len(job.prompt.prompt_ids) for job in self.waiting)
        if waiting >= WAITING_BUDGETS * self.max_tokens:
            raise Unavailable(f"prefill is full: {waiting} prompt tokens are waiting")
        future: asyncio.Future[KVHandoff] = asyncio.get_running_loop().create_future()
        self.waiting.append(Job(prompt, future))
        self.arrived.set()
        return await future

    async def run(self) -> None:
        """Prefill whatever waits, batch after batch, until cancelled."""
        try:
            while True:
                await self.arrived.wait()
                self.arrived.clear()
                while batch := self.take():
                    await self.prefill_batch(batch)
        finally:
            for job in self.waiting:
                if not job.future.done():
                    job.future.set_exception(Unavailable("prefill stopped before this request"))
            self.waiting.clear()

    async def prefill_batch(self, batch: list[Job]) -> None:
        prompts = [job.prompt for job in batch]
        self.sizes.append(len(batch))
        started = time.perf_counter()
        for job in batch:
            self.metrics.queue_time.observe(started - job.queued_at)
        self.busy = True
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.engine.run_batch, prompts, self.reply_to
            )
        except Exception as e:  # not one prompt's fault: all of them fail
            results = [e] * len(batch)
        finally:
            self.busy = False
        for job, result in zip(batch, results, strict=True):
            if job.future.done():  # its caller left meanwhile
                continue
            if isinstance(result, Exception):
                job.future.set_exception(result)
            else:
                self.metrics.prompt_tokens.inc(result.prompt_tokens)
                job.future.set_result(result)

    def take(self) -> list[Job]:
        """The waiting jobs, oldest first, up to the token budget (at least one)."""
        batch: list[Job] = []
        tokens = 0
        while self.waiting:
            job = self.waiting[0]
            if job.future.done():
                self.waiting.popleft()
                continue
            size = len(job.prompt.prompt_ids)
            if batch and tokens + size > self.max_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += size
        return batch

    def status(self) -> dict[str, object]:
        sizes = list(self.sizes)
        mean = sum(sizes) / len(sizes) if sizes else 0.0
        waiting = sum(not job.future.done() for job in self.waiting)
        return {"prefill": {"waiting": waiting, "mean_batch": round(mean, 2)}}

    def close(self) -> None:
        self.executor.shutdown(wait=True)
