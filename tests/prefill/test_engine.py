"""Prefill's first tokens: what the client gets for them, and what is left for decode."""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from epd.checkpoint.export import export_language_model
from epd.generation.params import SamplingParams
from epd.prefill import engine as engine_module
from epd.prefill.engine import Chunk, Prefilled, Prompt
from epd.prefill.errors import BadRequest

PROMPT = [5, 17, 42, 99]


def test_each_choice_gets_its_first_output_and_decode_the_rest(engine):
    sampling = SamplingParams(5, temperature=1.0, seed=3, n=3, logprobs=True)
    prefilled = engine.run("r", PROMPT, None, sampling)
    handoff = prefilled.handoff
    assert handoff is not None
    for token, logprob, first in zip(
        handoff.first_tokens, handoff.first_logprobs, prefilled.first, strict=True
    ):
        assert first.token_ids == (token,) and first.logprobs == (logprob,)
        assert first.completion_tokens == 1 and first.finish_reason is None
        assert first.text == engine.tokenizer.decode([token])


def test_a_prompt_its_first_tokens_end_has_nothing_for_decode(engine):
    eos = next(iter(engine.eos_ids))
    for sampling in (
        SamplingParams(1, temperature=0, n=2),  # max_tokens
        SamplingParams(9, temperature=0, logit_bias=((eos, 100.0),)),  # an eos
    ):
        prefilled = engine.run("r", PROMPT, None, sampling)
        assert prefilled.handoff is None
        assert all(first.finish_reason for first in prefilled.first)
        assert len(prefilled.first) == sampling.n


def test_logits_that_are_not_finite_fail_the_request_as_the_servers_fault(engine, monkeypatch):
    """An overflow is no 400: nothing the client asked for rules its tokens out."""
    logits = engine.lm.logits
    monkeypatch.setattr(engine.lm, "logits", lambda hidden: logits(hidden) * float("nan"))
    (result,) = engine.run_batch([Prompt("r", PROMPT, None, SamplingParams(1, temperature=0))])
    assert isinstance(result, ValueError) and not isinstance(result, BadRequest)
    assert "not finite" in str(result)


LONG_PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 128, 3, 250, 77, 31, 8, 140]


@pytest.fixture(scope="module")
def oracle_logprobs(tiny_checkpoint, tmp_path_factory):
    """transformers' DeepseekV3ForCausalLM on the same weights: log-softmax of its logits at
    each position of LONG_PROMPT, (T, vocab)."""
    directory = export_language_model(tiny_checkpoint, tmp_path_factory.mktemp("ds") / "ckpt")
    oracle = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        return oracle(torch.tensor([LONG_PROMPT])).logits[0].log_softmax(-1)


def test_a_prompt_asking_gets_each_token_scored_after_those_before(engine, oracle_logprobs):
    greedy = SamplingParams(1, temperature=0)
    scored = engine.run("r", LONG_PROMPT, None, greedy, prompt_logprobs=3).prompt_logprobs
    assert len(scored) == len(LONG_PROMPT) - 1  # every token but the first, which has no before
    for position, (token, entry) in enumerate(zip(LONG_PROMPT[1:], scored, strict=True)):
        expected = oracle_logprobs[position]  # what the model said before `token`
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert entry.rank == 1 + int((expected > expected[token]).sum())
        best = expected.topk(3)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert engine.run("r", LONG_PROMPT, None, greedy).prompt_logprobs == ()  # only if asked


def test_a_chunked_prompt_is_scored_as_a_whole_one(engine, monkeypatch):
    """Each chunk scores the tokens its positions predict, its last one the next chunk's
    first; the output head runs on SCORED_ROWS positions at a time."""
    greedy = SamplingParams(1, temperature=0)
    whole = engine.run("r", LONG_PROMPT, None, greedy, prompt_logprobs=2).prompt_logprobs
    monkeypatch.setattr(engine_module, "SCORED_ROWS", 4)
    prompt = Prompt("r", LONG_PROMPT, None, greedy, prompt_logprobs=2)
    past = None
    for start, stop in ((0, 6), (6, 7), (7, len(LONG_PROMPT))):
        (result,) = engine.run_chunks([Chunk(prompt, start, stop, past)])
        past = result
    assert isinstance(result, Prefilled)
    assert [e.token_id for e in result.prompt_logprobs] == [e.token_id for e in whole]
    for chunked, alone in zip(result.prompt_logprobs, whole, strict=True):
        assert chunked.logprob == pytest.approx(alone.logprob, abs=1e-5)
        assert chunked.rank == alone.rank
        assert [t for t, _ in chunked.top] == [t for t, _ in alone.top]


def test_a_prompt_whose_scores_are_not_finite_fails_alone(engine, monkeypatch):
    logits = engine.lm.logits
    spoiled = lambda hidden: logits(hidden) * (float("nan") if len(hidden) > 2 else 1.0)  # noqa: E731
    monkeypatch.setattr(engine.lm, "logits", spoiled)
    greedy = SamplingParams(1, temperature=0)
    asking = Prompt("a", LONG_PROMPT, None, greedy, prompt_logprobs=0)
    other = Prompt("b", PROMPT, None, greedy)
    failed, fine = engine.run_batch([asking, other])
    assert isinstance(failed, ValueError) and "logprob" in str(failed)
    assert isinstance(fine, Prefilled) and fine.first[0].token_ids
