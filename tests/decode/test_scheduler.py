"""Continuous batching: joins and leaves between steps, each request as if alone."""

import pytest

from epd.checkpoint.config import load_generation_config, load_model_config
from epd.checkpoint.tokenizer import load_tokenizer
from epd.checkpoint.weights import load_model
from epd.decode.scheduler import Scheduler
from epd.prefill.engine import PrefillEngine
from epd.wire.messages import SamplingParams

PROMPTS = [[5, 17, 42, 99], [7, 300, 12, 64, 128, 3, 250], [31, 77]]


@pytest.fixture(scope="module")
def parts(tiny_checkpoint):
    lm = load_model(tiny_checkpoint, role="language").language_model
    tokenizer = load_tokenizer(tiny_checkpoint)
    engine = PrefillEngine(
        lm, tokenizer, load_model_config(tiny_checkpoint).media_placeholder_token_id
    )
    return lm, tokenizer, engine, load_generation_config(tiny_checkpoint).eos_token_ids


def handoff(engine, i, max_tokens=12):
    return engine.run(f"r{i}", PROMPTS[i], None, SamplingParams(max_tokens, temperature=0))


def run_alone(parts, i, max_tokens=12):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    tokens = list(scheduler.add(handoff(engine, i, max_tokens))[1].token_ids)
    while len(scheduler):
        tokens += [t for _, d in scheduler.step() for t in d.token_ids]
    return tokens


def test_requests_joining_mid_flight_match_running_alone(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    produced: dict[str, list[int]] = {}

    def record(pairs):
        for sequence, delta in pairs:
            produced.setdefault(sequence.request_id, []).extend(delta.token_ids)

    record([scheduler.add(handoff(engine, 0))])
    record(scheduler.step())
    record(scheduler.step())
    record([scheduler.add(handoff(engine, 1)), scheduler.add(handoff(engine, 2, max_tokens=3))])
    sizes = []
    while len(scheduler):
        sizes.append(len(scheduler.running) + len(scheduler.waiting))
        record(scheduler.step())
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
    assert list(scheduler.running) == ["r1"]
    assert all(s.request_id == "r1" for s, _ in scheduler.step())


def test_batch_size_limit_queues_the_rest(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos, max_batch_size=2)
    for i in range(3):
        scheduler.add(handoff(engine, i))
    assert len(scheduler.step()) == 2 and len(scheduler.waiting) == 1
    scheduler.abort("r0")
    assert {s.request_id for s, _ in scheduler.step()} == {"r1", "r2"}


def test_first_token_can_finish_a_request(parts):
    lm, tokenizer, engine, eos = parts
    scheduler = Scheduler(lm, tokenizer, eos)
    _, delta = scheduler.add(handoff(engine, 0, max_tokens=1))
    assert delta.finish_reason == "length" and len(scheduler) == 0
