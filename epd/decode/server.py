"""`epd decode`: take KV hand-offs, run continuous batching, stream TokenDeltas back."""

from __future__ import annotations

import logging

import zmq

from epd.checkpoint.tokenizer import load_tokenizer, stop_token_ids
from epd.checkpoint.weights import load_model
from epd.config.roles import DecodeConfig
from epd.decode.scheduler import Scheduler
from epd.dtypes import model_dtype
from epd.process import HealthServer, announce_ready, setup_logging, stop_event
from epd.wire.messages import Abort, Failure, KVHandoff, TokenDelta
from epd.wire.transport import Inbox, Outbox

log = logging.getLogger(__name__)
REPLY_CONNECT_MS = 2000


class DecodeServer:
    def __init__(self, scheduler: Scheduler, inbox: Inbox, outbox: Outbox) -> None:
        self.scheduler, self.inbox, self.outbox = scheduler, inbox, outbox

    def take_messages(self) -> None:
        """Drain the inbox; block briefly only when there is nothing to decode."""
        timeout = 0 if len(self.scheduler) else 100
        while (message := self.inbox.recv(timeout_ms=timeout)) is not None:
            timeout = 0
            if isinstance(message, KVHandoff):
                self.admit(message)
            elif isinstance(message, Abort):
                if self.scheduler.abort(message.request_id):
                    log.info("aborted %s: its client went away", message.request_id)
            else:
                log.error("ignored a %s: decode takes KVHandoff and Abort", type(message).__name__)

    def admit(self, handoff: KVHandoff) -> None:
        try:
            sequence, delta = self.scheduler.add(handoff)
        except Exception as e:  # a bad hand-off fails its own request, never the server
            log.exception("refused the hand-off of %s", handoff.request_id)
            failure = Failure(handoff.request_id, "bad_handoff", f"decode refused the request: {e}")
            self.outbox.send(handoff.reply_to, failure, wait_ms=REPLY_CONNECT_MS)
            return
        self.reply(sequence.reply_to, delta)

    def reply(self, address: str, delta: TokenDelta) -> None:
        """Send a delta; a prefill that cannot be reached any more takes its request with it."""
        if not self.outbox.send(address, delta, wait_ms=REPLY_CONNECT_MS):
            log.warning("%s is unreachable: dropping %s", address, delta.request_id)
            self.scheduler.abort(delta.request_id)

    def step(self) -> None:
        self.take_messages()
        try:
            produced = self.scheduler.step()
        except Exception as e:  # fail the batch's requests, keep the process (and the queue)
            log.exception("a decode step failed")
            for sequence in list(self.scheduler.running.values()):
                message = f"decode failed: {type(e).__name__}: {e}"
                self.outbox.send(
                    sequence.reply_to, Failure(sequence.request_id, "internal", message)
                )
                self.scheduler.abort(sequence.request_id)
            return
        for sequence, delta in produced:
            self.reply(sequence.reply_to, delta)


def run(config: DecodeConfig) -> None:
    setup_logging("decode")
    stop = stop_event()
    model = load_model(config.model, "language", config.device, model_dtype(config.dtype))
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    eos_ids = stop_token_ids(config.model, tokenizer)
    scheduler = Scheduler(model.language_model, tokenizer, eos_ids, config.max_batch_size)
    context: zmq.Context = zmq.Context.instance()
    server = DecodeServer(scheduler, Inbox(context, config.bind), Outbox(context))
    health = HealthServer(
        "decode",
        config.health_host,
        config.health_port,
        lambda: {"running": len(scheduler.running), "waiting": len(scheduler.waiting)},
    )
    announce_ready("decode", zmq=config.bind, health=health.url)
    try:
        while not stop.is_set():
            server.step()
    finally:
        health.close()
        server.inbox.close()
        server.outbox.close()
