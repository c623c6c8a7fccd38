"""The decode loop: whatever fails, every admitted request ends with its last delta or a Failure."""

import itertools
import random
import time

import msgspec
import pytest
import torch
import zmq

from epd.config.roles import DecodeConfig
from epd.config.speculative import SpeculativeConfig
from epd.decode.scheduler import Scheduler
from epd.decode.server import DecodeServer, load_scheduler
from epd.generation.params import SamplingParams
from epd.wire.addresses import Prefills
from epd.wire.codec import decode
from epd.wire.messages import Failure, TokenDelta
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox


@pytest.fixture(scope="module")
def model(parts):
    """The tiny checkpoint's parts (conftest's `parts`), under this module's older name."""
    return parts


@pytest.fixture
def wiring(model, tmp_path):
    """Makes a decode server on ipc sockets, its scheduler made with these options, and the
    prefill end of its wire: the server, send, a hand-off maker and a receiver."""
    lm, tokenizer, engine, eos = model
    here, decoder = f"ipc://{tmp_path}/prefill", f"ipc://{tmp_path}/decode"
    context = zmq.Context()
    sockets = []

    def wire(**options):
        scheduler = Scheduler(lm, tokenizer, eos, **({"max_batch_size": 2} | options))
        server = DecodeServer(
            scheduler, Inbox(context, decoder), Outbox(context), Prefills.parse((here,)), "tiny"
        )
        prefill = context.socket(zmq.PULL)
        prefill.bind(here)
        to_decode = Outbox(context, [decoder])
        sockets.extend((server.inbox, server.outbox, to_decode))
        sockets.append(prefill)
        deadline = time.monotonic() + 3
        while not to_decode.is_up(decoder) and time.monotonic() < deadline:
            time.sleep(0.01)

        def handoff(
            request_id, max_tokens=4, reply_to=here, prompt=(5, 6, 7), params=None, **changes
        ):
            params = params or SamplingParams(max_tokens, temperature=0)
            made = engine.run(request_id, list(prompt), None, params, reply_to).handoff
            return msgspec.structs.replace(made, **changes)

        def received(timeout_ms=3000):
            server.outbox.poll()  # a first reply waits for the connection to come up
            deadline = time.monotonic() + timeout_ms / 1000
            while time.monotonic() < deadline:
                server.outbox.poll()
                if prefill.poll(10):
                    return decode(prefill.recv_multipart())
            return None

        return server, lambda m: to_decode.send(decoder, m), handoff, received

    yield wire
    for socket in sockets:
        socket.close(linger=0) if isinstance(socket, zmq.Socket) else socket.close()
    context.destroy(linger=0)


@pytest.fixture
def wired(wiring):
    return wiring()


def step_until(server, done, steps=100):
    """Step until `done()`: messages sent just before may take a step or two to arrive."""
    for _ in range(steps):
        server.step()
        if done():
            return
    raise AssertionError("the server never got there")


def test_bad_handoff_gets_a_failure_and_the_server_goes_on(wired):
    server, send, handoff, received = wired
    send(handoff("bad", cache=torch.zeros(1, 3, 5)))
    send(handoff("good"))
    step_until(server, lambda: len(server.scheduler) == 1)
    failure = received()
    assert isinstance(failure, Failure) and failure.request_id == "bad"
    assert "KV cache of shape (1, 3, 5)" in failure.message
    first = received()
    assert isinstance(first, TokenDelta) and first.request_id == "good"


def test_decode_sends_the_tokens_after_the_first_which_prefill_sent(wired):
    """A hand-off whose first tokens ended it (prefill keeps those) gets no word at all."""
    server, send, handoff, received = wired
    ended = handoff("ended", max_tokens=2, sampling=SamplingParams(1, temperature=0))
    send(ended)
    send(handoff("two", max_tokens=2))  # taken after the first: one connection keeps order
    replies = []
    step_until(server, lambda: replies.append(received(timeout_ms=20)) or replies[-1])
    delta = replies[-1]
    assert isinstance(delta, TokenDelta) and delta.request_id == "two"
    assert delta.completion_tokens == 2 and delta.finish_reason == "length"
    assert delta.kv_cache_usage == 0  # its blocks went back before its last delta was sent
    assert received(timeout_ms=200) is None and server.reply_to == {}


def test_a_reply_address_that_is_not_a_prefill_of_this_decoder_is_refused(wired, tmp_path, caplog):
    server, send, handoff, _ = wired
    send(handoff("forged", reply_to=f"ipc://{tmp_path}/elsewhere"))
    step_until(server, lambda: "not a prefill of this decoder" in caplog.text)
    assert len(server.scheduler) == 0 and server.outbox.peers == {}


def test_failing_step_fails_the_batch_not_the_process(wired, monkeypatch):
    server, send, handoff, received = wired
    send(handoff("r1", max_tokens=50))
    step_until(server, lambda: len(server.scheduler) == 1)
    delta = received()
    assert isinstance(delta, TokenDelta)  # one step (the first token is prefill's)
    assert delta.kv_cache_usage == server.kv_cache_usage() > 0  # said with every delta

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(server.scheduler.lm, "decode", broken)
    server.step()
    failure = received()
    assert isinstance(failure, Failure) and "device lost" in failure.message
    assert len(server.scheduler) == 0


def test_waiting_requests_are_failed_too_never_lost(wired, monkeypatch):
    server, send, handoff, received = wired
    for i in range(3):  # a batch holds two; the third waits
        send(handoff(f"r{i}", max_tokens=50))
    step_until(server, lambda: len(server.scheduler) == 3)
    assert len(server.scheduler.running) == 2 and len(server.scheduler.waiting) == 1

    def bug():
        raise RuntimeError("a scheduler bug")

    monkeypatch.setattr(server.scheduler, "step", bug)
    server.step()
    ends = {}
    while (message := received(timeout_ms=500)) is not None:
        if isinstance(message, Failure):
            ends[message.request_id] = message.message
    assert ends == {f"r{i}": "decode failed: RuntimeError: a scheduler bug" for i in range(3)}


def test_every_admitted_request_ends_exactly_once_whatever_fails(wired):
    """Every third forward fails; each request still gets one last delta or one Failure."""
    server, send, handoff, received = wired
    chance, calls = random.Random(0), itertools.count()
    forward = server.scheduler._forward

    def flaky(batch, drafts):
        if next(calls) % 3 == 2:
            raise RuntimeError("flaky device")
        return forward(batch, drafts)

    server.scheduler._forward = flaky
    for i in range(6):
        send(handoff(f"r{i}", max_tokens=chance.randint(2, 6)))
    ends: dict[str, list[str]] = {}
    for _ in range(40):
        server.step()
        while (message := received(timeout_ms=20)) is not None:
            last = isinstance(message, Failure) or message.finish_reason is not None
            if last:
                ends.setdefault(message.request_id, []).append(type(message).__name__)
    assert sorted(ends) == [f"r{i}" for i in range(6)]
    assert all(len(kinds) == 1 for kinds in ends.values())
    assert "Failure" in {k for kinds in ends.values() for k in kinds}


def test_stopping_fails_what_is_still_held(wired):
    server, send, handoff, received = wired
    send(handoff("held", max_tokens=50))
    step_until(server, lambda: len(server.scheduler) == 1)
    assert isinstance(received(), TokenDelta)
    server.fail_all("unavailable", "decode stopped")
    while isinstance(message := received(timeout_ms=500), TokenDelta):
        pass
    assert isinstance(message, Failure) and message.code == "unavailable"


def test_the_kv_budget_reaches_the_scheduler_and_its_use_is_measured(
    model, tiny_checkpoint, tmp_path
):
    lm, tokenizer, engine, eos = model
    config = DecodeConfig(model=str(tiny_checkpoint), max_batch_size=3, max_kv_tokens=48)
    loaded = load_scheduler(config)
    assert (loaded.pool.max_tokens, loaded.max_batch_size) == (48, 3)
    context = zmq.Context()
    scheduler = Scheduler(lm, tokenizer, eos, max_kv_tokens=48)  # 3 blocks of 16
    server = DecodeServer(
        scheduler,
        Inbox(context, f"ipc://{tmp_path}/d"),
        Outbox(context),
        Prefills.parse(()),
        "tiny",
    )

    def sample(name):
        return server.registry.get_sample_value(name, {"model_name": "tiny", "role": "decode"})

    try:
        for name in ("a", "b"):  # 3 + 20 rows each: two blocks, four together
            scheduler.add(
                engine.run(name, [5, 6, 7], None, SamplingParams(20, temperature=0)).handoff
            )
        server.step()
        assert sample("epd:kv_cache_usage_perc") == pytest.approx(2 / 3)  # a block each
        while len(scheduler):
            server.step()
        # a took its second block; b needed one too and went back to wait until a was done
        assert sample("epd:num_preemptions_total") == 1
        assert sample("epd:kv_cache_usage_perc") == 0
    finally:
        server.inbox.close(), server.outbox.close()
        context.destroy(linger=0)


def test_a_request_larger_than_the_kv_budget_is_the_clients_to_change(wired):
    server, send, handoff, received = wired
    server.scheduler.pool.max_blocks = 3  # 32 tokens
    send(handoff("large", max_tokens=30))  # 3 prompt tokens + 30
    send(handoff("fits", max_tokens=29))
    step_until(server, lambda: len(server.scheduler) == 1)
    failure = received()
    assert isinstance(failure, Failure) and failure.request_id == "large"
    assert failure.code == "bad_request" and "KV cache of 32 tokens" in failure.message


def test_a_step_takes_the_idle_cores_only_while_the_others_leave_them(wired):
    server, send, handoff, _ = wired
    server.threads, server.alone_threads = 1, 2
    idle = [True]
    server.others_idle = lambda: idle[0]
    told: list[bool] = []
    server.others_idle.assume_idle = lambda: told.append(True)  # type: ignore[attr-defined]
    before = torch.get_num_threads()
    try:
        server.use_threads()
        assert torch.get_num_threads() == 1  # nothing running: its share
        send(handoff("r1", max_tokens=8))
        server.take_messages()
        server.use_threads()  # r1 joins in this step, its first: the cores from the start
        assert torch.get_num_threads() == 2
        assert told == [True]  # a decoder with nothing: its prefill's work was for r1
        server.scheduler.step()
        server.use_threads()
        assert torch.get_num_threads() == 2
        idle[0] = False  # prefill took a new request
        server.use_threads()
        assert torch.get_num_threads() == 1
        send(handoff("r2"))
        deadline = time.monotonic() + 5  # with r1 running, a take does not wait for arrivals
        while "r2" not in server.scheduler and time.monotonic() < deadline:
            server.take_messages()
        assert "r2" in server.scheduler
        assert told == [True]  # r1 ran: the others' busy window is not r2's prefill alone
        server.drop("r1"), server.drop("r2")
        send(handoff("r3"))  # to a decoder with nothing again
        while "r3" not in server.scheduler and time.monotonic() < deadline:
            server.take_messages()
        assert told == [True, True]
    finally:
        torch.set_num_threads(before)


def test_drafts_are_counted_by_vllms_names_and_health_gives_the_acceptance_rate(wiring):
    server, send, handoff, received = wiring(speculative=SpeculativeConfig("ngram", 3, 2, 1))
    assert server.status()["speculative"]["acceptance_rate"] is None  # nothing drafted yet
    biased = SamplingParams(20, temperature=0, logit_bias=((42, 9.0),))  # 42 42 42 …
    send(handoff("r", params=biased))  # drafts: the 42s before
    tokens = []
    step_until(server, lambda: len(server.scheduler) == 1)
    while len(server.scheduler):
        server.step()
    while (delta := received(timeout_ms=200)) is not None:
        tokens += delta.token_ids
    assert tokens == [42] * 19  # the first is prefill's
    status = server.status()["speculative"]
    metric = server.metrics.unlabelled.get_sample_value
    drafted, kept = (
        metric("epd:spec_decode_num_draft_tokens_total"),
        metric("epd:spec_decode_num_accepted_tokens_total"),
    )
    assert (status["draft_tokens"], status["accepted_tokens"]) == (drafted, kept)
    assert kept == drafted and status["acceptance_rate"] == 1.0  # every draft 42, all kept
    assert metric("epd:spec_decode_num_drafts_total") < 19 / 2  # 3 drafts + 1 a step, mostly
    by_position = [
        metric("epd:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(i)})
        for i in range(3)
    ]
    assert sum(by_position) == kept and by_position[0] >= by_position[2]
