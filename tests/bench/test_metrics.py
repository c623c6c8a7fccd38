"""The bench's arithmetic: throughput, TTFT, TPOT, ITL, goodput, from known timings."""

import json

import pytest

from epd.bench.client import Timing, read
from epd.bench.metrics import summarise, table


def timing(start, first, end, chunks, tokens, prompt=10):
    return Timing(start, first, end, chunks, prompt, tokens)


def test_summary_of_two_requests():
    timings = [
        timing(0.0, 0.1, 1.1, [0.1, 0.6, 1.1], tokens=3),  # TPOT 0.5 s
        timing(0.0, 0.3, 0.5, [0.3, 0.4, 0.5], tokens=3),  # TPOT 0.1 s
        Timing(0.2, error="HTTP 500: boom"),
    ]
    summary = summarise(timings, ttft_target_ms=200, tpot_target_ms=0)
    assert summary.completed == 2 and summary.failed == 1
    assert summary.duration_s == pytest.approx(1.1)
    assert summary.output_throughput == pytest.approx(6 / 1.1)
    assert summary.request_throughput == pytest.approx(2 / 1.1)
    assert summary.ttft_ms["mean"] == pytest.approx(200)
    assert summary.tpot_ms["p50"] == pytest.approx(300)
    assert summary.itl_ms["mean"] == pytest.approx((0.5 + 0.5 + 0.1 + 0.1) / 4 * 1000)
    assert summary.goodput == pytest.approx(1 / 1.1)  # only the first met TTFT ≤ 200 ms


def test_no_targets_no_goodput_and_nothing_done_is_zero():
    summary = summarise([Timing(0.0, error="refused")], 0, 0)
    assert summary.goodput is None and summary.completed == 0 and summary.output_throughput == 0
    assert summary.ttft_ms == {}


def test_stream_lines_are_read_as_openai_sends_them():
    t = Timing(0.0)
    read('data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}', t, 0.1)
    read('data: {"choices": [{"delta": {"content": "Hi"}}]}', t, 0.2)
    read('data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}', t, 0.3)
    read("data: [DONE]", t, 0.4)
    assert (
        t.first_token == 0.2 and t.chunks == [0.2] and (t.prompt_tokens, t.output_tokens) == (7, 2)
    )
    read('data: {"error": {"message": "decode lost"}}', t, 0.5)
    assert t.error == "decode lost"


def test_lines_from_other_servers():
    t = Timing(0.0)
    read('data:{"choices": [{"delta": {"content": "x"}}]}', t, 0.1)  # no space after "data:"
    assert t.chunks == [0.1]
    read(": a comment line", t, 0.2)
    read('data: {"error": "overloaded"}', t, 0.3)  # an error that is a plain string
    assert t.error == "overloaded"
    with pytest.raises(ValueError):
        read("data: not json", t, 0.4)  # stream() records it as the request's error


def test_ttft_is_given_turn_by_turn_for_conversations():
    timings = [
        Timing(0.0, first_token=1.0, end=2.0, output_tokens=2, turn=0),
        Timing(2.0, first_token=2.2, end=3.0, output_tokens=2, turn=1),
        Timing(0.0, first_token=3.0, end=4.0, output_tokens=2, turn=0),
        Timing(4.0, first_token=4.4, end=5.0, output_tokens=2, turn=1),
    ]
    summary = summarise(timings, 0, 0)
    assert summary.ttft_by_turn_ms == pytest.approx({1: 2000.0, 2: 300.0})
    assert "TTFT p50 by turn (ms)       1: 2000.0  2: 300.0" in table(summary)
    assert summarise(timings[:1], 0, 0).ttft_by_turn_ms == {}


def test_the_prompt_tokens_served_from_cache_are_read_from_usage_and_summed():
    t = Timing(0.0)
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    read('data: {"choices": [{"delta": {"content": "Hi"}}]}', t, 0.1)
    read("data: " + json.dumps({"choices": [], "usage": usage}), t, 0.2)
    t.end = 0.3
    cold = Timing(0.0, first_token=0.1, end=0.2, prompt_tokens=60, output_tokens=2)
    summary = summarise([t, cold], 0, 0)
    assert t.cached_tokens == 32 and summary.cached_prompt_share == pytest.approx(32 / 100)
    assert "prompt tokens from cache    32.0%" in table(summary)
