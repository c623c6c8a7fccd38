"""`epd decode`: take KV hand-offs, run continuous batching, stream TokenDeltas back.

Prefill has sent each choice's first token (it sampled it); decode sends the ones after. Every
admitted request with a choice left to generate ends with its final delta or a Failure, whatever
fails: a bad hand-off, one sequence's step, the whole step, its prefill disconnecting or not
taking its tokens, or the process being stopped. (A Failure for a prefill that is gone waits for
it to come back, briefly.) Only a request aborted by its prefill, whose client left, ends
without a word.
"""

from __future__ import annotations

import logging
import time

import torch
import zmq

from epd.checkpoint.config import context_length, load_model_config
from epd.checkpoint.identity import checkpoint_digest
from epd.checkpoint.progress import phase
from epd.checkpoint.tokenizer import load_tokenizer, stop_token_ids
from epd.checkpoint.weights import load_model
from epd.config.roles import DecodeConfig
from epd.config.speculative import SpeculativeConfig
from epd.decode.metrics import DecodeMetrics
from epd.decode.scheduler import Busy, Lacking, Scheduler, Step, TooLarge
from epd.dtypes import model_dtype
from epd.generation.reasoning import prepare
from epd.generation.sequence import Sequence
from epd.generation.transcript import Output
from epd.kv.events import kv_events_endpoints, open_kv_events
from epd.kv.hashing import BLOCK_TOKENS
from epd.runtime.idle import OthersIdle
from epd.runtime.process import torch_threads, use_torch_threads
from epd.runtime.role import run_role
from epd.runtime.watchdog import Watchdog
from epd.wire.addresses import Prefills
from epd.wire.curve import process_keys
from epd.wire.limits import cut
from epd.wire.messages import Abort, Failure, KVHandoff, KVMissing, TokenDelta
from epd.wire.outbox import Outbox
from epd.wire.transport import Inbox, Refusals

log = logging.getLogger(__name__)
# A hand-off decode refuses, by why: full for now, or too large for it ever; otherwise bad.
REFUSALS: dict[type[Exception], str] = {Busy: "unavailable", TooLarge: "bad_request"}
INTAKE_S = 0.005  # most time one step spends taking messages while requests are decoding


class DecodeServer:
    """The scheduler on the wire: it knows where each request's tokens go (its prefill)."""

    def __init__(
        self,
        scheduler: Scheduler,
        inbox: Inbox,
        outbox: Outbox,
        prefills: Prefills,
        model_name: str,
        threads: int = 0,
        alone_threads: int = 0,
    ) -> None:
        """`threads`: torch threads for a step (0: as they are); `alone_threads`: while the
        machine's other processes leave its cores idle (0: threads)."""
        self.scheduler, self.inbox, self.outbox, self.prefills = scheduler, inbox, outbox, prefills
        self.threads, self.alone_threads = threads, alone_threads
        self.others_idle = OthersIdle()
        self.metrics = DecodeMetrics(model_name)
        self.registry = self.metrics.registry
        self.metrics.running.set_function(lambda: len(scheduler.running))
        self.metrics.waiting.set_function(lambda: len(scheduler.waiting))
        self.metrics.kv_usage.set_function(self.kv_cache_usage)
        self.reply_to: dict[str, str] = {}  # request id → its prefill, while decode holds it
        self.taking = True  # False once a stop was asked for: the drain
        self.open_choices: dict[str, int] = {}  # request id → its choices not finished yet
        self.refused_handoffs = Refusals()  # logged a few a second: a peer may send many
        self.drafted = self.accepted = 0  # speculative decoding's draft tokens, and kept

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
                if self.drop(message.request_id):
                    log.info("aborted %s: its client went away", message.request_id)
            else:
                self.inbox.refusals.log(
                    f"a {type(message).__name__}: decode takes KVHandoff and Abort"
                )

    def admit(self, handoff: KVHandoff) -> None:
        request_id, reply_to = handoff.request_id, handoff.reply_to
        if not self.prefills.allows(reply_to):
            self.inbox.refusals.log(f"{request_id}: {reply_to!r} is not a prefill of this decoder")
            return
        if request_id in self.scheduler:  # a Failure would end the request in flight
            self.inbox.refusals.log(f"a second hand-off of {request_id}")
            return
        if not self.taking:
            why = "decode is shutting down: it finishes what it holds and takes nothing new"
            self.outbox.send(reply_to, Failure(request_id, "unavailable", why))
            return
        idle = not len(self.scheduler)
        try:
            added = self.scheduler.add(handoff)
        except Lacking as e:  # blocks it evicted since: prefill sends the rows again
            self.outbox.send(reply_to, KVMissing(request_id, e.held, e.keeps))
            return
        except Exception as e:  # a bad hand-off fails its own request, never the server
            self.refused_handoffs.log(f"the hand-off of {request_id}: {e}")
            code = REFUSALS.get(type(e), "bad_handoff")
            why = cut(f"decode refused the request: {e}")
            self.outbox.send(reply_to, Failure(request_id, code, why))
            return
        self.metrics.handoff_bytes.inc(handoff.cache.nbytes)
        self.metrics.prefix_cache_queries.inc(handoff.prompt_tokens)  # once, as it is taken
        self.metrics.prefix_cache_hits.inc(handoff.cached_blocks * BLOCK_TOKENS)
        if idle:  # the prefill before it was this request's own: judge the others from now
            self.others_idle.assume_idle()
        # Prefill has sent each choice's first output: the deltas from here are the rest.
        open_choices = sum(output.finish_reason is None for _, output in added)
        if open_choices:  # else every choice ended at its first token: nothing to say
            self.reply_to[request_id] = reply_to
            self.open_choices[request_id] = open_choices

    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache's blocks that running sequences hold (0 to 1)."""
        pool = self.scheduler.pool
        return min(pool.used_blocks / (pool.max_blocks - 1), 1.0)  # one block is the zero block

    def send(self, sequence: Sequence, output: Output, kv_cache_usage: float) -> None:
        """Send a choice's output to its prefill, with the KV cache's use after the step that
        made it; the request ends with its last choice. If that fails, the request fails
        alone."""
        request_id = sequence.request_id
        if output.finish_reason is not None and request_id in self.open_choices:
            self.open_choices[request_id] -= 1
        last = self.open_choices.get(request_id, 0) <= 0
        try:
            delta = TokenDelta.of(request_id, sequence.index, output, kv_cache_usage)
            self.deliver(request_id, delta, last)
        except Exception as e:
            log.exception("could not send the output of %s", request_id)
            try:
                why = f"decode failed: {type(e).__name__}: {e}"
                self.fail_request(request_id, "internal", why)
            except Exception:  # nor its failure: it ends here, and the step goes on
                log.exception("could not fail %s either: dropping it", request_id)
                self.drop(request_id)

    def fail_request(self, request_id: str, code: str, message: str) -> None:
        """End a request with a Failure (queued if its prefill is reconnecting)."""
        self.scheduler.abort(request_id)
        self.deliver(request_id, Failure(request_id, code, cut(message)), last=True)

    def deliver(self, request_id: str, message: TokenDelta | Failure, last: bool) -> None:
        """Hand a message to the outbox; the last one of a request ends it here. A prefill that
        cannot take it takes its request with it."""
        address = self.reply_to.get(request_id)
        if address is None:  # it has ended already
            return
        if last:
            del self.reply_to[request_id]
            self.open_choices.pop(request_id, None)
        if not self.outbox.send(address, message):
            log.warning("%s is unreachable: dropping %s", address, request_id)
            self.drop(request_id)

    def drop(self, request_id: str) -> bool:
        """Forget a request without a word (its client or prefill is gone)."""
        self.reply_to.pop(request_id, None)
        self.open_choices.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def fail_all(self, code: str, message: str) -> None:
        """End every request decode still owes an answer (the map of reply addresses)."""
        self.scheduler.drain()
        for request_id in list(self.reply_to):
            self.fail_request(request_id, code, message)

    def check_peers(self) -> None:
        """Requests whose prefill disconnected, or whose tokens it did not take, end here."""
        losses = self.outbox.poll()
        for prefill in losses.peers:
            held = [r for r, address in self.reply_to.items() if address == prefill]
            if held:
                log.warning("lost %s: failing its %d requests", prefill, len(held))
            for request_id in held:
                self.fail_request(request_id, "unavailable", f"decode lost {prefill}")
        for _, request_id in losses.requests:
            if request_id in self.reply_to:
                why = "tokens of this request could not be delivered in time"
                self.fail_request(request_id, "unavailable", why)

    def count_drafts(self, step: Step) -> None:
        """A step's drafts, into the metrics and the totals /health reports."""
        if not step.drafts:
            return
        accepted = sum(step.accepted)
        self.drafted += step.draft_tokens
        self.accepted += accepted
        self.metrics.drafts.inc(step.drafts)
        self.metrics.draft_tokens.inc(step.draft_tokens)
        self.metrics.accepted_tokens.inc(accepted)
        for position, count in enumerate(step.accepted):
            self.metrics.accepted_per_position.labels(position=str(position)).inc(count)

    def status(self) -> dict[str, object]:
        status: dict[str, object] = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "by_status": self.scheduler.counts(),
            "refused_messages": self.inbox.refusals.total,
            "kv_cache": self.kv_status(),
        }
        if config := self.scheduler.speculative:
            status["speculative"] = {
                "method": config.method,
                "num_speculative_tokens": config.num_speculative_tokens,
                "draft_tokens": self.drafted,
                "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            }
        return status

    def kv_status(self) -> dict[str, object]:
        """The pool's blocks: held by requests, cached for later ones, and its memory."""
        pool = self.scheduler.pool
        return {
            "used_blocks": pool.used_blocks,
            "cached_tokens": pool.blocks.cached * BLOCK_TOKENS,
            "bytes": pool.storage.nbytes,
        }

    def stop_taking(self) -> None:
        self.taking = False

    def holding(self) -> bool:
        return bool(self.reply_to)

    def close(self) -> None:
        """Fail what is still held (its prefill hears why), then close the sockets."""
        self.fail_all("unavailable", "decode stopped before this request finished")
        self.inbox.close()
        self.outbox.close(linger_ms=500)
        self.scheduler.pool.blocks.events.close()

    def endpoints(self) -> dict[str, str]:
        """What its ready line names besides its sockets: where its KV events go."""
        return kv_events_endpoints(self.scheduler.pool.blocks.events)

    def use_threads(self) -> None:
        """The machine's idle cores for the step too, while the other processes leave them
        (at one stream: prefill and encode wait for the next request); its share otherwise.
        A sequence that waits joins in this step: a lone request's first step takes the
        cores as well."""
        threads = self.threads
        if self.alone_threads and len(self.scheduler) and self.others_idle():
            threads = self.alone_threads
        use_torch_threads(threads)

    def step(self) -> None:
        self.check_peers()
        self.take_messages()
        self.use_threads()
        start = time.perf_counter()
        try:
            step = self.scheduler.step()
        except Exception as e:  # not any one request's fault: fail them all, keep the process
            log.exception("a decode step failed")
            self.fail_all("internal", f"decode failed: {type(e).__name__}: {e}")
            return
        self.metrics.preemptions.inc(step.preempted)
        self.count_drafts(step)
        if step.batch:
            self.metrics.batch_size.observe(step.batch)
            self.metrics.step_seconds.observe(time.perf_counter() - start)
        usage = self.kv_cache_usage()  # finished sequences have released their blocks
        for sequence, output in step.produced:
            self.send(sequence, output, usage)
        for sequence, problem in step.refused:
            self.fail_request(sequence.request_id, "bad_request", problem)
        for sequence, problem in step.failed:
            self.fail_request(sequence.request_id, "internal", problem)
        self.scheduler.pool.flush_events()  # what the step cached and evicted, as one batch


def largest_frame(checkpoint: str) -> int:
    """Bytes of the largest legitimate frame: a float32 cache of a whole context."""
    text = load_model_config(checkpoint).text
    return text.num_hidden_layers * text.max_position_embeddings * text.latent_dim * 4


def load_scheduler(config: DecodeConfig) -> Scheduler:
    """The model, tokenizer and limits the config names, as a scheduler."""
    context = context_length(load_model_config(config.model).text, config.max_model_len)
    model = load_model(
        config.model,
        "language",
        config.device,
        model_dtype(config.dtype),
        config.cpu_weight_copies,
    )
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    eos_ids = stop_token_ids(config.model, tokenizer)
    scheduler = Scheduler(
        model.language_model,
        tokenizer,
        eos_ids,
        config.max_batch_size,
        config.max_kv_tokens,
        preallocate=torch.device(config.device).type == "cuda",  # a GPU of its own: take it now
        context_length=context,
        memory_share=config.gpu_memory_utilization,
        checkpoint=checkpoint_digest(config.model),
        prefix_caching=config.enable_prefix_caching,
        events=open_kv_events(config.kv_events_config),
        speculative=SpeculativeConfig.from_json(config.speculative_config),
    )
    with phase("warming up: the grammar tables", "warmed up"):
        prepare(scheduler.grammars)  # built now (or found unavailable), not at the first grammar
    return scheduler


def run(config: DecodeConfig) -> None:
    def build(_: Watchdog) -> DecodeServer:
        prefills = Prefills.parse(config.prefills)  # a bad pattern fails before the model loads
        keys = process_keys(config.zmq_curve_keys)  # so do missing keys
        scheduler = load_scheduler(config)
        context: zmq.Context = zmq.Context.instance()
        inbox = Inbox(context, config.bind, largest_frame(config.model), curve=keys)
        # The prefills named exactly stay connected: never closed as idle nor pushed out.
        outbox = Outbox(context, prefills.exact, curve=keys)
        name, threads = config.model_name, torch_threads(config.threads, config.device)
        return DecodeServer(scheduler, inbox, outbox, prefills, name, threads, config.alone_threads)

    run_role("decode", config, build, config.drain_timeout_s)
