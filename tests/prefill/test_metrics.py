"""Prefill's request metrics, observed from the deltas as the API passes them on, and the
`model_name` label that every role's series carry."""

import pytest

from epd.decode.metrics import DecodeMetrics
from epd.encode.metrics import EncodeMetrics
from epd.prefill.metrics import PrefillMetrics, Timeline
from epd.runtime.metrics import RoleMetrics


def sample(metrics: RoleMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(
        name, {"model_name": "kimi", "role": "prefill", **labels}
    )


@pytest.mark.parametrize("role", [PrefillMetrics, EncodeMetrics, DecodeMetrics])
def test_every_series_carries_the_model_name(role):
    metrics = role("kimi")
    families = list(metrics.registry.collect())
    samples = [s for family in families for s in family.samples]
    assert samples and all(s.labels["model_name"] == "kimi" for s in samples)
    assert all(family.name.startswith("epd:") for family in families)


def test_labelled_series_keep_their_own_labels_beside_the_model_name():
    metrics = PrefillMetrics("kimi")
    metrics.success.labels("stop").inc()
    metrics.decoder_reported("tcp://10.0.0.5:7103", 0.25)
    assert sample(metrics, "epd:request_success_total", finished_reason="stop") == 1
    assert sample(metrics, "epd:kv_cache_usage_perc", decoder="tcp://10.0.0.5:7103") == 0.25


def deltas(metrics: PrefillMetrics, timeline: Timeline, *seen: tuple[int, int, float]) -> None:
    for index, tokens, now in seen:  # (choice, its tokens so far, when its delta came)
        metrics.delta(timeline, index, tokens, now)


def test_a_request_of_two_choices_is_observed_as_vllm_observes_one():
    metrics = PrefillMetrics("kimi")
    timeline = Timeline(arrived=10.0)
    # Choice 0: three tokens at 10.5, 10.6 and 10.8; choice 1 ended at its first, at 10.5.
    deltas(metrics, timeline, (0, 1, 10.5), (1, 1, 10.5), (0, 2, 10.6), (0, 3, 10.8))
    metrics.ended(timeline, prompt_tokens=40, reason="length", now=10.9)
    assert sample(metrics, "epd:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    for gaps in ("epd:inter_token_latency_seconds", "epd:time_per_output_token_seconds"):
        assert sample(metrics, f"{gaps}_count") == 2  # a choice's first delta is no gap
        assert sample(metrics, f"{gaps}_sum") == pytest.approx(0.3)
    # Per choice with tokens after its first: (10.8 - 10.5) / 2; choice 1 has none.
    assert sample(metrics, "epd:request_time_per_output_token_seconds_count") == 1
    assert sample(metrics, "epd:request_time_per_output_token_seconds_sum") == pytest.approx(0.15)
    assert sample(metrics, "epd:request_decode_time_seconds_sum") == pytest.approx(0.3)
    assert sample(metrics, "epd:e2e_request_latency_seconds_sum") == pytest.approx(0.9)
    assert sample(metrics, "epd:request_prompt_tokens_sum") == 40
    assert sample(metrics, "epd:request_prompt_tokens_bucket", le="50.0") == 1
    assert sample(metrics, "epd:request_prompt_tokens_bucket", le="20.0") == 0
    assert sample(metrics, "epd:request_generation_tokens_sum") == 4
    assert sample(metrics, "epd:generation_tokens_total") == 4
    assert sample(metrics, "epd:request_success_total", finished_reason="length") == 1


def test_a_first_delta_of_several_tokens_counts_them_as_first():
    metrics = PrefillMetrics("kimi")
    timeline = Timeline(arrived=0.0)
    deltas(metrics, timeline, (0, 2, 1.0), (0, 4, 1.2))
    metrics.ended(timeline, prompt_tokens=3, reason="stop", now=1.2)
    assert sample(metrics, "epd:request_time_per_output_token_seconds_sum") == pytest.approx(0.1)


def test_a_failed_request_counts_its_tokens_but_no_request_histogram():
    metrics = PrefillMetrics("kimi")
    timeline = Timeline(arrived=0.0)
    deltas(metrics, timeline, (0, 1, 1.0), (0, 2, 1.1))
    metrics.ended(timeline, prompt_tokens=3, reason="", now=2.0)
    assert sample(metrics, "epd:generation_tokens_total") == 2
    for name in (
        "e2e_request_latency_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert sample(metrics, f"epd:{name}_count") == 0, name


def test_a_request_with_no_token_has_no_decode_time():
    """One whose client left before its first token: vLLM's abort, with no token times."""
    metrics = PrefillMetrics("kimi")
    metrics.ended(Timeline(arrived=0.0), prompt_tokens=3, reason="abort", now=1.0)
    assert sample(metrics, "epd:e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "epd:request_generation_tokens_sum") == 0
    assert sample(metrics, "epd:request_decode_time_seconds_count") == 0


def test_a_decoder_no_longer_used_loses_its_kv_cache_series():
    metrics = PrefillMetrics("kimi")
    metrics.watch_peer("decode", "tcp://d1:7103", lambda address: True)
    metrics.decoder_reported("tcp://d1:7103", 0.5)
    metrics.decoder_reported("tcp://d1:7103", 0.75)  # the latest report stands
    assert sample(metrics, "epd:kv_cache_usage_perc", decoder="tcp://d1:7103") == 0.75
    metrics.forget_peer("decode", "tcp://d1:7103")
    assert sample(metrics, "epd:kv_cache_usage_perc", decoder="tcp://d1:7103") is None
