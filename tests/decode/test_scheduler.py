"""Continuous batching: joins and leaves between steps, each request as if alone."""

import msgspec
import pytest
import torch

from epd.checkpoint.weights import load_model
from epd.decode.scheduler import Busy, Scheduler, TooLarge, default_kv_tokens, kv_memory
from epd.generation.grammar import choice_grammar
from epd.generation.params import SamplingParams
from epd.generation.sampling import advanced
from epd.prefill.engine import Prompt, Resume

PROMPTS = [[5, 17, 42, 99], [7, 300, 12, 64, 128, 3, 250], [31, 77]]


def handoff(engine, i, max_tokens=12, seeded=False):
    sampling = SamplingParams(max_tokens, temperature=0)
    if seeded:  # a distribution wide enough that the draws depend on the seed
        sampling = SamplingParams(max_tokens, temperature=1.5, top_k=50, top_p=0.95, seed=i)
    return engine.run(f"r{i}", PROMPTS[i], None, sampling).handoff


def run_alone(parts, i, max_tokens=12, seeded=False):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    tokens = list(scheduler.add(handoff(engine, i, max_tokens, seeded))[0][1].token_ids)
    while len(scheduler):
        tokens += [t for _, d in scheduler.step().produced for t in d.token_ids]
    return tokens


def test_requests_joining_mid_flight_match_running_alone(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    produced: dict[str, list[int]] = {}

    def record(pairs):
        for sequence, delta in pairs:
            produced.setdefault(sequence.request_id, []).extend(delta.token_ids)

    record(scheduler.add(handoff(engine, 0)))
    record(scheduler.step().produced)
    record(scheduler.step().produced)
    record(scheduler.add(handoff(engine, 1)) + scheduler.add(handoff(engine, 2, max_tokens=3)))
    sizes = []
    while len(scheduler):
        sizes.append(len(scheduler.running) + len(scheduler.waiting))
        record(scheduler.step().produced)
    assert sizes[0] == 3 and sizes[-1] == 1  # the short request left early
    for i in range(3):
        assert produced[f"r{i}"] == run_alone(parts, i, 3 if i == 2 else 12)


def test_abort_frees_the_request(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    scheduler.add(handoff(engine, 0))
    scheduler.add(handoff(engine, 1))
    scheduler.step()
    assert scheduler.abort("r0") and not scheduler.abort("r0")
    assert list(scheduler.running) == [("r1", 0)]
    assert all(s.request_id == "r1" for s, _ in scheduler.step().produced)


def test_batch_size_limit_queues_the_rest(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, max_batch_size=2)
    for i in range(3):
        scheduler.add(handoff(engine, i))
    assert len(scheduler.step().produced) == 2 and len(scheduler.waiting) == 1
    scheduler.abort("r0")
    assert {s.request_id for s, _ in scheduler.step().produced} == {"r1", "r2"}


def test_first_token_can_finish_a_request(parts):
    """Prefill keeps such a request (it has nothing left for decode); one that comes anyway
    ends on arrival."""
    lm, tokenizer, engine, eos = parts
    prefilled = engine.run("r0", PROMPTS[0], None, SamplingParams(1, temperature=0))
    assert prefilled.handoff is None and prefilled.first[0].finish_reason == "length"
    scheduler = Scheduler(lm, tokenizer, eos)
    longer = handoff(engine, 0, max_tokens=2)
    sent = msgspec.structs.replace(longer, sampling=SamplingParams(1, temperature=0))
    ((_, delta),) = scheduler.add(sent)
    assert delta == prefilled.first[0] and len(scheduler) == 0


def poison(scheduler, request_id, rows):
    """Make the batched forward give `request_id`'s row these logits."""
    forward = scheduler._forward

    def poisoned(batch, drafts):
        logits = forward(batch, drafts)  # (1 + drafts, vocab) each
        for i, sequence in enumerate(batch):
            if sequence.request_id == request_id:
                logits[i][:] = rows
        return logits

    scheduler._forward = poisoned


@pytest.mark.parametrize("row", [float("nan"), float("inf")])
def test_a_row_that_cannot_be_sampled_fails_alone(parts, row):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    expected = {i: run_alone(parts, i) for i in (0, 2)}
    produced = {f"r{i}": list(scheduler.add(handoff(engine, i))[0][1].token_ids) for i in range(3)}
    poison(scheduler, "r1", row)
    step = scheduler.step()
    assert [(s.request_id, "not finite" in why) for s, why in step.failed] == [("r1", True)]
    for sequence, delta in step.produced:
        produced[sequence.request_id] += delta.token_ids
    while len(scheduler):
        for sequence, delta in scheduler.step().produced:
            produced[sequence.request_id] += delta.token_ids
    assert produced["r0"] == expected[0] and produced["r2"] == expected[2]


def test_a_failing_batched_forward_fails_only_the_request_that_fails_alone(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    expected = {i: run_alone(parts, i) for i in (0, 2)}
    produced = {f"r{i}": list(scheduler.add(handoff(engine, i))[0][1].token_ids) for i in range(3)}
    forward = scheduler._forward

    def breaks_with_r1(batch, drafts):
        if any(s.request_id == "r1" for s in batch):
            raise RuntimeError("r1's cache broke the kernel")
        return forward(batch, drafts)

    scheduler._forward = breaks_with_r1
    while len(scheduler):
        step = scheduler.step()
        assert all(s.request_id == "r1" and "kernel" in why for s, why in step.failed)
        for sequence, delta in step.produced:
            produced[sequence.request_id] += delta.token_ids
    assert produced["r0"] == expected[0] and produced["r2"] == expected[2]


def test_a_row_that_fails_to_sample_fails_alone_and_seeds_still_hold(parts, monkeypatch):
    """Batched sampling that raises is redone row by row from the generators' earlier states."""
    import epd.decode.scheduler as scheduler_module

    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    expected = {i: run_alone(parts, i, seeded=True) for i in (0, 2)}
    produced = {
        f"r{i}": list(scheduler.add(handoff(engine, i, seeded=True))[0][1].token_ids)
        for i in range(3)
    }
    assert expected[0] != run_alone(parts, 0)  # the seeded draws are not the greedy tokens
    real = scheduler_module.sample_batch
    r1 = next(s.sampling for s in scheduler.sequences() if s.request_id == "r1")

    def fails_with_r1(logits, params, generators):
        tokens = real(logits, params, generators)  # every generator has drawn by now
        if any(p is r1 for p in params):
            raise RuntimeError("r1 broke the sampler")
        return tokens

    monkeypatch.setattr(scheduler_module, "sample_batch", fails_with_r1)
    failed = []
    while len(scheduler):
        step = scheduler.step()
        failed += [(s.request_id, "broke the sampler" in why) for s, why in step.failed]
        for sequence, delta in step.produced:
            produced[sequence.request_id] += delta.token_ids
    assert failed == [("r1", True)]
    assert produced["r0"] == expected[0] and produced["r2"] == expected[2]


def test_hand_offs_past_the_context_or_already_decoding_are_refused(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    room = lm.config.max_position_embeddings - len(PROMPTS[0])
    with pytest.raises(ValueError, match="exceed the context length"):
        scheduler.add(handoff(engine, 0, max_tokens=room + 1))
    scheduler.add(handoff(engine, 0, max_tokens=room))
    with pytest.raises(ValueError, match="already decoding"):
        scheduler.add(handoff(engine, 0))


def test_token_ids_outside_the_vocabulary_are_refused(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    good = handoff(engine, 0)
    vocab = lm.config.vocab_size
    sampling = msgspec.structs.replace(good.sampling, stop_token_ids=(vocab,))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.add(msgspec.structs.replace(good, sampling=sampling))
    ids = good.prompt_ids.clone()
    ids[-1] = vocab
    with pytest.raises(ValueError, match="prompt token id is outside"):
        scheduler.add(msgspec.structs.replace(good, prompt_ids=ids))
    assert len(scheduler) == 0


def test_a_cache_that_overflows_decodes_dtype_is_refused(parts, tiny_checkpoint):
    _, tokenizer, engine, eos = parts  # prefill in float32
    narrow = load_model(tiny_checkpoint, role="language", dtype=torch.float16).language_model
    scheduler = Scheduler(narrow, tokenizer, eos)
    good = handoff(engine, 0)
    cache = good.cache.clone()
    cache[0, 0, 0] = 1e5  # finite in float32, infinite in float16 (largest 65504)
    with pytest.raises(ValueError, match="overflow decode's torch.float16"):
        scheduler.add(msgspec.structs.replace(good, cache=cache))
    assert len(scheduler) == 0
    scheduler.add(good)
    assert len(scheduler) == 1


def test_an_unusable_grammar_is_refused_and_a_good_one_is_followed(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    good = handoff(engine, 0, max_tokens=30)
    bad = msgspec.structs.replace(good.sampling, grammar='{"grammars": [{"lark_grammar": "?"}]}')
    with pytest.raises(ValueError, match="unusable grammar"):
        scheduler.add(msgspec.structs.replace(good, sampling=bad))
    choices = ["circle", "square"]
    sampling = SamplingParams(30, temperature=0, grammar=choice_grammar(choices))
    constrained = engine.run("g", PROMPTS[1], None, sampling).handoff
    scheduler.add(handoff(engine, 2, max_tokens=30))  # a neighbour without a grammar
    ((sequence, _),) = scheduler.add(constrained)
    while sequence.finish_reason is None:
        scheduler.step()
    assert sequence.text in choices and sequence.finish_reason == "stop"


def test_a_failure_after_the_caches_grew_does_not_shift_them(parts):
    """The logits fail once the caches have taken the step's row: the retry must not count it."""
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    expected = {i: run_alone(parts, i) for i in range(2)}
    produced = {f"r{i}": list(scheduler.add(handoff(engine, i))[0][1].token_ids) for i in range(2)}
    logits, failed = lm.logits, []

    def fails_once_batched(hidden):
        if hidden.shape[0] > 1 and not failed:
            failed.append(True)
            raise RuntimeError("out of memory")
        return logits(hidden)

    lm.logits = fails_once_batched
    try:
        while len(scheduler):
            for sequence, delta in scheduler.step().produced:
                produced[sequence.request_id] += delta.token_ids
    finally:
        del lm.logits
    assert failed and produced == {f"r{i}": expected[i] for i in range(2)}


def test_decode_refuses_what_it_has_no_room_to_park(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, max_batch_size=1)
    for i in range(4):
        scheduler.add(
            engine.run(f"w{i}", PROMPTS[0], None, SamplingParams(8, temperature=0)).handoff
        )
    with pytest.raises(Busy, match="decode is full"):
        scheduler.add(handoff(engine, 1))
    # More choices than it has places for at all: no use trying again later.
    many = engine.run(
        "n5", PROMPTS[0], None, SamplingParams(8, temperature=1.0, n=5, seed=0)
    ).handoff
    with pytest.raises(TooLarge, match="n=5 choices are more than decode's 4 waiting places"):
        Scheduler(lm, tokenizer, eos, max_batch_size=1).add(many)


def test_waiting_caches_take_at_most_the_pools_bytes(parts):
    """Places to wait are counted, and so are the bytes their caches hold: a few long
    contexts fill the line before its places do (a choice's copies count once)."""
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, max_batch_size=8, max_kv_tokens=64)
    long_prompt = list(range(10, 50))  # 40 tokens: a quarter-filled line is past the pool
    sampling = SamplingParams(8, temperature=1.0, seed=0, n=2)
    first = engine.run("w0", long_prompt, None, sampling).handoff
    scheduler.add(first)  # nothing waits: always taken
    assert scheduler.waiting_bytes() == first.cache.nbytes <= scheduler.max_waiting_bytes
    with pytest.raises(Busy, match="bytes of caches wait"):
        scheduler.add(engine.run("w1", long_prompt, None, sampling).handoff)
    assert len(scheduler.waiting) == 2 < scheduler.max_waiting  # places were left


def test_n_choices_decode_apart_and_abort_together(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    sampling = SamplingParams(6, temperature=1.5, top_k=50, seed=4, n=3)
    added = scheduler.add(engine.run("many", PROMPTS[1], None, sampling).handoff)
    assert [s.index for s, _ in added] == [0, 1, 2]
    assert len({id(s.table) for s, _ in added}) == 3  # each grows its own blocks
    scheduler.step()
    assert len({s.table.blocks[-1] for s in scheduler.running.values()}) == 3
    assert sorted(scheduler.running) == [("many", 0), ("many", 1), ("many", 2)]
    assert scheduler.abort("many") and len(scheduler) == 0


def test_a_pool_that_cannot_grow_fails_only_the_sequence_that_needs_it(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    expected = run_alone(parts, 0, max_tokens=8)
    produced = list(scheduler.add(handoff(engine, 0, max_tokens=8))[0][1].token_ids)
    scheduler.add(engine.run("long", [9] * 46, None, SamplingParams(8, temperature=0)).handoff)
    pool, grow = scheduler.pool, scheduler.pool.grow

    def out_of_memory_past_5_blocks(blocks):
        if blocks > 5:
            raise RuntimeError("out of memory")
        grow(blocks)

    # r0 holds one block and the long one three (47 rows); its 49th row needs a fourth
    pool.grow = out_of_memory_past_5_blocks
    failed = []
    while len(scheduler):
        step = scheduler.step()
        failed += [(s.request_id, why) for s, why in step.failed]
        produced += [t for s, d in step.produced if s.request_id == "r0" for t in d.token_ids]
    assert failed == [("long", "decode failed: RuntimeError: out of memory")]
    assert produced == expected  # its neighbour never noticed
    assert len(pool) == 0 and pool.storage.shape[1] == 1


def run_all(scheduler, handoffs):
    """Every request's tokens, and how many times a sequence was sent back to wait. Each step
    checks who was: those that joined last, back at the head of the line in the order they
    had joined."""
    produced, preempted = {}, 0
    for h in handoffs:
        for sequence, delta in scheduler.add(h):
            produced.setdefault(sequence.key, []).extend(delta.token_ids)
    while len(scheduler):
        before = list(scheduler.running)
        step = scheduler.step()
        assert not step.failed and not step.refused
        assert scheduler.pool.storage.shape[1] <= scheduler.pool.max_blocks
        waiting = [s.key for s in scheduler.waiting]
        back = [key for key in before if key in waiting]
        assert len(back) == step.preempted
        stayed = [before.index(key) for key in before if key in scheduler.running]
        assert all(before.index(key) > max(stayed, default=-1) for key in back)
        assert waiting[: len(back)] == back
        statuses = {s.key: s.status.value for s in scheduler.sequences()}
        assert all(statuses[key] == "preempted" for key in back)
        assert all(statuses[key] == "running" for key in scheduler.running)
        assert scheduler.counts()["preempted"] >= len(back)
        preempted += step.preempted
        for sequence, delta in step.produced:
            produced.setdefault(sequence.key, []).extend(delta.token_ids)
    return produced, preempted


def test_a_small_kv_budget_makes_sequences_wait_and_changes_no_token(parts):
    """Four requests in a cache of 4 blocks (64 rows) where together they need 9: they wait to
    join, and those that joined last go back to wait when the others need blocks; greedy and
    seeded tokens are those of an unbounded cache."""
    lm, tokenizer, engine, eos = parts

    def handoffs():
        greedy = SamplingParams(24, temperature=0)
        seeded = SamplingParams(24, temperature=1.5, top_k=50, seed=7, n=2)
        return [
            engine.run("a", [9] * 20, None, greedy).handoff,
            engine.run("b", PROMPTS[1], None, seeded).handoff,
            engine.run("c", PROMPTS[0], None, greedy).handoff,
        ]

    expected, none = run_all(Scheduler(lm, tokenizer, eos), handoffs())
    bounded = Scheduler(lm, tokenizer, eos, max_kv_tokens=64)
    produced, preempted = run_all(bounded, handoffs())
    assert none == 0 and preempted > 0
    assert produced == expected
    assert all(len(tokens) == 24 for tokens in produced.values())


def test_a_request_larger_than_the_kv_budget_is_refused(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, max_kv_tokens=32)
    with pytest.raises(ValueError, match="exceed decode's KV cache of 32 tokens"):
        scheduler.add(engine.run("big", [9] * 20, None, SamplingParams(13, temperature=0)).handoff)
    scheduler.add(engine.run("fits", [9] * 20, None, SamplingParams(12, temperature=0)).handoff)


def test_the_default_kv_budget_is_every_slot_at_full_context_if_memory_allows(parts, monkeypatch):
    config, cpu = parts[0].config, torch.device("cpu")
    context = config.max_position_embeddings
    assert default_kv_tokens(config, 4, cpu, torch.float32, copies=2) == 4 * context
    per_token = config.num_hidden_layers * config.latent_dim * 4
    free = [6 * context * per_token]
    monkeypatch.setattr("epd.decode.scheduler.available_memory", lambda: free[0])
    # a quarter of free: the pool keeps a gathered copy of up to its size beside it
    assert default_kv_tokens(config, 4, cpu, torch.float32, copies=2) == 6 * context // 4
    assert default_kv_tokens(config, 4, cpu, torch.float32, copies=1) == 6 * context // 2
    free[0] //= 10
    assert default_kv_tokens(config, 4, cpu, torch.float32, copies=2) == context  # one, at least


def test_the_first_in_line_waits_for_blocks_and_nobody_passes_it(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, max_kv_tokens=64)  # 4 blocks
    greedy = SamplingParams(20, temperature=0)
    scheduler.add(engine.run("running", [9] * 20, None, greedy).handoff)  # 2 blocks
    scheduler.add(engine.run("big", [9] * 40, None, greedy).handoff)  # 3 blocks: not free
    scheduler.add(engine.run("small", [9] * 3, None, greedy).handoff)  # 1 block would be free
    scheduler.step()
    assert list(scheduler.running) == [("running", 0)]
    assert [s.request_id for s in scheduler.waiting] == ["big", "small"]


def test_a_kv_budget_that_does_not_fit_says_which_setting_to_lower(parts, monkeypatch):
    lm, tokenizer, _, eos = parts

    def out_of_memory(*_, **__):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("epd.decode.scheduler.BlockPool", out_of_memory)
    with pytest.raises(RuntimeError, match="KV cache of 4096 tokens .* smaller --max-kv-tokens"):
        Scheduler(lm, tokenizer, eos, max_kv_tokens=4096, preallocate=True)


def test_max_model_len_and_a_memory_share_size_the_default_budget(parts, monkeypatch):
    config, cpu = parts[0].config, torch.device("cpu")
    per_token = config.num_hidden_layers * config.latent_dim * 4
    monkeypatch.setattr("epd.decode.scheduler.available_memory", lambda: 1000 * per_token)
    assert kv_memory(cpu, copies=2) == 250 * per_token  # half the free memory, half for the copy
    assert kv_memory(cpu, 0.9, copies=2) == 450 * per_token  # the pool and its copy take 0.9
    assert default_kv_tokens(config, 4, cpu, torch.float32, context=32) == 4 * 32
    assert default_kv_tokens(config, 64, cpu, torch.float32, 64, 0.9, 2) == 450


def test_a_shorter_context_refuses_a_hand_off_past_it(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, context_length=16)
    with pytest.raises(ValueError, match="exceed the context length 16"):
        scheduler.add(engine.run("long", [9] * 10, None, SamplingParams(7, temperature=0)).handoff)
    scheduler.add(engine.run("fits", [9] * 10, None, SamplingParams(6, temperature=0)).handoff)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_request_moved_mid_reply_goes_on_as_if_it_never_moved(parts, seeded):
    """Migration: prefill again with the reply's first k - 1 tokens, hand off from its k-th with
    the generator advanced past them; a new decoder gives the rest of the reply unchanged, its
    counts going on from k (nothing of the first k is given again)."""
    lm, tokenizer, engine, eos = parts
    whole = run_alone(parts, 1, max_tokens=12, seeded=seeded)
    first = handoff(engine, 1, 12, seeded)
    k = 5
    resume = Resume(k - 1, whole[k - 1], advanced(first.rng_states[0], first.sampling, k - 1))
    prompt = Prompt("r1", PROMPTS[1] + whole[: k - 1], None, first.sampling, resume=resume)
    (prefilled,) = engine.run_batch([prompt])
    moved = prefilled.handoff
    assert prefilled.first == () and moved.resumed_tokens == k - 1
    scheduler = Scheduler(lm, tokenizer, eos)
    ((sequence, output),) = scheduler.add(moved)
    assert output.completion_tokens == k and sequence.tokens == whole[:k]
    rest, counts = [], []
    while len(scheduler):
        for _, delta in scheduler.step().produced:
            rest += delta.token_ids
            counts.append(delta.completion_tokens)
    assert rest == whole[k:] and counts[0] == k + 1 and counts[-1] == 12


def test_a_resumed_reply_that_would_have_ended_is_refused(parts):
    lm, tokenizer, engine, eos = parts
    first = handoff(engine, 0, 12)
    ended = next(iter(eos))  # the client's reply could not have gone on past its eos
    resume = Resume(1, 5, first.rng_states[0])
    prompt = Prompt("r0", PROMPTS[0] + [ended], None, first.sampling, resume=resume)
    (prefilled,) = engine.run_batch([prompt])
    with pytest.raises(ValueError, match="ended before its last token"):
        Scheduler(lm, tokenizer, eos).add(prefilled.handoff)
