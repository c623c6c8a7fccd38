"""Prompts waiting together are prefilled together, each as if alone; a bad one fails alone."""

import asyncio
import threading

import pytest
import torch

from epd.generation.params import SamplingParams
from epd.generation.status import Status
from epd.prefill.batcher import Job, PrefillBatcher
from epd.prefill.engine import Prompt
from epd.prefill.errors import Unavailable
from epd.prefill.request import Request
from tests.prefill.test_prefix_cache import caching_pool, named

PROMPTS = [[5, 17, 42, 99], [7, 300, 12, 64, 128, 3, 250], [31, 77], [9] * 40]


def prompt(i, ids=None, images=None):
    sampling = SamplingParams(4, temperature=0, logprobs=True, top_logprobs=2)
    return Prompt(f"r{i}", ids or PROMPTS[i], images, sampling)


def test_a_packed_batch_gives_each_prompt_what_it_gets_alone(engine):
    together = [result.handoff for result in engine.run_batch([prompt(i) for i in range(4)])]
    for i, handoff in enumerate(together):
        alone = engine.run(f"r{i}", PROMPTS[i], None, prompt(i).sampling).handoff
        assert handoff.first_tokens == alone.first_tokens
        (mine,), (its,) = handoff.first_logprobs, alone.first_logprobs
        assert mine.logprob == pytest.approx(its.logprob, abs=1e-5)
        torch.testing.assert_close(handoff.cache, alone.cache, atol=1e-5, rtol=1e-5)


def test_a_prompt_that_cannot_be_prefilled_fails_alone(engine):
    placeholder = engine.placeholder_id
    bad = prompt(1, ids=[5, placeholder, 6], images=torch.zeros(3, 64))  # 3 rows for 1 slot
    results = engine.run_batch([prompt(0), bad, prompt(2)])
    assert isinstance(results[1], ValueError) and "1 image token slots" in str(results[1])
    assert [r.handoff.request_id for r in (results[0], results[2])] == ["r0", "r2"]


def test_waiting_prompts_fill_the_token_budget_and_a_long_one_runs_in_chunks(engine):
    async def main():
        batcher = PrefillBatcher(engine, max_tokens=16, reply_to="")
        runner = asyncio.create_task(batcher.run())
        results = await asyncio.gather(*(batcher.prefill(prompt(i)) for i in range(4)))
        runner.cancel()
        batcher.close()
        return [result.handoff for result in results], list(batcher.sizes)

    handoffs, sizes = asyncio.run(main())
    assert [h.request_id for h in handoffs] == ["r0", "r1", "r2", "r3"]
    # 4 + 7 + 2 tokens and the 40-token prompt's first 3 fill 16; then 16, 16 and its last 5.
    assert sizes == [4, 1, 1, 1]
    alone = engine.run("r3", PROMPTS[3], None, prompt(3).sampling).handoff
    assert handoffs[3].first_tokens == alone.first_tokens
    assert handoffs[3].first_logprobs[0].logprob == pytest.approx(
        alone.first_logprobs[0].logprob, abs=1e-5
    )
    torch.testing.assert_close(handoffs[3].cache, alone.cache, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "min_chunk, sizes, finished",
    [
        # r1 (7) passes into the 8 the long one's chunk does not need, which takes the other 9;
        # then r0 and r2 (6) beside its 10; its next 16; its last 5.
        (8, [2, 3, 1, 1], [1, 0, 2, 3]),
        # First come, first served: 16, 16, its last 8 beside r1 (7) and r0's first token.
        (0, [1, 1, 3, 2], [3, 1, 0, 2]),
    ],
)
def test_short_prompts_pass_a_long_one_only_when_asked(engine, min_chunk, sizes, finished):
    """With min_chunk, a long prompt's chunks do not hold the prompts behind it to its last."""
    order = []

    async def main():
        batcher = PrefillBatcher(engine, max_tokens=16, reply_to="", min_chunk=min_chunk)
        runner = asyncio.create_task(batcher.run())

        async def ask(i):
            handoff = (await batcher.prefill(prompt(i))).handoff
            order.append(i)
            return handoff

        handoffs = await asyncio.gather(*(ask(i) for i in (3, 1, 0, 2)))  # 40, 7, 4, 2 tokens
        runner.cancel()
        batcher.close()
        return handoffs, list(batcher.sizes)

    handoffs, forwards = asyncio.run(main())
    assert forwards == sizes and order == finished
    for handoff, i in zip(handoffs, (3, 1, 0, 2), strict=True):
        alone = engine.run(f"r{i}", PROMPTS[i], None, prompt(i).sampling).handoff
        assert handoff.first_tokens == alone.first_tokens
        torch.testing.assert_close(handoff.cache, alone.cache, atol=1e-5, rtol=1e-5)


def test_only_the_chunked_prompt_is_passed_the_others_keep_their_order(engine):
    """A prompt too large to pass the chunked one is not overtaken by a younger small one."""
    order = []

    async def main():
        batcher = PrefillBatcher(engine, max_tokens=16, reply_to="", min_chunk=8)
        runner = asyncio.create_task(batcher.run())

        async def ask(i, ids):
            await batcher.prefill(prompt(i, ids=ids))
            order.append(i)

        long, medium, small = [9] * 40, list(range(5, 15)), [31, 77]  # 40, 10 and 2 tokens
        await asyncio.gather(ask(0, long), ask(1, medium), ask(2, small))
        runner.cancel()
        batcher.close()
        return list(batcher.sizes)

    # 16 and 16 of the long one (the medium one does not fit the 8 it may pass into, so the
    # small one waits too); its last 8 beside the medium one's first 8; the rest of both.
    assert asyncio.run(main()) == [1, 1, 2, 2]
    assert order == [0, 1, 2]


def test_chunks_of_a_prompt_with_images_give_what_it_gets_whole(engine):
    """Chunk boundaries fall inside the image's slots: each chunk takes its own rows."""
    placeholder, hidden = engine.placeholder_id, engine.lm.config.hidden_size
    ids = [5, 17, *[placeholder] * 6, 42, 99, *[placeholder] * 3, 7]
    images = torch.randn(9, hidden, generator=torch.Generator().manual_seed(0))
    whole = engine.run("r", ids, images, prompt(0).sampling).handoff

    beats = []

    async def main():
        batcher = PrefillBatcher(engine, 4, "", progressed=lambda: beats.append(1))
        runner = asyncio.create_task(batcher.run())
        handoff = (await batcher.prefill(prompt(0, ids=ids, images=images))).handoff
        runner.cancel()
        batcher.close()
        return handoff, list(batcher.sizes)

    chunked, sizes = asyncio.run(main())
    assert sizes == [1, 1, 1, 1]  # 14 tokens in chunks of 4, 4, 4 and 2
    assert len(beats) == 4  # back to back, never idle: each forward's end tells the watchdog
    assert chunked.first_tokens == whole.first_tokens
    torch.testing.assert_close(chunked.cache, whole.cache, atol=1e-5, rtol=1e-5)


class Gate:
    """An engine whose forwards wait until the test lets them go, so a test can act during one."""

    def __init__(self, engine):
        self.started, self.go = threading.Event(), threading.Event()
        self.engine = engine

    def run_chunks(self, chunks, reply_to):
        self.started.set()
        self.go.wait(10)
        return self.engine.run_chunks(chunks, reply_to)

    def batcher(self):
        """A running batcher of 16-token forwards on this engine, and its task."""
        batcher = PrefillBatcher(self.engine, max_tokens=16, reply_to="")
        batcher.engine = self
        return batcher, asyncio.create_task(batcher.run())

    async def entered(self):
        await asyncio.to_thread(self.started.wait, 10)


def test_a_chunked_prompt_whose_caller_left_is_dropped_between_chunks(engine):
    gate = Gate(engine)

    async def main():
        batcher, runner = gate.batcher()
        long = asyncio.ensure_future(batcher.prefill(prompt(3)))  # 40 tokens: 3 forwards
        await gate.entered()  # its first chunk's forward is under way
        long.cancel()  # its client goes away during it
        after = asyncio.ensure_future(batcher.prefill(prompt(0)))
        await asyncio.sleep(0)
        gate.go.set()
        after = (await after).handoff
        runner.cancel()
        batcher.close()
        return after, list(batcher.sizes), len(batcher.waiting)

    after, sizes, waiting = asyncio.run(main())
    assert after.request_id == "r0" and waiting == 0
    assert sizes == [1, 1]  # the long prompt's first chunk, then r0 alone: no more chunks


def test_a_request_whose_caller_left_is_skipped_and_a_stop_fails_the_rest(engine):
    async def main():
        batcher = PrefillBatcher(engine, max_tokens=16, reply_to="")
        left = asyncio.ensure_future(batcher.prefill(prompt(0)))
        waiting = asyncio.ensure_future(batcher.prefill(prompt(1)))
        await asyncio.sleep(0)
        left.cancel()  # its client went away before the batcher ran
        runner = asyncio.create_task(batcher.run())
        first = (await waiting).handoff
        stuck = asyncio.ensure_future(batcher.prefill(prompt(2)))
        runner.cancel()  # the coordinator stops with a request still waiting
        await asyncio.gather(runner, return_exceptions=True)
        batcher.close()
        return first, stuck, list(batcher.sizes)

    first, stuck, sizes = asyncio.run(main())
    assert first.request_id == "r1" and sizes[0] == 1  # r0 was not prefilled
    assert isinstance(stuck.exception(), Unavailable)


def test_a_forward_that_raises_fails_its_whole_batch_and_a_full_queue_refuses(engine):
    async def main():
        batcher = PrefillBatcher(engine, max_tokens=4, reply_to="")

        def broken(chunks, reply_to):
            raise RuntimeError("device lost")

        batcher.engine = type("Broken", (), {"run_chunks": staticmethod(broken)})()
        runner = asyncio.create_task(batcher.run())
        results = await asyncio.gather(
            *(batcher.prefill(prompt(i)) for i in range(2)), return_exceptions=True
        )
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        full = PrefillBatcher(engine, max_tokens=4, reply_to="", max_waiting_tokens=40)
        future = asyncio.get_running_loop().create_future()
        full.waiting.append(Job(prompt(3), Request("r3"), future))  # 40 tokens
        refused = await asyncio.gather(full.prefill(prompt(0)), return_exceptions=True)
        batcher.close(), full.close()
        return results, refused

    results, refused = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "device lost" in str(r) for r in results)
    assert isinstance(refused[0], Unavailable) and "prefill is full" in str(refused[0])


def test_a_stop_during_a_forward_fails_the_prompts_in_it(engine):
    gate = Gate(engine)

    async def main():
        batcher, runner = gate.batcher()
        inside = asyncio.ensure_future(batcher.prefill(prompt(0)))
        await gate.entered()
        runner.cancel()  # the coordinator stops while r0's forward runs
        await asyncio.gather(runner, return_exceptions=True)
        gate.go.set()
        batcher.close()
        return await asyncio.wait_for(asyncio.gather(inside, return_exceptions=True), 10)

    (result,) = asyncio.run(main())
    assert isinstance(result, Unavailable)  # answered, not left waiting for ever


def recording_threads(batcher, engine, seen):
    """The batcher's engine, noting the torch threads each forward runs on (its thread's)."""

    def recording(chunks, reply_to):
        seen.append(torch.get_num_threads())
        return engine.run_chunks(chunks, reply_to)

    batcher.engine = type("Recording", (), {"run_chunks": staticmethod(recording)})()


def put_back_threads(*batchers):
    """New threads start from the count set last, by any thread: the test's own, again."""
    for batcher in batchers:
        batcher.executor.submit(torch.set_num_threads, torch.get_num_threads()).result()
        batcher.close()


def test_a_forward_runs_on_fewer_threads_while_other_requests_run(engine):
    """threads 2, busy 1: a forward on 2 torch threads while nothing else runs, on 1 while
    other requests decode or encode; no threads given leaves the engine thread's count alone."""
    others, seen = [False], []

    async def main():
        batcher = PrefillBatcher(
            engine, 16, "", threads=2, busy_threads=1, others_running=lambda: others[0]
        )
        plain = PrefillBatcher(engine, 16, "")
        for b in (batcher, plain):
            recording_threads(b, engine, seen)
        runners = [asyncio.create_task(b.run()) for b in (batcher, plain)]
        for running in (False, True, False):
            others[0] = running
            await batcher.prefill(prompt(0))
        plain.executor.submit(torch.set_num_threads, 3).result()
        await plain.prefill(prompt(0))
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        put_back_threads(batcher, plain)

    main_threads = torch.get_num_threads()
    asyncio.run(main())
    assert seen == [2, 1, 2, 3]
    assert torch.get_num_threads() == main_threads  # the caller's thread keeps its own


@pytest.mark.parametrize(("behind", "threads"), [(False, [2, 2, 2]), (True, [1, 1, 2])])
def test_prompts_waiting_behind_a_forward_make_it_run_on_fewer_threads(engine, behind, threads):
    """A 40-token prompt in chunks of 16, 16 and 8 runs alone on all threads; with a 4-token
    prompt waiting behind it, on fewer, until the last chunk takes that one along."""
    seen = []

    async def main():
        batcher = PrefillBatcher(engine, 16, "", threads=2, busy_threads=1)
        recording_threads(batcher, engine, seen)
        runner = asyncio.create_task(batcher.run())
        await asyncio.gather(*(batcher.prefill(prompt(i)) for i in ((3, 0) if behind else (3,))))
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        put_back_threads(batcher)
        return list(batcher.sizes)

    sizes = asyncio.run(main())
    assert seen == threads and sizes == ([1, 1, 1] if not behind else [1, 1, 2])


def test_each_prompt_says_how_many_of_its_tokens_the_prefix_cache_gave(engine):
    """What the reply's usage reports as cached_tokens: an earlier prompt's whole blocks that
    begin it, never its last token (it must be computed), 0 on a miss; chunked or not."""
    head = list(range(5, 45))  # 40 tokens: two whole blocks of 16 and 8 more
    asked = [head, [*head, 7, 8], head[:32], [9] * 40]
    kept, engine.kv = engine.kv, caching_pool(engine, 1 << 24)

    async def main():
        batcher = PrefillBatcher(engine, 16, reply_to="")  # 16: in chunks
        runner = asyncio.create_task(batcher.run())
        found = []
        for i, ids in enumerate(asked):
            request = Request(f"r{i}")
            result = await batcher.prefill(named(engine, prompt(i, ids)), request)
            batcher.on_engine(engine.kv.release, result.table)
            found.append(request.cached_tokens)
        runner.cancel()
        batcher.close()
        return found

    try:
        assert asyncio.run(main()) == [0, 32, 16, 0]
    finally:
        engine.kv = kept


def test_ending_fails_the_prompts_in_the_forward_and_waiting_at_once_and_those_to_come(engine):
    """At the drain's end every prompt fails with the error it is given, without waiting for
    the forward under way (it runs on: it cannot be interrupted), and nothing more runs."""
    gate = Gate(engine)
    ended = Unavailable("the server stopped before this request finished")

    async def main():
        batcher, runner = gate.batcher()
        inside = asyncio.ensure_future(batcher.prefill(prompt(3)))  # 40 tokens: 3 forwards
        await gate.entered()
        waiting = asyncio.ensure_future(batcher.prefill(prompt(0)))
        await asyncio.sleep(0)
        batcher.end_all(ended)
        results = await asyncio.wait_for(asyncio.gather(inside, waiting, return_exceptions=True), 5)
        later = await asyncio.gather(batcher.prefill(prompt(1)), return_exceptions=True)
        gate.go.set()
        while batcher.busy:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        batcher.close()
        return [*results, *later], list(batcher.sizes)

    results, sizes = asyncio.run(main())
    assert all(result is ended for result in results)
    assert sizes == [1]  # the forward under way ran; no chunk after it


def test_a_requests_record_follows_its_chunks(engine):
    """The request's one record says where its prompt stands: waiting in the queue; at every
    forward running, with the tokens of its chunks before; all of them computed once prefilled
    (16-token forwards over a 40-token prompt: three chunks)."""
    request, seen = Request("r0"), []

    async def main():
        batcher = PrefillBatcher(engine, 16, reply_to="")

        def recording(chunks, reply_to):
            seen.append((request.status, request.num_computed_tokens))
            return engine.run_chunks(chunks, reply_to)

        batcher.engine = type("Recording", (), {"run_chunks": staticmethod(recording)})()
        runner = asyncio.create_task(batcher.run())
        waiting = asyncio.ensure_future(batcher.prefill(prompt(0, list(range(5, 45))), request))
        await asyncio.sleep(0)
        queued = request.status
        result = await waiting
        batcher.on_engine(engine.kv.release, result.table)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        batcher.close()
        return queued

    assert asyncio.run(main()) is Status.WAITING
    assert seen == [(Status.RUNNING, 0), (Status.RUNNING, 16), (Status.RUNNING, 32)]
    assert request.num_computed_tokens == 40 and request.cached_tokens == 0
