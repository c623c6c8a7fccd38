"""From a step's raw logits to the ones sampled from: penalties, biases and bans, for a batch.

Each control is one batched operation over the rows that ask for it, on the logits' device;
rows that ask for nothing are left bit for bit as they were (so greedy output without controls
is unchanged). Logprobs are reported from the raw logits, as vLLM does by default.

- repetition_penalty (HF, vLLM): a token seen in the prompt or the reply has its logit divided
  by the penalty if positive, multiplied by it if not;
- presence_penalty, frequency_penalty (OpenAI): minus presence for each token in the reply so
  far, minus frequency times its count;
- logit_bias (OpenAI): added to the named tokens' logits;
- min_tokens (vLLM): eos and stop token ids are banned (-inf) until the reply has that many;
- a grammar (structured output): every token it does not allow next is banned.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch

from epd.generation.grammar import mask_forbidden
from epd.generation.params import SamplingParams


class History(Protocol):
    """What a row's controls look at: its settings, its prompt and its reply so far."""

    @property
    def sampling(self) -> SamplingParams: ...
    def prompt_presence(self, vocab: int, device: torch.device) -> torch.Tensor:
        """(vocab,) bool: which tokens the prompt holds."""
        ...

    @property
    def tokens(self) -> Sequence[int]: ...  # generated so far
    @property
    def matcher(self) -> Any: ...  # the grammar's llguidance matcher where it applies, or None
    @property
    def also_allowed(self) -> Sequence[int]: ...  # allowed besides the grammar's tokens
    @property
    def grammar_waits(self) -> bool: ...  # its grammar's answer has not begun: no end yet


def adjust(logits: torch.Tensor, rows: Sequence[History], eos_ids: Collection[int]) -> torch.Tensor:
    """Logits (B, vocab) with each row's controls applied; `logits` itself is not changed."""
    if not any(asks_for_controls(row) for row in rows):
        return logits
    logits = logits.float().clone()
    penalise(logits, rows)
    add_biases(logits, rows)
    ban_early_stops(logits, rows, eos_ids)
    if constrained := [i for i, row in enumerate(rows) if constrained_row(row)]:
        picked = [rows[i] for i in constrained]
        matchers, also = [r.matcher for r in picked], [r.also_allowed for r in picked]
        mask_forbidden(logits, constrained, matchers, also)
    return logits


class NoTokenAllowed(ValueError):
    """A request's controls rule out every token (say, a grammar that allows only a stop token
    that min_tokens bans): the request asked for the impossible."""


def require_a_token(adjusted: torch.Tensor) -> None:
    """Raise NoTokenAllowed if a row of adjusted logits (B, vocab) is -inf throughout."""
    if not bool(torch.isfinite(adjusted).any(-1).all()):
        raise NoTokenAllowed("the request's grammar, bans and biases leave no token to sample")


def asks_for_controls(row: History) -> bool:
    sampling = row.sampling
    return (
        sampling.penalised
        or bool(sampling.logit_bias)
        or len(row.tokens) < sampling.min_tokens
        or row.grammar_waits
        or constrained_row(row)
    )


def constrained_row(row: History) -> bool:
    return row.matcher is not None or bool(row.also_allowed)


def penalise(logits: torch.Tensor, rows: Sequence[History]) -> None:
    """Repetition, presence and frequency penalties, in place, on the rows that have any."""
    index = [i for i, row in enumerate(rows) if row.sampling.penalised]
    if not index:
        return
    picked = [rows[i] for i in index]
    device = logits.device
    vocab = logits.shape[-1]

    def column(values: list[float]) -> torch.Tensor:  # (n, 1)
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    counts = token_counts([row.tokens for row in picked], vocab, device)  # (n, vocab)
    in_prompt = torch.stack([row.prompt_presence(vocab, device) for row in picked])
    sub = logits[index]  # (n, vocab)
    repetition = column([row.sampling.repetition_penalty for row in picked])
    seen = in_prompt | (counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub -= column([row.sampling.frequency_penalty for row in picked]) * counts
    sub -= column([row.sampling.presence_penalty for row in picked]) * (counts > 0)
    logits[index] = sub


def token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row's ids: (rows, vocab) float32."""
    lengths = [len(row) for row in ids]
    width = max(lengths, default=0)
    counts = torch.zeros(len(ids), vocab, device=device)
    if width == 0:
        return counts
    padded = torch.zeros(len(ids), width, dtype=torch.int64)
    weights = torch.zeros(len(ids), width)
    for i, row in enumerate(ids):
        padded[i, : len(row)] = torch.as_tensor(row, dtype=torch.int64)
        weights[i, : len(row)] = 1.0
    return counts.scatter_add_(1, padded.to(device), weights.to(device))


def add_biases(logits: torch.Tensor, rows: Sequence[History]) -> None:
    pairs = [
        (i, token, bias) for i, row in enumerate(rows) for token, bias in row.sampling.logit_bias
    ]
    if not pairs:
        return
    row_ids, token_ids, biases = zip(*pairs, strict=True)
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)),
        torch.tensor(biases, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def ban_early_stops(
    logits: torch.Tensor, rows: Sequence[History], eos_ids: Collection[int]
) -> None:
    """No eos or stop token id for a row whose reply is still shorter than its min_tokens, or
    whose grammar waits for its answer (a reasoning model's, still reasoning)."""
    pairs = [
        (i, token)
        for i, row in enumerate(rows)
        if len(row.tokens) < row.sampling.min_tokens or row.grammar_waits
        for token in {*eos_ids, *row.sampling.stop_token_ids}
    ]
    if not pairs:
        return
    row_ids, token_ids = zip(*pairs, strict=True)
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(-math.inf, device=device))


def presence(ids: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """(vocab,) bool: True at each id in `ids`."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    return mask.index_fill_(0, ids.to(device), True)
