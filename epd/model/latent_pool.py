"""The running sequences' latent caches side by side, so a decode step reads them in place.

`storage` is (layers, slots, capacity, latent_dim). A sequence that joins the running batch
moves its cache into the next slot, and its `LatentCache` then views `storage[:, slot]`, so code
that appends to one cache keeps working. Slots stay packed, 0..n-1: when a sequence leaves, the
last slot's rows move into its place. A step over the slots in order attends over
`storage[layer, :n, :T]`, a view, where a batch of separate caches is copied into a padded tensor
in every layer of every step. So a departure costs one copy of one cache, and a step none.

The price is memory: n slots × the longest running sequence, not the sum of their lengths.
Capacity doubles when one outgrows it, up to the context length, and halves again once the
longest left fits a quarter of it (the storage goes entirely when the last cache leaves). A paged
pool would avoid the waste but needs a paged attention kernel to avoid the gather, and torch has
none on a CPU.
"""

from __future__ import annotations

import torch

from epd.model.latent_cache import DecodeBatch, LatentCache


class PooledBatch(DecodeBatch):
    """A step over every slot of a pool, in slot order: caches are read where they lie."""

    def __init__(self, storage: torch.Tensor, caches: list[LatentCache]) -> None:
        super().__init__(caches)  # the pool made room: each cache's reserve(1) is a no-op
        self.storage = storage
        self.slots = torch.arange(len(caches), device=storage.device)

    def append_and_gather(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """latent (B, latent_dim) → the caches (B, T_max, latent_dim), a view of the pool."""
        rows = self.storage[layer]  # (slots, capacity, latent_dim)
        rows[self.slots, self.positions] = latent
        return rows[: len(self.caches), : self.max_length]


class LatentPool:
    def __init__(
        self,
        layers: int,
        latent_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int = 1 << 62,
    ) -> None:
        self.storage = torch.empty(layers, 0, 0, latent_dim, device=device, dtype=dtype)
        self.max_length = max_length  # no cache grows past the context
        self.caches: list[LatentCache] = []  # by slot
        self.slot: dict[int, int] = {}  # id(cache) → its slot

    def __len__(self) -> int:
        return len(self.caches)

    @torch.inference_mode()
    def admit(self, cache: LatentCache) -> LatentCache:
        """Copy a cache into the next slot; the cache returned views it there."""
        self.fit(len(self.caches) + 1, cache.length + 1)
        slot = len(self.caches)
        self.storage[:, slot, : cache.length] = cache.tensor()
        pooled = LatentCache(self.storage[:, slot], cache.length)
        self.caches.append(pooled)
        self.slot[id(pooled)] = slot
        return pooled

    @torch.inference_mode()  # the storage is an inference tensor: abort runs outside a step
    def release(self, cache: LatentCache) -> None:
        """Free a cache's slot: the last slot's cache moves into it. Rows no cache owns are
        zeros: a step reads them, masked, and a masked NaN would still poison its neighbours'
        weighted sums (0 × NaN)."""
        slot, vacated = self.slot.pop(id(cache)), len(self.caches) - 1
        last = self.caches.pop()
        if last is not cache:
            self.storage[:, slot, : last.length] = last.tensor()
            self.storage[:, slot, last.length : cache.length + 1] = 0  # + a failed step's row
            last.data = self.storage[:, slot]
            self.caches[slot] = last
            self.slot[id(last)] = slot
        self.storage[:, vacated, : max(last.length, cache.length) + 1] = 0
        longest = max((c.length for c in self.caches), default=0)
        if not self.caches:
            self.clear()
        elif 4 * (longest + 1) <= self.storage.shape[2]:  # a long one left: give memory back
            self.reallocate(self.storage.shape[1], max(2 * (longest + 1), 16))

    def clear(self) -> None:
        """Forget every cache and give back the memory."""
        self.caches.clear()
        self.slot.clear()
        layers, _, _, width = self.storage.shape
        self.storage = self.storage.new_empty(layers, 0, 0, width)

    def in_order(self, caches: list[LatentCache]) -> list[int]:
        """The positions of `caches` sorted by slot: the order a step reads them in place."""
        return sorted(range(len(caches)), key=lambda i: self.slot[id(caches[i])])

    @property
    def capacity(self) -> int:
        return self.storage.shape[2]

    def make_room(self) -> None:
        """Room for one more row in every slot: a step's. Raises (e.g. out of memory) if the
        storage cannot grow; only the caches longer than `capacity` then need what failed."""
        if self.caches:
            self.fit(len(self.caches), max(c.length for c in self.caches) + 1)

    def batch(self, caches: list[LatentCache]) -> DecodeBatch:
        """A decode step over pooled caches: read in place when they are every slot in order,
        gathered otherwise (e.g. one sequence run alone)."""
        self.make_room()
        if len(caches) == len(self.caches) and all(
            a is b for a, b in zip(caches, self.caches, strict=True)
        ):
            return PooledBatch(self.storage, caches)
        return DecodeBatch(caches)

    @torch.inference_mode()
    def fit(self, slots: int, length: int) -> None:
        """Grow the storage, doubling, to hold `slots` caches of `length` rows."""
        _, have_slots, capacity, _ = self.storage.shape
        if slots <= have_slots and length <= capacity:
            return
        self.reallocate(
            doubled(have_slots, slots), min(max(doubled(capacity, length), 16), self.max_length)
        )

    @torch.inference_mode()
    def reallocate(self, slots: int, capacity: int) -> None:
        """Move every cache into new zeroed storage of this size."""
        layers, _, _, width = self.storage.shape
        moved = self.storage.new_zeros(layers, slots, capacity, width)
        for slot, cache in enumerate(self.caches):
            moved[:, slot, : cache.length] = cache.tensor()
            cache.data = moved[:, slot]
        self.storage = moved


def doubled(have: int, need: int) -> int:
    """`have`, or twice it (at least `need`) when `need` does not fit."""
    return have if need <= have else max(need, 2 * have)
