"""`epd decode`: take KV hand-offs, run continuous batching, stream TokenDeltas back."""

from __future__ import annotations

import logging

import zmq

from epd.checkpoint.config import load_generation_config
from epd.checkpoint.tokenizer import load_tokenizer
from epd.checkpoint.weights import load_model
from epd.config.roles import DecodeConfig
from epd.decode.scheduler import Scheduler
from epd.dtypes import model_dtype
from epd.process import HealthServer, announce_ready, setup_logging, stop_event
from epd.wire.messages import Abort, KVHandoff, TokenDelta
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
                self.outbox.connect(message.reply_to, wait_ms=REPLY_CONNECT_MS)
                sequence, delta = self.scheduler.add(message)
                self.reply(sequence.reply_to, delta)
            elif isinstance(message, Abort):
                if self.scheduler.abort(message.request_id):
                    log.info("aborted %s: its client went away", message.request_id)
            else:
                log.error("ignored a %s: decode takes KVHandoff and Abort", type(message).__name__)

    def reply(self, address: str, delta: TokenDelta) -> None:
        if not self.outbox.send(address, delta):
            log.warning("%s is unreachable: dropping %s", address, delta.request_id)
            self.scheduler.abort(delta.request_id)

    def drop_orphans(self) -> None:
        """A prefill that went away takes its requests with it: free their caches."""
        gone = set(self.outbox.poll_events())
        for sequence in [*self.scheduler.running.values(), *self.scheduler.waiting]:
            if sequence.reply_to in gone:
                log.warning("%s went away: dropping %s", sequence.reply_to, sequence.request_id)
                self.scheduler.abort(sequence.request_id)

    def step(self) -> None:
        self.take_messages()
        self.drop_orphans()
        for sequence, delta in self.scheduler.step():
            self.reply(sequence.reply_to, delta)


def run(config: DecodeConfig) -> None:
    setup_logging("decode")
    stop = stop_event()
    model = load_model(config.model, "language", config.device, model_dtype(config.dtype))
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    eos_ids = load_generation_config(config.model).eos_token_ids
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
