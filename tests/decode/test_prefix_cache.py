"""Decode's prefix cache: a hand-off carries only the rows of the blocks decode lacks, and what
decode generates is the same, to the logprob, as from a hand-off that carried every row."""

import random

import pytest
import torch

from epd.decode.scheduler import Lacking, Scheduler
from epd.generation.params import SamplingParams
from epd.kv.hashing import BLOCK_TOKENS, ImageSpan, image_spans
from epd.prefill.engine import Prompt, hash_rows

rng = random.Random(0)
SYSTEM = [rng.randrange(5, 400) for _ in range(3 * BLOCK_TOKENS + 5)]  # 3 whole blocks and 5
GREEDY = SamplingParams(10, temperature=0, logprobs=True, top_logprobs=2)


def prompt(engine, request_id, ids, sampling=GREEDY, held=0, rows=None, spans=()):
    """A prompt named block by block, its decoder said to hold the first `held` blocks."""
    hashes = engine.hashes(ids, spans, b"")
    return Prompt(
        request_id, ids, rows, sampling, image_spans=spans, block_hashes=hashes, decoder_blocks=held
    )


def handed(engine, *prompts):
    return [r.handoff for r in engine.run_batch(list(prompts))]


def generated(scheduler, handoff):
    """Every choice's tokens and logprobs, the first's included, decoded to the end."""
    out: dict[int, list] = {}
    for sequence, delta in scheduler.add(handoff):
        out.setdefault(sequence.index, []).extend(pairs(delta))
    while any(s.request_id == handoff.request_id for s in scheduler.sequences()):
        for sequence, delta in scheduler.step().produced:
            if sequence.request_id == handoff.request_id:
                out.setdefault(sequence.index, []).extend(pairs(delta))
    return out


def pairs(delta):
    """Each token with its logprob record (None where none was asked for)."""
    logprobs = delta.logprobs or (None,) * len(delta.token_ids)
    return list(zip(delta.token_ids, logprobs, strict=True))


def assert_same(ours, theirs):
    assert ours.keys() == theirs.keys()
    for index in ours:
        assert [t for t, _ in ours[index]] == [t for t, _ in theirs[index]]
        for (_, mine), (_, its) in zip(ours[index], theirs[index], strict=True):
            if mine is not None:
                assert mine.logprob == pytest.approx(its.logprob, abs=1e-5)


def fresh(parts, **options):
    lm, tokenizer, _, eos = parts
    return Scheduler(lm, tokenizer, eos, **options)


def test_the_next_turn_carries_only_the_rows_decode_lacks_and_decodes_the_same(parts):
    _, _, engine, _ = parts
    scheduler = fresh(parts)
    first = prompt(engine, "a", SYSTEM)
    generated(scheduler, handed(engine, first)[0])
    assert scheduler.pool.blocks.cached == 3  # the prompt's whole blocks, kept
    second_ids = [*SYSTEM, 7, 8, 9]
    (partial,) = handed(engine, prompt(engine, "b", second_ids, held=3))
    (whole,) = handed(engine, prompt(engine, "b", second_ids))
    assert partial.cached_blocks == 3 and partial.cache.shape[1] == len(second_ids) - 48
    assert whole.cache.shape[1] == len(second_ids)
    assert_same(generated(scheduler, partial), generated(fresh(parts), whole))


def test_off_decode_keeps_nothing_and_says_so(parts):
    _, _, engine, _ = parts
    scheduler = fresh(parts, prefix_caching=False)
    generated(scheduler, handed(engine, prompt(engine, "a", SYSTEM))[0])
    assert scheduler.pool.blocks.cached == 0
    with pytest.raises(Lacking) as lacking:
        scheduler.add(handed(engine, prompt(engine, "b", SYSTEM, held=2))[0])
    assert (lacking.value.held, lacking.value.keeps) == (0, False)
    assert not scheduler.pool.blocks.held and not len(scheduler)


def test_a_block_evicted_since_is_asked_for_and_nothing_is_held_meanwhile(parts):
    """Decode filled its cache with others' blocks: it holds the first block still, says so,
    and the hand-off again from there decodes as a whole one."""
    _, _, engine, _ = parts
    scheduler = fresh(parts, max_kv_tokens=6 * BLOCK_TOKENS)
    generated(scheduler, handed(engine, prompt(engine, "a", SYSTEM))[0])
    blocks = scheduler.pool.blocks
    # The least recently used go first: the prompt's last blocks before its first.
    first_block = blocks.by_hash[engine.hashes(SYSTEM, (), b"")[0]]
    blocks.unused.move_to_end(first_block)
    other = [rng.randrange(5, 400) for _ in range(4 * BLOCK_TOKENS)]
    filler = handed(engine, prompt(engine, "x", other, SamplingParams(2, temperature=0)))[0]
    generated(scheduler, filler)
    held_before = blocks.held
    with pytest.raises(Lacking) as lacking:
        scheduler.add(handed(engine, prompt(engine, "b", SYSTEM, held=3))[0])
    assert lacking.value.held == 1 and blocks.held == held_before
    again = handed(engine, prompt(engine, "b", SYSTEM, held=1))[0]
    assert_same(
        generated(scheduler, again),
        generated(fresh(parts), handed(engine, prompt(engine, "b", SYSTEM))[0]),
    )


def test_choices_share_the_held_blocks_and_decode_as_with_every_row(parts):
    _, _, engine, _ = parts
    scheduler = fresh(parts)
    generated(scheduler, handed(engine, prompt(engine, "a", SYSTEM))[0])
    three = SamplingParams(6, temperature=1.0, seed=3, n=3, logprobs=True)
    partial = handed(engine, prompt(engine, "b", [*SYSTEM, 4], three, held=3))[0]
    scheduler.add(partial)
    shared = {tuple(s.table.blocks) for s in scheduler.waiting}
    assert len(shared) == 1 and len(next(iter(shared))) == 3  # one prefix, held thrice
    assert all(scheduler.pool.blocks.refs[b] == 3 for b in next(iter(shared)))
    scheduler.abort("b")
    whole = handed(engine, prompt(engine, "b", [*SYSTEM, 4], three))[0]
    partial = handed(engine, prompt(engine, "b", [*SYSTEM, 4], three, held=3))[0]
    assert_same(generated(scheduler, partial), generated(fresh(parts), whole))


def test_a_cached_block_that_ends_inside_an_image(parts):
    """Blocks 1 and 2 hold an image's rows (20-43): they are named by its digest, and reused
    only for the same image."""
    lm, _, engine, _ = parts
    ids = [*SYSTEM[:20], *[engine.placeholder_id] * 24, *SYSTEM[20:30]]
    picture = torch.randn(24, lm.config.hidden_size)
    spans = image_spans(ids, engine.placeholder_id, [24], ["aa" * 32])
    scheduler = fresh(parts)
    generated(scheduler, handed(engine, prompt(engine, "a", ids, rows=picture, spans=spans))[0])
    partial = handed(engine, prompt(engine, "b", ids, rows=picture, spans=spans, held=3))[0]
    whole = handed(engine, prompt(engine, "b", ids, rows=picture, spans=spans))[0]
    assert partial.images and partial.cache.shape[1] == len(ids) - 48
    assert_same(generated(scheduler, partial), generated(fresh(parts), whole))
    other = (ImageSpan(20, 24, bytes.fromhex("bb" * 32)),)
    with pytest.raises(Lacking) as lacking:  # another image: only the text block is the same
        scheduler.add(
            handed(engine, prompt(engine, "c", ids, rows=picture, spans=other, held=3))[0]
        )
    assert lacking.value.held == 1


def test_hashes_that_do_not_match_the_prompt_are_refused(parts):
    """A hand-off cannot borrow blocks by naming another prompt's hashes."""
    _, _, engine, _ = parts
    scheduler = fresh(parts)
    generated(scheduler, handed(engine, prompt(engine, "a", SYSTEM))[0])
    mine = handed(engine, prompt(engine, "b", [9, *SYSTEM[1:]], held=0))[0]
    borrowed = hash_rows(engine.hashes(SYSTEM, (), b""))
    forged = mine.cache.new_zeros(
        mine.cache.shape[0], mine.cache.shape[1] - 48, mine.cache.shape[2]
    )
    fields = {f: getattr(mine, f) for f in mine.__struct_fields__}
    lying = type(mine)(**(fields | {"block_hashes": borrowed, "cached_blocks": 3, "cache": forged}))
    with pytest.raises(ValueError, match="do not match its prompt"):
        scheduler.add(lying)
    salted = type(mine)(**(fields | {"salt": b"s" * 32}))  # a salt the hashes were not made with
    with pytest.raises(ValueError, match="do not match its prompt"):
        scheduler.add(salted)
    assert not scheduler.pool.blocks.held


def test_cached_blocks_never_make_a_request_wait(parts):
    """Cached blocks are free space: a request that needs every block evicts them."""
    _, _, engine, _ = parts
    scheduler = fresh(parts, max_kv_tokens=5 * BLOCK_TOKENS)
    short = SamplingParams(2, temperature=0)
    generated(scheduler, handed(engine, prompt(engine, "a", SYSTEM, short))[0])
    assert scheduler.pool.blocks.cached == 3 and scheduler.pool.used_blocks == 0
    long = [rng.randrange(5, 400) for _ in range(4 * BLOCK_TOKENS)]
    scheduler.add(handed(engine, prompt(engine, "b", long, SamplingParams(12, temperature=0)))[0])
    preempted = sum(scheduler.step().preempted for _ in range(12))
    assert preempted == 0 and scheduler.pool.blocks.cached <= 4


def test_a_preempted_sequence_rejoins_from_the_cached_blocks_and_decodes_the_same(parts):
    """Sent back to wait, a sequence's rows go to host memory and its prompt's blocks stay
    cached; joining again it takes them back and writes only the rest."""
    _, _, engine, _ = parts
    picker = random.Random(1)  # its own: the module's rng is where earlier tests left it
    other = [picker.randrange(5, 400) for _ in range(40)]
    long = SamplingParams(24, temperature=0, logprobs=True, ignore_eos=True)  # both grow on
    asked = [prompt(engine, "a", SYSTEM, long), prompt(engine, "b", other, long)]
    scheduler = fresh(parts, max_kv_tokens=8 * BLOCK_TOKENS)  # both join, not both to the end
    produced: dict[str, list] = {}
    for handoff in handed(engine, *asked):
        for sequence, delta in scheduler.add(handoff):
            produced.setdefault(sequence.request_id, []).extend(pairs(delta))
    preempted = 0
    while len(scheduler):
        step = scheduler.step()
        preempted += step.preempted
        for sequence, delta in step.produced:
            produced.setdefault(sequence.request_id, []).extend(pairs(delta))
    assert preempted
    for one in asked:
        alone = generated(fresh(parts), handed(engine, one)[0])
        assert_same({0: produced[one.request_id]}, alone)


def test_a_request_aborted_while_it_waits_lets_go_of_the_blocks_it_held(parts):
    _, _, engine, _ = parts
    scheduler = fresh(parts, max_batch_size=1)
    generated(scheduler, handed(engine, prompt(engine, "a", SYSTEM))[0])
    busy = [rng.randrange(5, 400) for _ in range(20)]
    scheduler.add(handed(engine, prompt(engine, "x", busy, SamplingParams(30, temperature=0)))[0])
    scheduler.step()  # x takes the one batch slot
    scheduler.add(handed(engine, prompt(engine, "b", [*SYSTEM, 3], held=3))[0])
    named = [scheduler.pool.blocks.by_hash[h] for h in engine.hashes(SYSTEM, (), b"")]
    assert all(scheduler.pool.blocks.refs.get(b) == 1 for b in named)  # b holds them, waiting
    assert scheduler.abort("b")
    assert not any(b in scheduler.pool.blocks.refs for b in named)  # cached again, held by none
    assert scheduler.pool.blocks.cached >= 3
