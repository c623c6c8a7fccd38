"""The prefill step, free of I/O: prompts + image embeddings → first tokens + latent KV.

Each choice's first token also comes out as the client gets it (its `Output`), so the API can
send it at once instead of waiting for decode to echo it; a request that its first tokens end
(`max_tokens` 1, an eos, a stop) has nothing left for decode. A prompt may also ask for the
log-probability of each of its own tokens after the ones before (a legacy completion's `echo`
with `logprobs`, as evaluation harnesses score text): the forward has every position's hidden
state, so they come from the same run.

Several prompts run packed into one forward (each attends only to itself); a prompt that cannot
be prefilled fails alone: its slot holds the exception, the others their hand-offs. A long prompt
may run in chunks, one forward each: a chunk continues from the cache of the chunks before it,
and only the last one samples the first token.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from transformers import PreTrainedTokenizerBase

from epd.dtypes import dtype_name
from epd.generation.finite import all_finite
from epd.generation.grammar import GrammarError, Grammars
from epd.generation.logits import NoTokenAllowed, adjust, require_a_token
from epd.generation.params import SamplingParams
from epd.generation.reasoning import gate
from epd.generation.sampling import (
    Scored,
    make_generator,
    sample_batch,
    score_tokens,
    token_logprob,
)
from epd.generation.transcript import Output, Transcript
from epd.kv.hashing import (
    BLOCK_TOKENS,
    HASH_BYTES,
    ImageSpan,
    block_hashes,
    chain_seed,
    model_key,
)
from epd.kv.pool import BlockPool, BlockTable
from epd.model.deepseek import DeepseekV3ForCausalLM
from epd.multimodal.prompt import image_slots, scatter_image_embeddings
from epd.prefill.errors import BadRequest
from epd.wire.messages import ImageRows, KVHandoff, unnamed_blocks

log = logging.getLogger(__name__)

# Prompt positions scored per product with the output head: (rows, vocab) float32 logits at a
# time, 42 MiB at Kimi-VL's 163 840 tokens.
SCORED_ROWS = 64


@dataclass(frozen=True)
class Prompt:
    request_id: str
    prompt_ids: list[int]
    image_embeddings: torch.Tensor | None  # (N, hidden) for the N placeholder slots
    sampling: SamplingParams
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None: not scored
    # Where each image's rows go and what the image was (by digest), for the prefix cache;
    # None: unknown, and a prompt with images is then never cached.
    image_spans: tuple[ImageSpan, ...] | None = None
    salt: bytes = b""  # the digest of the request's cache_salt (`hashing.salt_digest`)
    # Each full block's hash (`PrefillEngine.hashes`), where the prompt is `cacheable`; and
    # how many of them its decoder holds already: the hand-off carries the rows after them.
    block_hashes: tuple[bytes, ...] = ()
    decoder_blocks: int = 0
    resume: Resume | None = None  # a migrated request: its prompt ends in its reply so far

    @property
    def cacheable(self) -> bool:
        """Whether its KV may come from, and go to, the prefix cache: equal hashes must mean
        equal rows (every image known by its digest), and a prompt whose tokens are scored
        needs every position's hidden state, which cached rows do not give."""
        if self.prompt_logprobs is not None:
            return False
        if self.image_embeddings is None:
            return True
        spans = self.image_spans
        return spans is not None and sum(s.length for s in spans) == len(self.image_embeddings)


@dataclass(frozen=True)
class Partial:
    """A prompt part-way through: its blocks so far (`num_computed_tokens` rows), and if it
    asked, the scores of those its positions predict (each token's logprob after the ones
    before it)."""

    cache: BlockTable
    scored: tuple[Scored, ...] = ()


@dataclass(frozen=True)
class Resume:
    """A request moved off a decoder that died: its prompt is the original one and its reply's
    tokens but the last (`resumed` of them), whose KV the new decoder needs; `last` is the last
    token the client has, and `rng_state` the generator after it. Nothing is sampled."""

    resumed: int
    last: int
    rng_state: torch.Tensor


@dataclass(frozen=True)
class Chunk:
    """A prompt's tokens [start, stop), prefilled after `past`: its tokens before."""

    prompt: Prompt
    start: int
    stop: int
    past: Partial | None = None

    @classmethod
    def whole(cls, prompt: Prompt) -> Chunk:
        return cls(prompt, 0, len(prompt.prompt_ids))

    @property
    def last(self) -> bool:
        return self.stop == len(self.prompt.prompt_ids)


@dataclass(frozen=True)
class Prefilled:
    """A prompt prefilled: each choice's first output, and what decode needs to go on."""

    first: tuple[Output, ...]  # by choice
    handoff: KVHandoff | None  # None: every choice ended at its first token
    prompt_logprobs: tuple[Scored, ...] = ()  # from the prompt's second token, if asked
    # The prompt's blocks, held until the caller lets go (`PrefillEngine.release`): decode may
    # ask for rows again (`KVMissing`). None once let go.
    table: BlockTable | None = None


class PrefillEngine:
    def __init__(
        self,
        lm: DeepseekV3ForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        placeholder_id: int,
        eos_ids: Collection[int],
        kv: BlockPool | None = None,
        checkpoint: bytes = b"",
    ) -> None:
        """`kv`: the pool prompts' KV lives in (default: one that keeps nothing cached);
        `checkpoint`: the checkpoint's digest (`checkpoint/identity.py`), which with the dtype
        its forward runs in names every block it computes (`hashing.model_key`)."""
        self.lm, self.tokenizer, self.placeholder_id = lm, tokenizer, placeholder_id
        self.eos_ids = eos_ids  # banned from the first token while min_tokens asks for more
        self.device = lm.lm_head.weight.device
        config, dtype = lm.config, lm.lm_head.weight.dtype
        self.model_key = model_key(checkpoint, dtype_name(dtype))
        self.kv = (
            kv
            if kv is not None
            else BlockPool(
                config.num_hidden_layers,
                config.latent_dim,
                self.device,
                dtype,
                max_tokens=1 << 24,  # bounded by what prefill admits, not here
                max_cached_tokens=0,
            )
        )

    def hashes(
        self, prompt_ids: list[int], images: tuple[ImageSpan, ...], salt: bytes
    ) -> tuple[bytes, ...]:
        """Each full block's hash, from this model's key and the request's salt digest."""
        return tuple(block_hashes(prompt_ids, images, chain_seed(self.model_key, salt)))

    @cached_property
    def grammars(self) -> Grammars:  # built on first use: a large vocabulary takes a second
        return Grammars(self.tokenizer, self.lm.config.vocab_size, self.eos_ids)

    def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        image_embeddings: torch.Tensor | None,
        sampling: SamplingParams,
        reply_to: str = "",
        prompt_logprobs: int | None = None,
    ) -> Prefilled:
        """Prefill one prompt; raises what kept it from its first tokens."""
        prompt = Prompt(request_id, prompt_ids, image_embeddings, sampling, prompt_logprobs)
        (result,) = self.run_batch([prompt], reply_to)
        if isinstance(result, Exception):
            raise result
        return result

    def run_batch(self, prompts: list[Prompt], reply_to: str = "") -> list[Prefilled | Exception]:
        """Prefill whole prompts packed into one forward; each gets its first tokens or its
        error. Their blocks are let go at once: nobody asks for them again."""
        results = self.run_chunks([Chunk.whole(p) for p in prompts], reply_to)
        done = [r for r in results if not isinstance(r, Partial)]
        assert len(done) == len(results)  # whole prompts end
        return [self.release(r) if isinstance(r, Prefilled) else r for r in done]

    def release(self, prefilled: Prefilled) -> Prefilled:
        """Let go of a prefilled prompt's blocks (published ones stay cached); on the engine's
        thread, as every use of the pool."""
        if prefilled.table is not None:
            self.kv.release(prefilled.table)
        return replace(prefilled, table=None)

    @torch.inference_mode()
    def run_chunks(
        self, chunks: list[Chunk], reply_to: str = ""
    ) -> list[Prefilled | Partial | Exception]:
        """Prefill chunks packed into one forward. A last chunk gets its prompt's first tokens; an
        earlier one the prompt so far (its past, grown); a chunk that fails its error."""
        results: dict[int, Prefilled | Partial | Exception] = {}
        embeds: dict[int, torch.Tensor] = {}
        for i, chunk in enumerate(chunks):
            try:
                embeds[i] = self.embed(chunk.prompt, chunk.start, chunk.stop)
            except Exception as e:  # e.g. image rows that do not fit the placeholders
                results[i] = e
        pasts = [past.cache if (past := chunks[i].past) else None for i in embeds]
        for i, outcome in zip(embeds, self.forward(list(embeds.values()), pasts), strict=True):
            if isinstance(outcome, Exception):
                results[i] = outcome
                continue
            chunk, (logits, hidden, rows) = chunks[i], outcome
            scored = chunk.past.scored if chunk.past else ()
            table = chunk.past.cache if chunk.past else self.kv.table()
            try:
                if chunk.prompt.prompt_logprobs is not None:
                    scored += tuple(self.score(chunk, hidden))
                self.kv.write(table, rows)  # PoolFull: this prompt fails alone
            except Exception as e:  # its own failure (a NaN logprob fails validation)
                self.kv.release(table)
                results[i] = e
                continue
            past = Partial(table, scored)
            results[i] = self.hand_off(chunk.prompt, logits, past, reply_to) if chunk.last else past
            if isinstance(results[i], Exception):
                self.kv.release(table)
        return [results[i] for i in range(len(chunks))]

    def embed(self, prompt: Prompt, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Input embeddings (stop - start, hidden) of tokens [start, stop), with the image rows
        of their placeholder slots in place."""
        ids = torch.tensor(prompt.prompt_ids, device=self.device)
        chunk = ids[start:stop]
        embeds = self.lm.embed(chunk)
        if prompt.image_embeddings is None:
            return embeds
        rows = prompt.image_embeddings
        slots = image_slots(ids, rows, self.placeholder_id)  # the whole prompt's, every chunk
        first = int(slots[:start].sum())  # the chunk's first image row
        mine = rows[first : first + int(slots[start:stop].sum())].to(self.device)
        return scatter_image_embeddings(embeds, chunk, mine, self.placeholder_id)

    def score(self, chunk: Chunk, hidden: torch.Tensor) -> list[Scored]:
        """The logprobs and ranks of the prompt tokens that the chunk's positions predict,
        hidden (stop - start, D): each position's next token, up to the prompt's last (the last
        position predicts the first generated token, which is sampled, not scored)."""
        prompt = chunk.prompt
        ids, top = prompt.prompt_ids, prompt.prompt_logprobs or 0
        predicting = min(chunk.stop, len(ids) - 1) - chunk.start
        entries: list[Scored] = []
        for at in range(0, predicting, SCORED_ROWS):
            rows = range(at, min(at + SCORED_ROWS, predicting))
            logits = self.lm.logits(hidden[rows.start : rows.stop])  # (rows, vocab)
            targets = [ids[chunk.start + j + 1] for j in rows]
            entries += score_tokens(logits, targets, top, ranked=True)
        return entries

    def forward(
        self, embeds: list[torch.Tensor], pasts: list[BlockTable | None]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | Exception]:
        """Each chunk's last-token logits (vocab,), its hidden states (rows, D) and its new
        cache rows (layers, rows, latent_dim); alone if the packed run fails."""
        if not embeds:
            return []
        lengths = [e.shape[0] for e in embeds]
        try:
            hidden, rows = self.lm.prefill(torch.cat(embeds), lengths, list(pasts))
            last = [end - 1 for end in itertools.accumulate(lengths)]
            logits = self.lm.logits(hidden[last])  # (chunks, vocab)
            pieces = zip(logits, hidden.split(lengths), rows.split(lengths, dim=1), strict=True)
            return list(pieces)
        except Exception as e:
            if len(embeds) == 1:
                return [e]
            log.exception("a packed prefill of %d chunks failed: running them alone", len(embeds))
            return [
                outcome
                for e, past in zip(embeds, pasts, strict=True)
                for outcome in self.forward([e], [past])
            ]

    def hand_off(
        self, prompt: Prompt, logits: torch.Tensor, past: Partial, reply_to: str
    ) -> Prefilled | Exception:
        """Sample each choice's first token, say what the client gets for it, and pack what
        decode needs to go on (unless those tokens ended every choice)."""
        try:
            if prompt.resume is not None:
                return self.resumed(prompt, past, reply_to)
            if not all_finite(logits):  # an overflow: this request fails alone
                raise ValueError("the model's logits for this prompt are not finite")
            sampling = prompt.sampling
            generators = [make_generator(sampling.choice_seed(i)) for i in range(sampling.n)]
            ids = torch.tensor(prompt.prompt_ids, dtype=torch.int64)
            replies = [  # each choice's, so far only its prompt: what the controls read
                Transcript(
                    sampling,
                    self.tokenizer,
                    self.eos_ids,
                    ids,
                    gate(self.grammars, sampling),
                )
                for _ in generators
            ]
            rows = logits[None].expand(sampling.n, -1)  # (n, vocab): one prompt, n choices
            adjusted = adjust(rows, replies, self.eos_ids)
            require_a_token(adjusted)
            tokens = sample_batch(adjusted, [sampling] * sampling.n, generators).tolist()
            top = sampling.top_logprobs
            logprobs = tuple(
                token_logprob(logits, t, top, self.tokenizer) if sampling.logprobs else None
                for t in tokens
            )
            outputs = tuple(
                reply.accept(t, lp) for reply, t, lp in zip(replies, tokens, logprobs, strict=True)
            )
            held = min(prompt.decoder_blocks, len(prompt.block_hashes))  # its decoder's already
            if all(output.finish_reason for output in outputs):
                self.kv.publish(past.cache, prompt.block_hashes, prompt.prompt_ids)
                return Prefilled(outputs, None, past.scored, table=past.cache)
            handoff = KVHandoff(
                request_id=prompt.request_id,
                reply_to=reply_to,
                prompt_tokens=len(prompt.prompt_ids),
                first_tokens=tuple(tokens),
                first_logprobs=logprobs,
                sampling=sampling,
                rng_states=torch.stack([g.get_state() for g in generators]),
                cache=past.cache.rows(held * BLOCK_TOKENS).contiguous().cpu(),  # off the loop
                prompt_ids=ids,
                block_hashes=hash_rows(prompt.block_hashes),
                cached_blocks=held,
                salt=prompt.salt,
                images=image_rows(prompt.image_spans) if prompt.block_hashes else (),
            )  # its rows checked finite as it is built: only then may later prompts share them
            self.kv.publish(past.cache, prompt.block_hashes, prompt.prompt_ids)
            return Prefilled(outputs, handoff, past.scored, table=past.cache)
        except (NoTokenAllowed, GrammarError) as e:  # what the request asked for: a 400
            if isinstance(e, GrammarError) and prompt.sampling.grammar:
                self.grammars.forget(prompt.sampling.grammar)
            return BadRequest(str(e))
        except Exception as e:  # e.g. a cache with NaN from an overflow: this request only
            return e

    def resumed(self, prompt: Prompt, past: Partial, reply_to: str) -> Prefilled:
        """A migrated request's hand-off: its reply's last token as the first, nothing
        sampled, nothing for the client (it has every token up to there)."""
        assert prompt.resume is not None
        held = min(prompt.decoder_blocks, len(prompt.block_hashes))
        handoff = KVHandoff(
            request_id=prompt.request_id,
            reply_to=reply_to,
            prompt_tokens=len(prompt.prompt_ids),
            first_tokens=(prompt.resume.last,),
            first_logprobs=(None,),
            sampling=prompt.sampling,
            rng_states=prompt.resume.rng_state[None],
            cache=past.cache.rows(held * BLOCK_TOKENS).contiguous().cpu(),
            prompt_ids=torch.tensor(prompt.prompt_ids, dtype=torch.int64),
            block_hashes=hash_rows(prompt.block_hashes),
            cached_blocks=held,
            salt=prompt.salt,
            images=image_rows(prompt.image_spans) if prompt.block_hashes else (),
            resumed_tokens=prompt.resume.resumed,
        )
        self.kv.publish(past.cache, prompt.block_hashes, prompt.prompt_ids)
        return Prefilled((), handoff, (), table=past.cache)

    def resend(self, handed: Handed, held: int) -> KVHandoff:
        """A hand-off again, for a decoder that holds its first `held` blocks (fewer than it
        was said to, or another decoder): the rows after them, copied into host memory of
        their own (on the engine's thread)."""
        held = min(held, len(handed.hashes))
        rows = handed.table.rows(held * BLOCK_TOKENS).contiguous().cpu()
        return KVHandoff(**(handed.fields | {"cache": rows, "cached_blocks": held}))  # type: ignore[arg-type]


@dataclass
class Handed:
    """A hand-off sent, until its decoder's first word: what sending it again needs."""

    fields: dict[str, object]  # the hand-off's, but its rows (which may be large)
    table: BlockTable  # the prompt's blocks, held
    hashes: tuple[bytes, ...]
    resends: int = 0
    reused: int = 0  # leading blocks the latest send left out: its decoder holds them

    @classmethod
    def of(cls, handoff: KVHandoff, table: BlockTable, hashes: tuple[bytes, ...]) -> Handed:
        fields = {f: getattr(handoff, f) for f in handoff.__struct_fields__ if f != "cache"}
        return cls(fields, table, hashes)


def hash_rows(hashes: tuple[bytes, ...]) -> torch.Tensor:
    """Block hashes as the wire carries them: (blocks, 32) uint8."""
    if not hashes:
        return unnamed_blocks()
    return torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.uint8).view(-1, HASH_BYTES)


def image_rows(spans: tuple[ImageSpan, ...] | None) -> tuple[ImageRows, ...]:
    return tuple(ImageRows(s.start, s.length, s.digest) for s in spans or ())
