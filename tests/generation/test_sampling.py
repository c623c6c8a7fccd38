import pytest
import torch

from epd.generation.params import SamplingParams
from epd.generation.sampling import (
    make_generator,
    probabilities,
    restore_generator,
    sample,
    sample_batch,
    score_tokens,
    token_logprob,
    token_logprobs,
)

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


@pytest.mark.parametrize("top_k", [0, 5])  # in vocabulary order, and in probability order
def test_min_p_drops_tokens_below_its_share_of_the_likeliest(top_k):
    probs = LOGITS.softmax(-1)  # ≈ [.09, .52, .32, .01, .03]: 0.3 × .52 ≈ .16
    assert set(draws(SamplingParams(8, temperature=1.0, min_p=0.3, top_k=top_k))) == {1, 2}
    assert probs[2] > 0.3 * probs[1] > probs[0]


def test_full_distribution_reaches_every_token():
    assert set(draws(SamplingParams(8, temperature=1.0), n=2000)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(8, temperature=1.0),
        SamplingParams(8, temperature=0.7, top_k=3),
        SamplingParams(8, temperature=1.3, top_p=0.8),
    ],
)
def test_draw_frequencies_follow_the_distribution(params):
    """Inverse-CDF draws land on each token as often as its (filtered) probability says."""
    scaled = LOGITS / params.temperature
    if params.top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1], -torch.inf)
    probs = scaled.softmax(-1)
    if params.top_p < 1:
        ordered, order = probs.sort(descending=True)
        probs = probs.scatter(
            0, order, ordered.masked_fill(ordered.cumsum(0) - ordered >= params.top_p, 0)
        )
        probs = probs / probs.sum()
    n = 5_000
    counts = torch.bincount(torch.tensor(draws(params, n=n)), minlength=5) / n
    # Four standard deviations of a binomial frequency at p ≤ 0.5.
    assert (counts - probs).abs().max() < 4 * (0.25 / n) ** 0.5
    assert torch.all(counts[probs == 0] == 0)


def test_a_row_draws_the_same_alone_or_in_any_batch():
    """Seeded draws do not depend on which other requests share the decode step."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    rules = [
        SamplingParams(8, temperature=0),
        SamplingParams(8, temperature=1.0),
        SamplingParams(8, temperature=0.8, top_k=5),
        SamplingParams(8, temperature=1.2, top_p=0.9),
        SamplingParams(8, temperature=1.0, top_k=40, top_p=0.5),
        SamplingParams(8, temperature=2.0),
    ]
    alone = [sample(logits[i], rules[i], make_generator(i)) for i in range(6)]
    for subset in ([0, 1, 2, 3, 4, 5], [5, 3, 1], [4, 2]):
        generators = [make_generator(i) for i in subset]
        batch = sample_batch(logits[subset], [rules[i] for i in subset], generators)
        assert batch.tolist() == [alone[i] for i in subset]
    # And over many steps: each generator advances by one draw per sampled token.
    generators = [make_generator(10 + i) for i in range(6)]
    single = [make_generator(10 + i) for i in range(6)]
    for _ in range(50):
        together = sample_batch(logits, rules, generators).tolist()
        assert together == [sample(logits[i], rules[i], single[i]) for i in range(6)]


def test_top_k_keeps_exactly_k_of_varied_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rules = [SamplingParams(8, temperature=5.0, top_k=k) for k in (1, 2, 7)]
    generators = [make_generator(i) for i in range(3)]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(400):
        for row, token in enumerate(sample_batch(logits, rules, generators).tolist()):
            seen[row].add(token)
    for row, k in enumerate((1, 2, 7)):
        assert seen[row] == set(logits[row].topk(k).indices.tolist())


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
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
        sorted(logits.log_softmax(-1).topk(3).values.tolist(), reverse=True), abs=1e-6
    )


def test_logprobs_of_many_rows_are_each_rows_and_the_best_equals_itself(tiny_checkpoint):
    """lm-eval calls a prompt token greedy when its logprob equals the best alternative's:
    exactly, so the two must come out of one computation."""
    from epd.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    logits = torch.randn(5, len(tokenizer)) * 4
    best = logits.argmax(-1).tolist()
    tokens = [best[0], 7, best[2], 300, 11]
    rows = token_logprobs(logits, tokens, 2, tokenizer)
    assert rows == [token_logprob(logits[i], t, 2, tokenizer) for i, t in enumerate(tokens)]
    for row, token, likeliest in zip(rows, tokens, best, strict=True):
        assert (row.logprob == row.top_logprobs[0].logprob) == (token == likeliest)


def test_tied_logits_are_listed_as_greedy_picks_them():
    """With exactly tied logits greedy takes the lowest id; top_logprobs list it first too,
    and the lowest ids among those tied at the cut."""
    logits = torch.full((2, 50), -5.0)
    logits[0, [7, 3, 40]] = 2.0  # three tied at the top
    logits[1, 9] = 3.0
    logits[1, [30, 12, 20, 41]] = 1.0  # four tied below it, two of them cut
    (first, second) = score_tokens(logits, [3, 9], top=3)
    greedy_params = [SamplingParams(max_tokens=1, temperature=0)] * 2
    greedy = sample_batch(logits, greedy_params, [make_generator(0)] * 2)
    assert [t for t, _ in first.top] == [3, 7, 40] and greedy[0] == 3
    assert [t for t, _ in second.top] == [9, 12, 20] and greedy[1] == 9


def chi_square_bound(df: int, z: float = 3.0902) -> float:
    """The chi-square statistic's 1 - 1e-3 quantile (Wilson-Hilferty; z: the normal's)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(8, temperature=0.7),
        SamplingParams(8, temperature=1.3, top_k=5, top_p=0.9),
        SamplingParams(8, temperature=1.0, top_p=0.8, min_p=0.1),
    ],
    ids=["plain", "top-k-p", "top-p-min-p"],
)
def test_probabilities_are_the_distribution_sample_batch_draws_from(params):
    """What speculative decoding accepts drafts by is what plain sampling draws by: 20,000
    draws of `sample_batch` over 12 tokens against `probabilities`, by a chi-square test whose
    false-alarm rate is 1 in 1,000 per case; tokens it gives no mass are never drawn."""
    logits = torch.linspace(-2.0, 2.0, 12)[
        torch.randperm(12, generator=torch.Generator().manual_seed(1))
    ]
    draws = 20_000
    probs = probabilities(logits[None], [params])[0]
    assert abs(float(probs.sum()) - 1) < 1e-6
    generators = [torch.Generator().manual_seed(seed) for seed in range(draws)]
    tokens = sample_batch(logits.expand(draws, -1), [params] * draws, generators)
    counts = torch.bincount(tokens, minlength=12).float()
    kept = probs > 0
    assert not counts[~kept].any()
    expected = probs[kept] * draws
    statistic = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert statistic < chi_square_bound(int(kept.sum()) - 1), (statistic, counts, expected)
