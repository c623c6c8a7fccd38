"""Prefill's first tokens: what the client gets for them, and what is left for decode."""

from epd.generation.params import SamplingParams
from epd.prefill.engine import Prompt
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
