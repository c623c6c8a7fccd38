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
from epd.kv.hashing import BLOCK_TOKENS
from epd.kv.pool import BlockTable
from epd.prefill.engine import Chunk, Partial, Prefilled, PrefillEngine, Prompt
from epd.prefill.errors import Unavailable
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.request import Request
from epd.runtime.process import use_torch_threads

log = logging.getLogger(__name__)
WAITING_TOKENS = 32768  # prompt tokens that may wait, at least: 8 forwards at the GPU budget
# Tokens per forward unless configured. On a CPU a short forward (two 240-token prompts): long
# forwards make decode wait for whole waves of requests (docs/benchmarks.md, "Prefill's token
# budget on a CPU, 512"). The GPU figure is the earlier default, unmeasured.
CPU_BUDGET, GPU_BUDGET = 512, 4096


def released(done: Future[None]) -> None:
    """Letting go of blocks that failed is logged: it should not."""
    if (error := done.exception()) is not None:
        log.error("letting go of a prompt's KV blocks failed: %s: %s", type(error).__name__, error)


def next_block(job: Job) -> bytes | None:
    """The hash of the next block of the job's prompt that the cache could give it (None:
    none: unnamed, or no more it could take from the cache)."""
    index = job.request.num_computed_tokens // BLOCK_TOKENS
    hashes = job.prompt.block_hashes
    # Only blocks before the last token's may come from the cache (`begin_cached`).
    usable = min((len(job.prompt.prompt_ids) - 1) // BLOCK_TOKENS, len(hashes))
    return hashes[index] if index < usable else None


def token_budget(configured: int, device: torch.device) -> int:
    return configured or (GPU_BUDGET if device.type == "cuda" else CPU_BUDGET)


@dataclass(eq=False)
class Job:
    """A prompt's place in the batcher: what its request's record (`status`,
    `num_computed_tokens`) does not say."""

    prompt: Prompt
    request: Request  # the request's record, kept up to date here
    future: asyncio.Future[Prefilled]
    queued_at: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when its first chunk's forward began
    past: Partial | None = None  # the blocks of its `num_computed_tokens`

    @property
    def left(self) -> int:
        return len(self.prompt.prompt_ids) - self.request.num_computed_tokens


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
    ) -> None:
        self.engine, self.max_tokens, self.reply_to = engine, max_tokens, reply_to
        self.kv = engine.kv  # prompts' blocks, and those cached (used on the engine's thread)
        self.queries = self.hits = 0  # prompt tokens looked up in the prefix cache, and found
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

    async def prefill(self, prompt: Prompt, request: Request | None = None) -> Prefilled:
        """The prompt's first tokens and hand-off, once a forward has taken it; Unavailable if
        too many wait. Its request's record (a new one unless given) follows it: waiting or
        running, and its tokens computed or found cached."""
        waiting = sum(job.left for job in self.waiting)
        if waiting >= self.max_waiting_tokens:
            raise Unavailable(f"prefill is full: {waiting} prompt tokens are waiting")
        loop = asyncio.get_running_loop()
        request = request if request is not None else Request(prompt.request_id)
        request.status = Status.WAITING
        # From nothing: a request prefilled again (moved off a dead decoder) starts anew.
        request.num_computed_tokens = request.cached_tokens = 0
        job = Job(prompt, request, loop.create_future())
        if self.kv.caching and prompt.block_hashes and self.ended is None:
            # On the engine's thread, as every use of the pool.
            await loop.run_in_executor(self.executor, self.begin_cached, job)
        if self.ended is not None:
            self.let_go(job)
            raise self.ended
        self.waiting.append(job)
        self.arrived.set()
        return await job.future

    def begin_cached(self, job: Job) -> None:
        """Start a job from its prompt's longest cached prefix of whole blocks, short of its
        last token (whose logits give the first token): those blocks are shared, not copied."""
        prompt = job.prompt
        usable = (len(prompt.prompt_ids) - 1) // BLOCK_TOKENS
        table = self.kv.match(prompt.block_hashes[:usable])
        self.queries += len(prompt.prompt_ids)
        self.metrics.prefix_cache_queries.inc(len(prompt.prompt_ids))
        if not table.length:
            self.kv.release(table)
            return
        job.request.num_computed_tokens = job.request.cached_tokens = table.length
        job.past = Partial(table)
        self.hits += table.length
        self.metrics.prefix_cache_hits.inc(table.length)

    async def take_matched(self) -> list[tuple[Job, Chunk]]:
        """`take`, once the jobs that have not started are matched against the prefix cache
        again (`rematch`)."""
        if self.kv.caching and any(not job.started for job in self.waiting):
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, self.rematch)
            except Exception:  # a missed hit costs a forward; prefill must go on
                log.exception("matching waiting prompts against the prefix cache again failed")
        return self.take()

    def rematch(self) -> None:
        """Jobs yet to start, matched again: a forward since they came may have cached more of
        their prompt (prompts that come together, sharing a system prompt, wait for the first of
        them instead of computing it each; see `take`). On the engine's thread."""
        for job in list(self.waiting):  # a copy: the loop may append meanwhile
            hashes, have = job.prompt.block_hashes, job.request.num_computed_tokens
            usable = min((len(job.prompt.prompt_ids) - 1) // BLOCK_TOKENS, len(hashes))
            if job.started or job.future.done() or have // BLOCK_TOKENS >= usable:
                continue  # under way, gone, or with no more blocks to find (or none named)
            if hashes[have // BLOCK_TOKENS] not in self.kv.blocks.by_hash:  # nothing more
                continue
            table = self.kv.match(hashes[:usable])
            if table.length <= have:
                self.kv.release(table)
                continue
            if job.past is not None:
                self.kv.release(job.past.cache)
            job.past = Partial(table)
            job.request.num_computed_tokens = job.request.cached_tokens = table.length
            self.hits += table.length - have
            self.metrics.prefix_cache_hits.inc(table.length - have)

    def let_go(self, job: Job, result: object = None) -> None:
        """Let go of a job's blocks that nobody will use: its chunks so far, or the prompt's
        whole table where its caller left; on the engine's thread."""
        tables: list[BlockTable] = []
        if isinstance(result, Prefilled) and result.table is not None:
            tables.append(result.table)
        elif job.past is not None:
            tables.append(job.past.cache)
        job.past = None
        for table in tables:
            self.on_engine(self.kv.release, table)

    def on_engine(self, fn: Callable[..., object], *args: object) -> None:
        """fn(*args) on the engine's thread, between forwards, and the KV events it makes
        published; nothing once it has stopped."""

        def then_flush() -> None:
            try:
                fn(*args)
            finally:
                self.kv.flush_events()

        with contextlib.suppress(RuntimeError):  # shut down: the pool goes with the process
            self.executor.submit(then_flush).add_done_callback(released)

    async def run(self) -> None:
        """Prefill whatever waits, batch after batch, until cancelled."""
        try:
            while True:
                await self.arrived.wait()
                self.arrived.clear()
                while batch := await self.take_matched():
                    await self.prefill_batch(batch)
        finally:
            for job in [*self.forward, *self.waiting]:  # in the forward it left, or waiting
                if not job.future.done():
                    job.future.set_exception(Unavailable("prefill stopped before this request"))
                self.let_go(job)
            self.waiting.clear()

    def end_all(self, error: Exception) -> None:
        """Fail every prompt now with `error`, those to come too: the process stops. A prompt
        in the forward under way fails at once as well; the forward runs on (it cannot be
        interrupted) and its results are dropped."""
        self.ended = error
        for job in [*self.forward, *self.waiting]:
            if not job.future.done():
                job.future.set_exception(error)
            if job not in self.forward:  # a forward's own jobs are let go as it ends
                self.let_go(job)

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
        try:
            return self.forward_chunks(chunks)
        finally:
            self.kv.flush_events()  # what the forward cached and evicted, as one batch

    def forward_chunks(self, chunks: list[Chunk]) -> list[Prefilled | Partial | Exception]:
        results = self.engine.run_chunks(chunks, self.reply_to)
        short = [i for i, r in enumerate(results) if isinstance(r, torch.OutOfMemoryError)]
        if short and self.kv.blocks.cached:
            # Cached blocks are only a help: the memory goes to the prompts, which run again.
            freed = self.kv.drop_cached()
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
            job.request.status = Status.RUNNING
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
            if isinstance(result, Partial) and not job.future.done():  # more chunks to come
                job.request.num_computed_tokens, job.past = chunk.stop, result  # first in line
                job.request.status = Status.WAITING
                continue
            if self.waiting and self.waiting[0] is job:  # a chunked prompt that ended early
                self.waiting.popleft()
            if job.future.done() or isinstance(result, Exception):  # caller gone, or failed
                if not job.future.done():
                    job.future.set_exception(result)  # type: ignore[arg-type]
                self.let_go(job, result)
                continue
            assert isinstance(result, Prefilled)
            job.request.num_computed_tokens = len(job.prompt.prompt_ids)
            self.metrics.prompt_tokens.inc(len(job.prompt.prompt_ids))
            self.metrics.prefill_time.observe(time.perf_counter() - job.started)
            job.past = None  # its blocks are the result's now: the caller lets go of them
            if result.handoff is None:  # no decoder will ask for its rows
                self.on_engine(self.kv.release, result.table)
                result = replace(result, table=None)
            job.future.set_result(result)

    def take(self) -> list[tuple[Job, Chunk]]:
        """Chunks of the waiting jobs, oldest first, filling the token budget.

        A job yet to start whose next block another job in the forward computes waits for the
        next forward, where it finds that block cached (`rematch`): prompts that come together
        and share a system prompt compute it once, as vLLM's scheduler shares blocks within a
        step. The first job that does not fit whole gives a chunk of the room left and stays
        first in line. With `min_chunk`, jobs behind it that fit whole may pass it into that
        room while its chunk keeps at least `min_chunk` tokens (vLLM's partial-prefill limits
        serve the same end); without, they wait for its last chunk (first come, first
        served)."""
        batch: list[tuple[Job, Chunk]] = []
        room, owed = self.max_tokens, 0
        chunked: Job | None = None  # the first job that does not fit whole
        computing: set[bytes] = set()  # the blocks the forward computes
        for job in self.waiting:
            if room == owed:
                break
            if job.future.done():
                continue
            if self.kv.caching and not job.started and next_block(job) in computing:
                continue  # another prompt computes its next block: it waits for the cache
            if job.left <= room - owed:
                start = job.request.num_computed_tokens
                batch.append((job, Chunk(job.prompt, start, start + job.left, job.past)))
                room -= job.left
                # Its blocks are cached as this forward ends (a chunked prompt's only at its
                # last chunk: nothing to wait for before).
                computing.update(job.prompt.block_hashes[start // BLOCK_TOKENS :])
            elif chunked is None:
                chunked, owed = job, min(room, self.min_chunk or room)
            else:  # only the chunked prompt is passed: the others keep their order
                break
        taken = {job for job, _ in batch}
        for job in self.waiting:
            if job.future.done() and job not in taken:  # its caller left: its chunks go too
                self.let_go(job)
        self.waiting = deque(j for j in self.waiting if j not in taken and not j.future.done())
        if chunked is not None:
            start = chunked.request.num_computed_tokens
            batch.append((chunked, Chunk(chunked.prompt, start, start + room, chunked.past)))
        return batch

    def status(self) -> dict[str, object]:
        sizes = list(self.sizes)
        mean = sum(sizes) / len(sizes) if sizes else 0.0
        waiting = sum(not job.future.done() for job in self.waiting)
        prefill = {"waiting": waiting, "mean_batch": round(mean, 2)}
        if not self.kv.caching:
            return {"prefill": prefill}
        rate = self.hits / self.queries if self.queries else 0.0
        cache = {
            "cached_tokens": self.kv.blocks.cached * BLOCK_TOKENS,
            "bytes": self.kv.storage.nbytes,
            "hit_rate": round(rate, 4),
        }
        return {"prefill": prefill, "prefix_cache": cache}

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.kv.blocks.events.close()
