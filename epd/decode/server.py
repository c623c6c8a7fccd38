"""`epd decode`: take KV hand-offs, run continuous batching, stream TokenDeltas back.

Every admitted request ends with its final delta or a Failure, whatever fails: a bad hand-off,
one sequence's step, the whole step, or the process being stopped. Only a request whose client
or prefill is gone ends without a word, since nobody is left to hear it.
"""

from __future__ import annotations

import logging

import zmq

from epd.checkpoint.config import load_model_config
from epd.checkpoint.tokenizer import load_tokenizer, stop_token_ids
from epd.checkpoint.weights import load_model
from epd.config.roles import DecodeConfig
from epd.decode.scheduler import Scheduler
from epd.dtypes import model_dtype
from epd.generation.sequence import Sequence
from epd.process import (
    HealthServer,
    Watchdog,
    announce_ready,
    follow_supervisor,
    setup_logging,
    stop_event,
)
from epd.wire.messages import Abort, Failure, KVHandoff, TokenDelta
from epd.wire.transport import Inbox, Outbox, WireProbe, reply_allowed

log = logging.getLogger(__name__)
HEADER_SLACK_BYTES = 1 << 20


class DecodeServer:
    def __init__(
        self,
        scheduler: Scheduler,
        inbox: Inbox,
        outbox: Outbox,
        prefills: tuple[str, ...] = ("*",),
    ) -> None:
        self.scheduler, self.inbox, self.outbox, self.prefills = scheduler, inbox, outbox, prefills

    def take_messages(self) -> None:
        """Drain the inbox; block briefly only when there is nothing to decode."""
        timeout = 0 if len(self.scheduler) else (10 if self.outbox.pending else 100)
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
        if not reply_allowed(handoff.reply_to, self.prefills):
            log.error(
                "refused %s: %r is not a prefill of this decoder",
                handoff.request_id,
                handoff.reply_to,
            )
            return
        try:
            sequence, delta = self.scheduler.add(handoff)
        except Exception as e:  # a bad hand-off fails its own request, never the server
            log.warning("refused the hand-off of %s: %s", handoff.request_id, e)
            failure = Failure(handoff.request_id, "bad_handoff", f"decode refused the request: {e}")
            self.outbox.send(handoff.reply_to, failure)
            return
        self.reply(sequence, delta)

    def reply(self, sequence: Sequence, message: TokenDelta | Failure) -> None:
        """Send to the request's prefill; one that cannot take it takes its request with it."""
        if not self.outbox.send(sequence.reply_to, message):
            log.warning("%s is unreachable: dropping %s", sequence.reply_to, sequence.request_id)
            self.scheduler.abort(sequence.request_id)

    def forget(self, prefill: str) -> None:
        """A prefill that went away: nobody waits for its requests any more."""
        held = [
            s
            for s in [*self.scheduler.running.values(), *self.scheduler.waiting]
            if s.reply_to == prefill
        ]
        for sequence in held:
            self.scheduler.abort(sequence.request_id)
        if held:
            log.warning("lost %s: dropped its %d requests", prefill, len(held))

    def fail_all(self, code: str, message: str) -> None:
        for sequence in self.scheduler.drain():
            self.outbox.send(sequence.reply_to, Failure(sequence.request_id, code, message))

    def step(self) -> None:
        for prefill in self.outbox.poll():
            self.forget(prefill)
        self.take_messages()
        try:
            step = self.scheduler.step()
        except Exception as e:  # not any one request's fault: fail them all, keep the process
            log.exception("a decode step failed")
            self.fail_all("internal", f"decode failed: {type(e).__name__}: {e}")
            return
        for sequence, delta in step.produced:
            self.reply(sequence, delta)
        for sequence, problem in step.failed:
            self.reply(sequence, Failure(sequence.request_id, "internal", problem))


def largest_frame(checkpoint: str) -> int:
    """Bytes of the largest legitimate frame: a float32 cache of a whole context."""
    text = load_model_config(checkpoint).text
    cache = text.num_hidden_layers * text.max_position_embeddings * text.latent_dim * 4
    return cache + HEADER_SLACK_BYTES


def run(config: DecodeConfig) -> None:
    setup_logging("decode")
    stop = stop_event()
    follow_supervisor()
    model = load_model(config.model, "language", config.device, model_dtype(config.dtype))
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    eos_ids = stop_token_ids(config.model, tokenizer)
    scheduler = Scheduler(model.language_model, tokenizer, eos_ids, config.max_batch_size)
    context: zmq.Context = zmq.Context.instance()
    inbox = Inbox(context, config.bind, largest_frame(config.model))
    server = DecodeServer(scheduler, inbox, Outbox(context), config.prefills)
    watchdog = Watchdog(config.watchdog_s)
    probe = WireProbe(context, lambda: watchdog.beat("wire"))
    health = HealthServer(
        "decode",
        config.health_host,
        config.health_port,
        watchdog,
        lambda: {"running": len(scheduler.running), "waiting": len(scheduler.waiting)},
    )
    announce_ready("decode", zmq=config.bind, health=health.url)
    try:
        while not stop.is_set():
            watchdog.beat("loop")
            server.step()
    finally:
        server.fail_all("unavailable", "decode stopped before this request finished")
        watchdog.close()
        health.close()
        probe.close()
        server.inbox.close()
        server.outbox.close(linger_ms=500)
