"""Prompts that wait for prefill together run together, packed into one forward.

One model, one queue: the batcher takes the prompts waiting in arrival order up to a token
budget and prefills them in one call on the engine's thread, so a burst of requests costs one
large forward instead of many small ones. The budget is filled exactly: a prompt that does not
fit whole runs in chunks, the first one filling the rest of this forward, the next ones heading
the following forwards (as vLLM and SGLang schedule a chunked prompt). So a forward takes at
most the budget's new tokens whatever a prompt's length (its attention still reads the prompt's
past), and forwards stay short enough that hand-offs reach decode as a stream, not in waves.
With `min_chunk` set, prompts that fit whole may also pass a chunked one, into what of each
forward its chunk does not need, so one long prompt does not hold every request behind it for
all of its chunks (a trade: the long prompt itself takes longer).

A request whose caller has gone is skipped (its chunks so far dropped); at most
`max_waiting_tokens` prompt tokens may wait, and a request beyond that is refused at once (503)
rather than queued without end. When the batcher stops, for any reason, every request still waiting
fails; `end_all` fails every request it holds at once (the forward under way runs on, for nobody).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from epd.generation.status import Status
from epd.prefill.engine import Chunk, Partial, Prefilled, PrefillEngine, Prompt
from epd.prefill.errors import Unavailable
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.prefix_cache import PrefixCache
from epd.runtime.process import use_torch_threads

log = logging.getLogger(__name__)
WAITING_TOKENS = 32768  # prompt tokens that may wait, at least: 8 forwards at the GPU budget
# Tokens per forward unless configured. On a CPU a short forward (two 240-token prompts): long
# forwards make decode wait for whole waves of requests (docs/benchmarks.md, "Prefill's token
# budget on a CPU, 512"). The GPU figure is the earlier default, unmeasured.
CPU_BUDGET, GPU_BUDGET = 512, 4096


def stored(done: Future[None]) -> None:
    """A store into the prefix cache that failed is logged: the cache is only a help."""
    if (error := done.exception()) is not None:
        log.warning(
            "keeping a prompt in the prefix cache failed: %s: %s", type(error).__name__, error
        )


def token_budget(configured: int, device: torch.device) -> int:
    return configured or (GPU_BUDGET if device.type == "cuda" else CPU_BUDGET)


@dataclass(eq=False)
class Job:
    prompt: Prompt
    future: asyncio.Future[Prefilled]
    queued_at: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when its first chunk's forward began
    done: int = 0  # num_computed_tokens: prompt tokens prefilled so far, or found cached
    cached: int = 0  # of those, found cached: what its reply's usage reports
    past: Partial | None = None  # their cache

    @property
    def left(self) -> int:
        return len(self.prompt.prompt_ids) - self.done


class PrefillBatcher:
    def __init__(
        self,
        engine: PrefillEngine,
        max_tokens: int,
        reply_to: str,
        metrics: PrefillMetrics | None = None,
        max_waiting_tokens: int = 0,
        progressed: Callable[[], None] = lambda: None,
        min_chunk: int = 0,
        threads: int = 0,
        busy_threads: int = 0,
        others_running: Callable[[], bool] = lambda: False,
        prefix_cache: PrefixCache | None = None,
        moved: Callable[[str, Status], None] = lambda request_id, status: None,
    ) -> None:
        self.engine, self.max_tokens, self.reply_to = engine, max_tokens, reply_to
        self.prefix_cache = prefix_cache  # None: every prompt prefilled from its start
        self.moved = moved  # told as a request's forward starts, and as its chunk ends
        # torch threads for a forward (0: leave them as they are), and while other requests
        # run (0: the same), at most as many
        self.threads = threads
        self.busy_threads = min(busy_threads, threads) if threads else 0
        self.others_running = others_running
        self.min_chunk = min_chunk  # 0: nothing passes a chunked prompt
        # Called as each forward ends: under steady load the batcher is never idle, and only
        # this tells the watchdog that it is alive (it once took back-to-back forwards for a hang).
        self.progressed = progressed
        # Not 8 budgets when the budget is small: 32 streams of 240 tokens would be refused.
        self.max_waiting_tokens = max_waiting_tokens or max(WAITING_TOKENS, 8 * max_tokens)
        self.metrics = metrics or PrefillMetrics(model_name="")  # counted for nobody
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="prefill")  # one model
        self.waiting: deque[Job] = deque()
        self.arrived = asyncio.Event()
        self.busy = False  # a forward is running
        self.forward: list[Job] = []  # the jobs it runs
        self.sizes: deque[int] = deque(maxlen=1000)  # prompts per forward, for /health
        self.ended: Exception | None = None  # set by `end_all`: the error of every prompt

    async def prefill(self, prompt: Prompt) -> Prefilled:
        """The prompt's first tokens and hand-off, once a forward has taken it; Unavailable if
        too many wait."""
        waiting = sum(job.left for job in self.waiting)
        if waiting >= self.max_waiting_tokens:
            raise Unavailable(f"prefill is full: {waiting} prompt tokens are waiting")
        loop = asyncio.get_running_loop()
        job = Job(prompt, loop.create_future())
        if self.prefix_cache is not None and prompt.cacheable and self.ended is None:
            # On the engine's thread, as every use of the cache: a hit's rows are copied (at
            # Kimi-VL's widths 62 KB a token), which would hold up every stream on the loop.
            await loop.run_in_executor(self.executor, self.begin_cached, job)
        if self.ended is not None:
            raise self.ended
        self.waiting.append(job)
        self.arrived.set()
        return replace(await job.future, cached_tokens=job.cached)

    def begin_cached(self, job: Job) -> None:
        """Start a job from its prompt's longest cached prefix, if there is one."""
        assert self.prefix_cache is not None
        prompt = job.prompt
        cached = self.prefix_cache.lookup(
            prompt.prompt_ids, prompt.image_spans or (), prompt.cache_salt
        )
        self.metrics.prefix_cache_queries.inc(len(prompt.prompt_ids))
        if cached is not None:
            job.done, job.cached, job.past = cached.length, cached.length, Partial(cached)
            self.metrics.prefix_cache_hits.inc(cached.length)

    def keep(self, job: Job, prefilled: Prefilled) -> None:
        """Store a prefilled prompt's blocks in the prefix cache, from its hand-off (which holds
        its whole cache) or, where its first tokens ended it, its forward's rows, on the
        engine's thread before its next forward."""
        prompt, rows, cache = job.prompt, prefilled.rows(), self.prefix_cache
        if cache is None or not prompt.cacheable or rows is None:
            return
        ids, spans, salt = prompt.prompt_ids, prompt.image_spans or (), prompt.cache_salt
        with contextlib.suppress(RuntimeError):  # the batcher has stopped: nothing more is kept
            self.executor.submit(cache.store, ids, spans, rows, salt).add_done_callback(stored)

    async def run(self) -> None:
        """Prefill whatever waits, batch after batch, until cancelled."""
        try:
            while True:
                await self.arrived.wait()
                self.arrived.clear()
                while batch := self.take():
                    await self.prefill_batch(batch)
        finally:
            for job in [*self.forward, *self.waiting]:  # in the forward it left, or waiting
                if not job.future.done():
                    job.future.set_exception(Unavailable("prefill stopped before this request"))
            self.waiting.clear()

    def end_all(self, error: Exception) -> None:
        """Fail every prompt now with `error`, those to come too: the process stops. A prompt
        in the forward under way fails at once as well; the forward runs on (it cannot be
        interrupted) and its results are dropped."""
        self.ended = error
        for job in [*self.forward, *self.waiting]:
            if not job.future.done():
                job.future.set_exception(error)

    def forward_threads(self) -> int:
        """Fewer threads for the forward that runs `self.forward` while other prompts wait for
        prefill or `others_running()` (other requests in flight). Where prefill shares its
        cores with decode, the API and its clients, its threads and theirs would otherwise
        outnumber the cores, and each waits on another's at every op (docs/benchmarks.md,
        "Prefill's threads")."""
        if not self.busy_threads:
            return self.threads
        inside = set(self.forward)  # a chunked prompt stays waiting while its chunks run
        if self.others_running() or any(job not in inside for job in self.waiting):
            return self.busy_threads
        return self.threads

    def run_chunks(
        self, threads: int, chunks: list[Chunk]
    ) -> list[Prefilled | Partial | Exception]:
        """On the engine's thread: the forward, on `threads` torch threads (OpenMP counts them
        per thread, so they are set here)."""
        use_torch_threads(threads)
        results = self.engine.run_chunks(chunks, self.reply_to)
        short = [i for i, r in enumerate(results) if isinstance(r, torch.OutOfMemoryError)]
        if short and self.prefix_cache is not None and self.prefix_cache.nbytes:
            # The cache's blocks are only a help: the memory goes to the prompts, which run again.
            freed = self.prefix_cache.clear()
            log.warning("out of memory in a forward: emptied the prefix cache (%d bytes)", freed)
            again = self.engine.run_chunks([chunks[i] for i in short], self.reply_to)
            for i, result in zip(short, again, strict=True):
                results[i] = result
        return results

    async def prefill_batch(self, batch: list[tuple[Job, Chunk]]) -> None:
        self.sizes.append(len(batch))
        started = time.perf_counter()
        for job, _ in batch:
            if not job.started:  # its first chunk: the wait ends
                job.started = started
                self.metrics.queue_time.observe(started - job.queued_at)
        self.busy, self.forward = True, [job for job, _ in batch]
        for job in self.forward:
            self.moved(job.prompt.request_id, Status.RUNNING)
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.run_chunks, self.forward_threads(), [c for _, c in batch]
            )
        except Exception as e:  # not one prompt's fault: all of them fail
            results = [e] * len(batch)
        finally:
            self.busy = False
            self.progressed()
        self.forward = []  # kept when cancelled, so that run() fails them
        for (job, chunk), result in zip(batch, results, strict=True):
            if isinstance(result, Partial):  # more chunks to come: it stays first in line
                job.done, job.past = chunk.stop, result
                self.moved(job.prompt.request_id, Status.WAITING)
                continue
            if self.waiting and self.waiting[0] is job:  # a chunked prompt whose chunk failed
                self.waiting.popleft()
            if job.future.done():  # its caller left meanwhile
                continue
            if isinstance(result, Exception):
                job.future.set_exception(result)
            else:
                self.metrics.prompt_tokens.inc(len(job.prompt.prompt_ids))
                self.metrics.prefill_time.observe(time.perf_counter() - job.started)
                job.future.set_result(result)
                self.keep(job, result)

    def take(self) -> list[tuple[Job, Chunk]]:
        """Chunks of the waiting jobs, oldest first, filling the token budget.

        The first job that does not fit whole gives a chunk of the room left and stays first in
        line. With `min_chunk`, jobs behind it that fit whole may pass it into that room while
        its chunk keeps at least `min_chunk` tokens (vLLM's partial-prefill limits serve the
        same end); without, they wait for its last chunk (first come, first served)."""
        batch: list[tuple[Job, Chunk]] = []
        room, owed = self.max_tokens, 0
        chunked: Job | None = None  # the first job that does not fit whole
        for job in self.waiting:
            if room == owed:
                break
            if job.future.done():
                continue
            if job.left <= room - owed:
                batch.append((job, Chunk(job.prompt, job.done, job.done + job.left, job.past)))
                room -= job.left
            elif chunked is None:
                chunked, owed = job, min(room, self.min_chunk or room)
            else:  # only the chunked prompt is passed: the others keep their order
                break
        taken = {job for job, _ in batch}
        self.waiting = deque(j for j in self.waiting if j not in taken and not j.future.done())
        if chunked is not None:
            batch.append(
                (chunked, Chunk(chunked.prompt, chunked.done, chunked.done + room, chunked.past))
            )
        return batch

    def status(self) -> dict[str, object]:
        sizes = list(self.sizes)
        mean = sum(sizes) / len(sizes) if sizes else 0.0
        waiting = sum(not job.future.done() for job in self.waiting)
        cache = self.prefix_cache.status() if self.prefix_cache is not None else {}
        return {"prefill": {"waiting": waiting, "mean_batch": round(mean, 2)}} | cache

    def close(self) -> None:
        self.executor.shutdown(wait=True)
