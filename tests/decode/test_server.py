"""The decode loop: a bad hand-off or a failing step fails its requests, not the server."""

import dataclasses

import pytest
import torch
import zmq

from epd.checkpoint.config import load_generation_config, load_model_config
from epd.checkpoint.tokenizer import load_tokenizer
from epd.checkpoint.weights import load_model
from epd.decode.scheduler import Scheduler
from epd.decode.server import DecodeServer
from epd.prefill.engine import PrefillEngine
from epd.wire.codec import decode
from epd.wire.messages import Failure, SamplingParams, TokenDelta
from epd.wire.transport import Inbox, Outbox


@pytest.fixture
def wired(tiny_checkpoint, tmp_path):
    lm = load_model(tiny_checkpoint, role="language").language_model
    tokenizer = load_tokenizer(tiny_checkpoint)
    scheduler = Scheduler(lm, tokenizer, load_generation_config(tiny_checkpoint).eos_token_ids)
    engine = PrefillEngine(
        lm, tokenizer, load_model_config(tiny_checkpoint).media_placeholder_token_id
    )
    context = zmq.Context()
    server = DecodeServer(scheduler, Inbox(context, f"ipc://{tmp_path}/decode"), Outbox(context))
    prefill = context.socket(zmq.PULL)
    prefill.bind(f"ipc://{tmp_path}/prefill")
    to_decode = Outbox(context)
    to_decode.connect(f"ipc://{tmp_path}/decode", wait_ms=2000)

    def handoff(request_id, **changes):
        sampling = SamplingParams(4, temperature=0)
        made = engine.run(request_id, [5, 6, 7], None, sampling, f"ipc://{tmp_path}/prefill")
        return dataclasses.replace(made, **changes)

    def received():
        assert prefill.poll(3000)
        return decode(prefill.recv_multipart())

    yield server, lambda m: to_decode.send(f"ipc://{tmp_path}/decode", m), handoff, received
    server.inbox.close(), server.outbox.close(), to_decode.close(), prefill.close(linger=0)
    context.term()


def test_bad_handoff_gets_a_failure_and_the_server_goes_on(wired):
    server, send, handoff, received = wired
    send(handoff("bad", cache=torch.zeros(1, 3, 5)))
    send(handoff("good"))
    server.step()
    failure = received()
    assert isinstance(failure, Failure) and failure.request_id == "bad"
    assert "KV cache of shape (1, 3, 5)" in failure.message
    first = received()
    assert isinstance(first, TokenDelta) and first.request_id == "good"


def test_failing_step_fails_the_batch_not_the_process(wired, monkeypatch):
    server, send, handoff, received = wired
    send(handoff("r1"))
    server.step()
    assert isinstance(received(), TokenDelta)  # the first token
    assert isinstance(received(), TokenDelta)  # one step

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(server.scheduler.lm, "decode", broken)
    server.step()
    failure = received()
    assert isinstance(failure, Failure) and "device lost" in failure.message
    assert len(server.scheduler) == 0
