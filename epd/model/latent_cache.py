"""MLA's latent KV cache, one plain tensor per request.

Per token and layer MLA keeps only the normalised c_kv (kv_lora_rank) and the rotated, shared
k_pe (qk_rope_head_dim): 576 values in the real model instead of heads·(k + v). A request's cache
is `data[:, :length]` of shape (layers, tokens, latent_dim), so it can be handed to another
process as one tensor and resumed there with `LatentCache.from_tensor`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LatentCache:
    def __init__(self, data: torch.Tensor, length: int) -> None:
        assert data.dim() == 3 and 0 <= length <= data.shape[1]
        self.data = data  # (layers, capacity, latent_dim)
        self.length = length

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> LatentCache:
        """Adopt a (layers, tokens, latent_dim) tensor, e.g. one received from prefill."""
        return cls(tensor, tensor.shape[1])

    def split(self, lengths: list[int]) -> list[LatentCache]:
        """Per-prompt caches of a packed prefill (views, no copies)."""
        return [LatentCache.from_tensor(t) for t in self.tensor().split(lengths, dim=1)]

    def tensor(self) -> torch.Tensor:
        """The filled part, (layers, length, latent_dim): what travels between processes."""
        return self.data[:, : self.length]

    def extend(self, rows: torch.Tensor) -> None:
        """Append rows (layers, n, latent_dim): the next chunk of a prompt's prefill."""
        self.reserve(rows.shape[1])
        self.data[:, self.length : self.length + rows.shape[1]] = rows
        self.length += rows.shape[1]

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` more entries, doubling capacity so appends stay amortised O(1)."""
        needed = self.length + tokens
        if needed <= self.data.shape[1]:
            return
        capacity = max(needed, 2 * self.data.shape[1], 16)
        grown = self.data.new_empty(self.data.shape[0], capacity, self.data.shape[2])
        grown[:, : self.length] = self.tensor()
        self.data = grown


class Part(NamedTuple):
    """Some of a decode step's requests, for one attention call."""

    rows: torch.Tensor | None  # (n,) which rows of the batch; None: all of them, in order
    cache: torch.Tensor  # (n, T, latent_dim): their caches padded to the longest of them
    visible: torch.Tensor  # (n, T): the real rows


class DecodeBatch:
    """One decode step over several requests: each appends one token to its own cache.

    Layers call `append_and_gather` to store the step's latent row and get back the requests'
    caches padded to a common length, in parts (here one: every request, padded to T_max).
    """

    def __init__(self, caches: list[LatentCache]) -> None:
        self.caches = caches
        for cache in caches:
            cache.reserve(1)
        device = caches[0].data.device
        self.index([c.length for c in caches], device)
        lengths = torch.tensor([c.length + 1 for c in caches])
        self.mask = (torch.arange(self.max_length)[None, :] < lengths[:, None]).to(device)

    def index(self, past: list[int], device: torch.device) -> None:
        """Positions (B,) of the tokens being decoded after `past` rows each, and the longest
        cache's length after the step."""
        self.positions = torch.tensor(past, device=device)
        self.max_length = max(past) + 1

    def append_and_gather(self, layer: int, latent: torch.Tensor) -> list[Part]:
        """latent (B, latent_dim) → the caches including it, padded (B, T_max, latent_dim)."""
        padded = latent.new_zeros(len(self.caches), self.max_length, latent.shape[-1])
        for i, cache in enumerate(self.caches):
            cache.data[layer, cache.length] = latent[i]
            padded[i, : cache.length + 1] = cache.data[layer, : cache.length + 1]
        return [Part(None, padded, self.mask)]

    def advance(self) -> None:
        for cache in self.caches:
            cache.length += 1
