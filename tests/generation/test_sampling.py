import pytest
import torch

from epd.generation.params import SamplingParams
from epd.generation.sampling import make_generator, restore_generator, sample, token_logprob

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.0])


def draws(params, n=400, seed=0):
    generator = make_generator(seed)
    return [sample(LOGITS, params, generator) for _ in range(n)]


def test_temperature_zero_is_argmax():
    assert set(draws(SamplingParams(8, temperature=0), n=5)) == {1}


def test_top_k_keeps_the_k_likeliest():
    assert set(draws(SamplingParams(8, temperature=1.0, top_k=2))) == {1, 2}


def test_top_p_keeps_the_smallest_covering_set():
    probs = LOGITS.softmax(-1)  # ≈ [.09, .52, .32, .01, .03]
    assert probs[1] < 0.6 < probs[1] + probs[2]
    assert set(draws(SamplingParams(8, temperature=1.0, top_p=0.6))) == {1, 2}
    assert set(draws(SamplingParams(8, temperature=1.0, top_p=0.5))) == {1}


def test_full_distribution_reaches_every_token():
    assert set(draws(SamplingParams(8, temperature=1.0), n=2000)) == {0, 1, 2, 3, 4}


def test_seed_fixes_the_draws():
    params = SamplingParams(8, temperature=1.0)
    assert draws(params, seed=7) == draws(params, seed=7)
    assert draws(params, seed=7) != draws(params, seed=8)


def test_generator_state_resumes_elsewhere():
    params = SamplingParams(8, temperature=1.0)
    generator = make_generator(5)
    first = [sample(LOGITS, params, generator) for _ in range(10)]
    resumed = restore_generator(generator.get_state())
    assert [sample(LOGITS, params, generator) for _ in range(50)] == [
        sample(LOGITS, params, resumed) for _ in range(50)
    ]
    assert first  # the draws before the hand-off do not repeat after it


def test_logprobs_are_the_models(tiny_checkpoint):
    from epd.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    logits = torch.randn(len(tokenizer))
    entry = token_logprob(logits, 42, 3, tokenizer)
    assert entry.logprob == pytest.approx(float(logits.log_softmax(-1)[42]))
    assert entry.token == tokenizer.decode([42]) and bytes(entry.bytes) == entry.token.encode()
    assert [t.logprob for t in entry.top_logprobs] == sorted(
        logits.log_softmax(-1).topk(3).values.tolist(), reverse=True
    )
