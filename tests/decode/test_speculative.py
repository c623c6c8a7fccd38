"""Speculative decoding in decode's scheduler: n-gram drafts verified a step at a time give
the tokens, text, logprobs and ends that decoding without them gives, whatever the request
asks for; sampled ones leave the model's distribution as it is."""

import msgspec
import pytest
import torch

from epd.config.speculative import SpeculativeConfig
from epd.decode.scheduler import Scheduler
from epd.generation.grammar import choice_grammar
from epd.generation.params import SamplingParams
from epd.generation.sampling import advanced, probabilities
from epd.generation.speculative import proposer
from epd.kv.hashing import BLOCK_TOKENS
from epd.prefill.engine import Prompt

NGRAM = SpeculativeConfig("ngram", 4, 3, 1)
DRAFT_TWO = SpeculativeConfig("ngram", 2, 1, 1)
NGRAM_PROPOSER = proposer(NGRAM)
# Prompts that repeat themselves, so that prompt lookup finds drafts from the first step
BIASES = ((42, 6.0), (99, 5.5), (17, 5.0))
PROMPTS = [[5, 17, 42, 99] * 5, [7, 300, 12, 64, 128, 3, 250] * 3, [31, 77, 31, 77, 31]]


def run(parts, sampling, speculative, prompts=PROMPTS, **options):
    """Each prompt's reply through one scheduler, all decoded together: per request its
    outputs, joined (tokens, text, logprobs, finish and stop reasons), and the steps' counts."""
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, speculative=speculative, **options)
    replies: dict[tuple[str, int], list] = {}
    for i, prompt in enumerate(prompts):
        asked = sampling[i] if isinstance(sampling, list) else sampling  # or one each
        prefilled = engine.run(f"r{i}", prompt, None, asked)
        if prefilled.handoff is None:  # its first token ended it
            replies |= {(f"r{i}", k): [output] for k, output in enumerate(prefilled.first)}
            continue
        for sequence, output in scheduler.add(prefilled.handoff):
            replies[sequence.key] = [output]
    steps = []
    while len(scheduler):
        step = scheduler.step()
        assert not step.failed and not step.refused, (step.failed, step.refused)
        steps.append(step)
        for sequence, output in step.produced:
            replies[sequence.key].append(output)
    assert not scheduler.pool.used_blocks  # every block let go, the rolled-back ones too
    return {key: summary(outputs) for key, outputs in replies.items()}, steps


def summary(outputs):
    last = outputs[-1]
    tokens = [t for o in outputs for t in o.token_ids]
    logprobs = [lp.logprob for o in outputs for lp in o.logprobs]
    assert last.completion_tokens == len(tokens)
    return tokens, "".join(o.text for o in outputs), last.finish_reason, last.stop_reason, logprobs


def accepted(steps) -> int:
    return sum(sum(step.accepted) for step in steps)


def assert_same(with_drafts, without):
    assert with_drafts.keys() == without.keys()
    for key, (tokens, text, finish, stop, logprobs) in without.items():
        got = with_drafts[key]
        assert got[:4] == (tokens, text, finish, stop), key
        torch.testing.assert_close(got[4], logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(24, temperature=0, logprobs=True, top_logprobs=2),
        SamplingParams(23, temperature=0, ignore_eos=True),  # max_tokens exactly, mid-draft
        # the penalty grows with each repeat: the biased tokens take turns, inside drafts too
        SamplingParams(24, temperature=0, frequency_penalty=0.5, logit_bias=BIASES),
        SamplingParams(24, temperature=0, min_tokens=10, logit_bias=((42, 3.0),)),
        SamplingParams(24, temperature=0, n=2),
    ],
    ids=["logprobs", "max_tokens", "penalties", "min_tokens-bias", "n2"],
)
def test_greedy_replies_are_the_same_with_drafts_and_without(parts, sampling):
    without, plain = run(parts, sampling, None)
    with_drafts, steps = run(parts, sampling, NGRAM)
    assert_same(with_drafts, without)
    assert accepted(steps) > 0 and len(steps) < len(plain)  # drafts were taken: fewer steps
    assert sum(step.draft_tokens for step in steps) >= accepted(steps)


def test_stops_inside_a_draft_end_the_reply_where_they_would_without(parts):
    """Replies that loop over three biased tokens, so that drafts are taken, and stop at the
    third (by its id, or by its text) once min_tokens allows: each ends at the same token
    whether it came inside a draft or not, the drafts after it dropped."""
    _, tokenizer, _, _ = parts
    biased = {"temperature": 0, "frequency_penalty": 0.5, "logit_bias": BIASES, "min_tokens": 9}
    stop_text = tokenizer.decode([17])
    for sampling in (
        SamplingParams(24, stop_token_ids=(17,), **biased),
        SamplingParams(24, stop=(stop_text,), include_stop_str=True, **biased),
    ):
        without, _ = run(parts, sampling, None)
        with_drafts, steps = run(parts, sampling, NGRAM)
        assert_same(with_drafts, without)
        ends = [o for step in steps for _, o in step.produced if o.finish_reason == "stop"]
        assert len(ends) == 3 and any(len(o.token_ids) > 1 for o in ends)  # inside a draft


def test_a_grammar_refuses_drafts_it_does_not_allow(parts):
    sampling = SamplingParams(24, temperature=0, grammar=choice_grammar(["yes", "no", "maybe"]))
    without, _ = run(parts, sampling, None)
    with_drafts, _ = run(parts, sampling, NGRAM)
    assert_same(with_drafts, without)
    assert all(reply[1] in ("yes", "no", "maybe") for reply in with_drafts.values())


def test_drafts_in_a_full_pool_take_only_the_room_there_is(parts):
    """A pool too small for the three replies at once, where sequences wait and are sent
    back: drafts take no block a sequence needs (cut to the blocks each holds), and the
    replies are the same."""
    sampling = SamplingParams(40, temperature=0, ignore_eos=True)
    without, plain = run(parts, sampling, None, max_kv_tokens=96)
    with_drafts, steps = run(parts, sampling, NGRAM, max_kv_tokens=96)
    assert_same(with_drafts, without)
    assert any(step.preempted for step in plain) and accepted(steps) > 0


def chi_square_bound(df: int, z: float = 3.0902) -> float:
    """The chi-square statistic's 1 - 1e-3 quantile (Wilson-Hilferty; z: the normal's)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("speculative", [None, DRAFT_TWO], ids=["without", "with-drafts"])
def test_sampled_replies_keep_the_models_distribution(parts, speculative):
    """The two tokens decode samples after a given first one, over 2,560 choices (20 requests
    of n=128, seeded), with drafts of both: their joint distribution is the model's own,
    p(a) p(b | a) under top_k=3 and the biases (which make the drafts likely but not sure),
    by a chi-square test whose false-alarm rate is 1 in 1,000 (deterministic: fixed seeds).
    The first token is fixed by the hand-off so that every choice has the same drafts."""
    lm, tokenizer, engine, eos = parts
    prompt, first = [5, 17, 42, 99, 31, 77] * 2, 42  # the drafts: what came after 42, 99 31
    biases = ((99, 1.5), (31, 1.5))
    # (a third token, so that the step has room for both drafts; only the first two count)
    sampling = SamplingParams(
        4, temperature=1.0, top_k=3, logit_bias=biases, n=128, ignore_eos=True
    )
    counts: dict[tuple[int, int], int] = {}
    taken = 0
    for seed in range(20):
        seeded = msgspec.structs.replace(sampling, seed=128 * seed)  # every choice its own
        handoff = engine.run("r", prompt, None, seeded).handoff
        handoff = msgspec.structs.replace(
            handoff, first_tokens=(first,) * 128, first_logprobs=(None,) * 128
        )
        scheduler = Scheduler(lm, tokenizer, eos, max_batch_size=128, speculative=speculative)
        scheduler.add(handoff)
        replies: dict[int, list[int]] = {}
        while len(scheduler):
            step = scheduler.step()
            taken += sum(step.accepted)
            for sequence, output in step.produced:
                replies.setdefault(sequence.index, []).extend(output.token_ids)
        for reply in replies.values():
            cell = (reply[0], reply[1])
            counts[cell] = counts.get(cell, 0) + 1
    assert (taken > 0) == (speculative is not None)  # drafts were kept, and refused
    params = [SamplingParams(3, temperature=1.0, top_k=3)]

    def model(ids):  # the distribution of the token after ids, biased as the request asks
        logits = engine.lm.logits(engine.lm.prefill(engine.lm.embed(torch.tensor(ids)))[0][-1])
        for token, bias in biases:
            logits[token] += bias
        return probabilities(logits[None], params)[0]

    trials = sum(counts.values())
    with torch.inference_mode():
        after = model([*prompt, first])
        expected = {
            (a, b): float(after[a] * p_b) * trials
            for a in after.nonzero().flatten().tolist()
            for b, p_b in enumerate(model([*prompt, first, a]).tolist())
            if p_b > 0
        }
    assert set(counts) <= set(expected)
    statistic = sum((counts.get(cell, 0) - e) ** 2 / e for cell, e in expected.items())
    assert statistic < chi_square_bound(len(expected) - 1), (statistic, counts, expected)


def test_no_drafts_in_a_batch_as_large_as_disable_by_batch_size(parts):
    """Three replies together, drafts off from three running: none drafted while all three
    run, drafts again once the shortest has left."""
    sampling = [SamplingParams(n, temperature=0, ignore_eos=True) for n in (24, 24, 6)]
    capped = SpeculativeConfig("ngram", 4, 3, 1, disable_by_batch_size=3)
    without, _ = run(parts, sampling, None)
    with_drafts, steps = run(parts, sampling, capped)
    assert_same(with_drafts, without)
    assert all(not step.draft_tokens for step in steps if step.batch >= 3)
    assert any(step.draft_tokens for step in steps if step.batch < 3)


def test_every_sampled_token_takes_one_draw_drafted_or_not(parts):
    """A sampled reply with drafts kept and refused leaves its generator where one uniform a
    token puts it (`advanced`): where a request moved to another decoder goes on from."""
    lm, tokenizer, engine, eos = parts
    sampling = SamplingParams(30, temperature=1.0, top_k=3, logit_bias=BIASES, ignore_eos=True)
    handoff = engine.run("r", PROMPTS[0], None, msgspec.structs.replace(sampling, seed=5)).handoff
    scheduler = Scheduler(lm, tokenizer, eos, speculative=NGRAM)
    ((sequence, _),) = scheduler.add(handoff)
    steps = []
    while len(scheduler):
        steps.append(scheduler.step())
    assert accepted(steps) > 0 and len(steps) < 29  # drafts were kept
    refused = sum(s.draft_tokens for s in steps) - accepted(steps)
    assert refused > 0
    expected = advanced(handoff.rng_states[0], sampling, len(sequence.tokens) - 1)
    assert torch.equal(sequence.generator.get_state(), expected)


def test_drafts_take_no_cached_block_and_a_failing_proposer_fails_no_one(parts, caplog):
    """A pool of 4 blocks, 2 of them a cached prompt's: a reply whose own rows fit in the other
    2 keeps both cached while they do, its drafts cut to the room there is (they take only
    blocks nobody holds nor caches; beyond, its own growth may evict). Where drafting raises,
    that sequence steps without drafts, unharmed, and the same tokens come."""
    lm, tokenizer, engine, eos = parts
    biased = {"frequency_penalty": 0.5, "logit_bias": BIASES}  # loops: drafts every step
    sampling = SamplingParams(24, temperature=0, ignore_eos=True, **biased)
    scheduler = Scheduler(lm, tokenizer, eos, max_kv_tokens=64, speculative=NGRAM)
    ids = PROMPTS[0] * 2  # 40 tokens: 2 full blocks, named
    named = Prompt("c", ids, None, sampling, block_hashes=engine.hashes(ids, (), b""))
    scheduler.add(engine.run_batch([named])[0].handoff)
    while len(scheduler):
        scheduler.step()
    assert scheduler.pool.blocks.cached == 2
    runs, cut = {}, 0
    for name, broken in (("alone", False), ("broken", True)):
        scheduler.proposer = NGRAM_PROPOSER if not broken else Broken()
        scheduler.add(engine.run(name, PROMPTS[1], None, sampling).handoff)
        tokens, cached = [], scheduler.pool.blocks.cached  # (its own growth took one before)
        while len(scheduler):
            step = scheduler.step()
            assert not step.failed
            tokens += [t for _, o in step.produced for t in o.token_ids]
            (table,) = [s.table for s in scheduler.running.values()] or [None]
            if table is not None and table.length < 2 * BLOCK_TOKENS:  # its own fit in 2
                assert scheduler.pool.blocks.cached == cached, table.length
                cut += table.length + 1 + 4 > 2 * BLOCK_TOKENS  # 4 drafts would not have
        runs[name] = tokens
    assert cut and runs["alone"] == runs["broken"] and "its drafts failed" in caplog.text


class Broken:
    def propose(self, tokens, limit):
        raise RuntimeError("a proposer bug")


def test_a_request_aborted_between_steps_with_drafts_lets_its_blocks_go(parts):
    """A client gone mid-reply: its sequence leaves with its blocks, the drafts' rows too,
    and the other goes on to the same reply as alone."""
    lm, tokenizer, engine, eos = parts
    sampling = SamplingParams(
        24, temperature=0, ignore_eos=True, frequency_penalty=0.5, logit_bias=BIASES
    )
    replies, _ = run(parts, sampling, NGRAM, [PROMPTS[1]])
    alone = replies[("r0", 0)][0]
    scheduler = Scheduler(lm, tokenizer, eos, speculative=NGRAM)
    tokens = []
    for i, prompt in enumerate(PROMPTS[:2]):
        ((_, first),) = scheduler.add(engine.run(f"r{i}", prompt, None, sampling).handoff)
        tokens.append(list(first.token_ids))
    for _ in range(3):
        for sequence, output in scheduler.step().produced:
            tokens[int(sequence.request_id[1])] += output.token_ids
    assert scheduler.abort("r0")
    while len(scheduler):
        for sequence, output in scheduler.step().produced:
            tokens[int(sequence.request_id[1])] += output.token_ids
    assert tokens[1] == alone and not scheduler.pool.used_blocks
