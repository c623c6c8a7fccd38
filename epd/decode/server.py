"""`epd decode`: take KV hand-offs, run continuous batching, stream TokenDeltas back.

Every admitted request ends with its final delta or a Failure, whatever fails: a bad hand-off,
one sequence's step, the whole step, its prefill disconnecting or not taking its tokens, or the
process being stopped. (A Failure for a prefill that is gone waits for it to come back, briefly.)
Only a request aborted by its prefill, whose client left, ends without a word.
"""

from __future__ import annotations

import logging
import time

import zmq

from epd.checkpoint.config import load_model_config
from epd.checkpoint.tokenizer import load_tokenizer, stop_token_ids
from epd.checkpoint.weights import load_model
from epd.config.roles import DecodeConfig
from epd.decode.scheduler import Busy, Scheduler
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
from epd.wire.addresses import Prefills
from epd.wire.limits import cut
from epd.wire.messages import Abort, Failure, KVHandoff, TokenDelta
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox, WireProbe

log = logging.getLogger(__name__)
INTAKE_S = 0.005  # most time one step spends taking messages while requests are decoding


class DecodeServer:
    def __init__(
        self, scheduler: Scheduler, inbox: Inbox, outbox: Outbox, prefills: Prefills
    ) -> None:
        self.scheduler, self.inbox, self.outbox, self.prefills = scheduler, inbox, outbox, prefills

    def take_messages(self) -> None:
        """Take what arrived, for at most INTAKE_S; wait briefly only when there is nothing to do.

        The bound keeps a flood of messages from holding up the step of everything running.
        """
        timeout = 0 if len(self.scheduler) else (10 if self.outbox.queued else 100)
        deadline = time.monotonic() + INTAKE_S + timeout / 1000
        while time.monotonic() < deadline:
            message = self.inbox.recv(timeout_ms=timeout)
            if message is None:
                return
            timeout = 0
            if isinstance(message, KVHandoff):
                self.admit(message)
            elif isinstance(message, Abort):
                if self.scheduler.abort(message.request_id):
                    log.info("aborted %s: its client went away", message.request_id)
            else:
                log.error("ignored a %s: decode takes KVHandoff and Abort", type(message).__name__)

    def admit(self, handoff: KVHandoff) -> None:
        if not self.prefills.allows(handoff.reply_to):
            log.error(
                "refused %s: %r is not a prefill of this decoder",
                handoff.request_id,
                handoff.reply_to,
            )
            return
        if handoff.request_id in self.scheduler:  # a Failure would end the request in flight
            log.error("ignored a second hand-off of %s", handoff.request_id)
            return
        try:
            sequence, delta = self.scheduler.add(handoff)
        except Exception as e:  # a bad hand-off fails its own request, never the server
            log.warning("refused the hand-off of %s: %s", handoff.request_id, e)
            code = "unavailable" if isinstance(e, Busy) else "bad_handoff"
            why = cut(f"decode refused the request: {e}")
            self.outbox.send(handoff.reply_to, Failure(handoff.request_id, code, why))
            return
        self.reply(sequence, delta)

    def reply(self, sequence: Sequence, message: TokenDelta | Failure) -> None:
        """Send to the request's prefill; one that cannot take it takes its request with it."""
        if not self.outbox.send(sequence.reply_to, message):
            log.warning("%s is unreachable: dropping %s", sequence.reply_to, sequence.request_id)
            self.scheduler.abort(sequence.request_id)

    def fail(self, sequences: list[Sequence], code: str, message: str) -> None:
        """End these requests with a Failure (queued if their prefill is reconnecting)."""
        for sequence in sequences:
            self.scheduler.abort(sequence.request_id)
            self.outbox.send(sequence.reply_to, Failure(sequence.request_id, code, cut(message)))

    def check_peers(self) -> None:
        """Requests whose prefill disconnected, or whose tokens it did not take, end here."""
        losses = self.outbox.poll()
        for prefill in losses.peers:
            held = [s for s in self.scheduler.sequences() if s.reply_to == prefill]
            if held:
                log.warning("lost %s: failing its %d requests", prefill, len(held))
            self.fail(held, "unavailable", f"decode lost its connection to {prefill}")
        undelivered = {request_id for _, request_id in losses.requests}
        stuck = [s for s in self.scheduler.sequences() if s.request_id in undelivered]
        self.fail(stuck, "unavailable", "tokens of this request could not be delivered in time")

    def step(self) -> None:
        self.check_peers()
        self.take_messages()
        try:
            step = self.scheduler.step()
        except Exception as e:  # not any one request's fault: fail them all, keep the process
            log.exception("a decode step failed")
            self.fail(self.scheduler.drain(), "internal", f"decode failed: {type(e).__name__}: {e}")
            return
        for sequence, delta in step.produced:
            self.reply(sequence, delta)
        for sequence, problem in step.failed:
            self.reply(sequence, Failure(sequence.request_id, "internal", cut(problem)))


def largest_frame(checkpoint: str) -> int:
    """Bytes of the largest legitimate frame: a float32 cache of a whole context."""
    text = load_model_config(checkpoint).text
    return text.num_hidden_layers * text.max_position_embeddings * text.latent_dim * 4


def run(config: DecodeConfig) -> None:
    setup_logging("decode")
    stop = stop_event()
    follow_supervisor()
    prefills = Prefills.parse(config.prefills)
    model = load_model(config.model, "language", config.device, model_dtype(config.dtype))
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    eos_ids = stop_token_ids(config.model, tokenizer)
    scheduler = Scheduler(model.language_model, tokenizer, eos_ids, config.max_batch_size)
    context: zmq.Context = zmq.Context.instance()
    inbox = Inbox(context, config.bind, largest_frame(config.model))
    server = DecodeServer(scheduler, inbox, Outbox(context), prefills)
    watchdog = Watchdog(config.watchdog_s)
    probe = WireProbe(context, lambda: watchdog.beat("wire"))
    health = HealthServer(
        "decode",
        config.health_host,
        config.health_port,
        watchdog,
        lambda: {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "refused_messages": inbox.refusals.total,
        },
    )
    announce_ready("decode", zmq=config.bind, health=health.url)
    try:
        while not stop.is_set():
            watchdog.beat("loop")
            try:
                server.step()
            except Exception:  # a bug in one step must not end the server
                log.exception("a decode step failed")
    finally:
        stopping = "decode stopped before this request finished"
        server.fail(scheduler.drain(), "unavailable", stopping)
        watchdog.close()
        health.close()
        probe.close()
        server.inbox.close()
        server.outbox.close(linger_ms=500)
