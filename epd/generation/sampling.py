"""Per-request token sampling: greedy, temperature, top-k, top-p, min-p, seeded.

Each request owns a CPU `torch.Generator`; its state travels from prefill to decode with the
KV hand-off, so a seeded request draws the same tokens whichever process samples them.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from epd.checkpoint.tokenizer import decode_text, token_bytes
from epd.generation.params import (
    MIN_LOGPROB,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    check_logprob,
)

# Below this temperature sampling is greedy: dividing by a tinier one can overflow float32
# logits to inf, whose softmax is NaN (vLLM draws the same line).
GREEDY_BELOW = 1e-5


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def restore_generator(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state.clone())
    return generator


def advanced(state: torch.Tensor, params: SamplingParams, steps: int) -> torch.Tensor:
    """A generator's state after `steps` more tokens of a request: `sample_batch` draws one
    uniform a token for a sampled request, none for a greedy one, and so does speculative
    decoding (`speculative.verify`). A migrated request's generator goes on from where its
    first decoder's was."""
    generator = restore_generator(state)
    if params.temperature >= GREEDY_BELOW:
        for _ in range(steps):
            torch.rand(1, generator=generator)
    return generator.get_state()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from a float32 logits row (vocab,)."""
    return int(sample_batch(logits[None], [params], [generator])[0])


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """Token ids (B,) on the CPU from float32 logits (B, vocab), each row by its own rules.

    Greedy rows take their argmax. The others draw by inverse CDF from one uniform of their own
    generator; rows with top-k or top-p do so in descending-probability order, plain ones in
    vocabulary order. Each row's arithmetic is its own, so a request draws the same tokens alone
    or in any batch, on the host or the device its logits are on.
    """
    tokens = logits.argmax(-1)  # (B,)
    drawn = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    for filtered in (False, True):
        rows = [i for i in drawn if (params[i].top_k > 0 or params[i].top_p < 1.0) == filtered]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = draw(
                logits[index], [params[i] for i in rows], [generators[i] for i in rows], filtered
            )
    return tokens.cpu()


def draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    filtered: bool,
) -> torch.Tensor:
    """Sampled token ids (n,) from logits (n, vocab) under temperature, top-k, top-p, min-p."""
    probs, order = processed(logits, params, filtered)
    cdf = probs.cumsum(-1)  # (n, vocab)
    uniform = torch.cat([torch.rand(1, generator=g) for g in generators]).to(logits.device)
    chosen = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)  # (n, 1)
    # Rounding can put u·total at the total; stay on the last token that has any probability.
    last_kept = (probs > 0).cumsum(-1).argmax(-1, keepdim=True)
    chosen = torch.minimum(chosen, last_kept)
    return chosen[:, 0] if order is None else order.gather(1, chosen)[:, 0]


def processed(
    logits: torch.Tensor, params: list[SamplingParams], filtered: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distributions sampling draws from, (n, vocab), unnormalised where top-p or min-p
    cut them: with `filtered` (top-k or top-p) in descending order, with that order (n, vocab)
    of token ids; otherwise in vocabulary order, and None."""
    vocab = logits.shape[-1]
    device = logits.device

    def column(values: list[float]) -> torch.Tensor:  # (n, 1)
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    scaled = logits.float() / column([p.temperature for p in params])
    order = None
    if filtered:
        scaled, order = scaled.sort(dim=-1, descending=True)  # (n, vocab), best first
        ranks = torch.arange(vocab, device=device)
        scaled = scaled.masked_fill(ranks >= column([p.top_k or vocab for p in params]), -math.inf)
    probs = scaled.softmax(-1)
    if filtered:
        top_p = column([p.top_p for p in params])
        # Drop a token once the tokens ranked above it already cover top_p.
        outside = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1.0)
        probs = probs.masked_fill(outside, 0.0)
    if any(p.min_p > 0 for p in params):
        floor = column([p.min_p for p in params]) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)  # the likeliest token always stays
    return probs, order


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each sampled row's distribution as `sample_batch` draws from it, normalised, in
    vocabulary order: logits (n, vocab) → (n, vocab) float32 (what speculative decoding
    accepts drafts by)."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for filtered in (False, True):
        rows = [i for i, p in enumerate(params) if (p.top_k > 0 or p.top_p < 1.0) == filtered]
        if not rows:
            continue
        index = torch.tensor(rows, device=logits.device)
        probs, order = processed(logits[index], [params[i] for i in rows], filtered)
        if order is not None:
            probs = torch.empty_like(probs).scatter_(1, order, probs)
        out[index] = probs / probs.sum(-1, keepdim=True)
    return out


def token_logprob(
    logits: torch.Tensor, token: int, top: int, tokenizer: PreTrainedTokenizerBase
) -> TokenLogprob:
    """The model's log-probability of `token` and of its `top` likeliest alternatives.

    Values are kept within [MIN_LOGPROB, 0], so they stay finite JSON numbers.
    """
    return token_logprobs(logits[None], [token], top, tokenizer)[0]


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], top: int, tokenizer: PreTrainedTokenizerBase
) -> list[TokenLogprob]:
    """`token_logprob` for many rows at once: logits (N, vocab), one token per row."""
    return [spelled(s, tokenizer) for s in score_tokens(logits, tokens, top)]


@dataclass(frozen=True)
class Scored:
    """A token's logprob under the model's distribution, its rank there (1: the likeliest; 0:
    not ranked), and the `top` likeliest tokens as (id, logprob), the likeliest first."""

    token_id: int
    logprob: float
    rank: int = 0
    top: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for value in (self.logprob, *(v for _, v in self.top)):
            check_logprob(value, ())  # a NaN from the model fails its own request


def score_tokens(
    logits: torch.Tensor, tokens: Sequence[int], top: int, ranked: bool = False
) -> list[Scored]:
    """Each row's token scored: logits (N, vocab), one token per row; ranked if asked (one
    more pass over the rows).

    Only the few values asked for are taken from the rows, where they are, and only those leave
    the device: a logprob is the logit less the row's logsumexp (log-softmax without writing
    the (N, vocab) result, one pass fewer over a large vocabulary). Values are kept within
    [MIN_LOGPROB, 0], so they stay finite JSON numbers."""
    logits = logits.float()
    norm = logits.logsumexp(-1, keepdim=True)  # (N, 1)
    ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)[:, None]
    picked = logits.gather(1, ids)  # (N, 1)
    chosen = (picked - norm)[:, 0].clamp(MIN_LOGPROB, 0.0).tolist()  # (N,)
    ranks = ((logits > picked).sum(-1) + 1).tolist() if ranked else [0] * len(tokens)
    best_values: list[list[float]] = [[] for _ in tokens]
    best_ids: list[list[int]] = [[] for _ in tokens]
    if top:
        values, indices = likeliest(logits, top)  # (N, top) each
        best_values = (values - norm).clamp(MIN_LOGPROB, 0.0).tolist()
        best_ids = indices.tolist()
    return [
        Scored(token, value, rank, tuple(zip(indices, values, strict=True)))
        for token, value, rank, values, indices in zip(
            tokens, chosen, ranks, best_values, best_ids, strict=True
        )
    ]


def likeliest(logits: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top` largest logits of each row (N, vocab) and their ids, (N, top) each, the largest
    first and, among equal logits, the lowest id first: the order greedy sampling (an argmax,
    which takes the first) picks them in. topk orders ties as it likes."""
    best = logits.topk(top)
    ids, by_id = best.indices.sort(-1)
    values, order = best.values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    # Where more logits than `top` equal the last one kept, topk may have left out lower ids.
    last = values[:, -1:]  # (N, 1)
    for row in ((logits >= last).sum(-1) > top).nonzero().flatten().tolist():
        candidates = (logits[row] >= last[row]).nonzero().flatten()  # ascending ids
        kept, order = logits[row, candidates].sort(descending=True, stable=True)
        values[row], ids[row] = kept[:top], candidates[order[:top]]
    return values, ids


def spelled(
    scored: Scored, tokenizer: PreTrainedTokenizerBase, top: int | None = None
) -> TokenLogprob:
    """A score as OpenAI's logprobs spell it, each token as its text and its own bytes (which
    may end inside a character, where the text has U+FFFD); with its `top` likeliest
    alternatives (default: all it has)."""
    alternatives = [
        TopLogprob(decode_text(tokenizer, [index]), value, tuple(token_bytes(tokenizer, index)))
        for index, value in scored.top[:top]
    ]
    token = scored.token_id
    bytes_ = tuple(token_bytes(tokenizer, token))
    return TokenLogprob(
        decode_text(tokenizer, [token]), scored.logprob, bytes_, tuple(alternatives)
    )
