"""Prefill's side of KV memory: its pool, and what it believes each decoder holds.

Prefill's prompts live in a `BlockPool` (`epd/kv/`) from their first chunk to their hand-off,
and their full blocks stay cached there after it (the prefix cache), within
`prefix_cache_bytes`. A hand-off carries only the rows of the blocks its decoder lacks:
`DecoderBlocks` remembers which blocks prefill handed to each decoder (decode keeps them
cached), learns from the decoders' KV events what every prefill handed them and what they
evicted, and forgets those a decoder says it no longer holds (`KVMissing`). A wrong belief
costs one round trip, never a wrong token: decode checks every block it is told it has.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from epd.config.roles import PrefillConfig
from epd.config.settings import peer_endpoint
from epd.kv.events import open_kv_events
from epd.kv.index import BlockIndex, external
from epd.kv.listener import KVEventListener
from epd.kv.pool import BlockPool
from epd.model.deepseek import DeepseekV3ForCausalLM

# Block hashes remembered per decoder (least recently used out first): 1M tokens' worth, ~80 MB
# of Python objects at most per decoder.
REMEMBERED_BLOCKS = 1 << 16


def prefill_pool(config: PrefillConfig, lm: DeepseekV3ForCausalLM) -> BlockPool:
    """Prefill's pool: prompts' blocks as they are prefilled, and, with prefix caching on,
    full blocks kept after their requests in up to `prefix_cache_bytes`. It grows as prompts
    need (what prefill admits bounds them, `max_waiting_tokens`), and gives the memory back when
    nothing is held or cached; what it caches and evicts is published as KV events where
    `kv_events_config` asks."""
    layers, width = lm.config.num_hidden_layers, lm.config.latent_dim
    dtype = lm.lm_head.weight.dtype
    per_token = layers * width * dtype.itemsize
    caching = config.enable_prefix_caching and config.prefix_cache_bytes > 0
    cached = config.prefix_cache_bytes // per_token if caching else 0
    device = lm.lm_head.weight.device
    most = cached + (1 << 24)  # a cap only: it grows as prompts need
    events = open_kv_events(config.kv_events_config)
    return BlockPool(layers, width, device, dtype, most, events=events, max_cached_tokens=cached)


class DecoderBlocks:
    """The blocks prefill believes each decoder holds: those handed to it, and, where prefill
    follows the decoders' KV events (`decoder_kv_events`), what each stored by any prefill's
    hand-off, less what it evicted; less, either way, what it said it lacked (`KVMissing`)."""

    def __init__(self, per_decoder: int = REMEMBERED_BLOCKS, events: str = "") -> None:
        """`events`: the decoders' KV events endpoint template (`settings.peer_endpoint`)."""
        self.index = BlockIndex(limit=per_decoder)
        self.events = events
        self.listener = KVEventListener(self.index) if events else None
        self.keep_nothing: set[str] = set()  # decoders whose prefix cache is off
        self.following: set[str] = set()  # the decoders whose events the listener was given

    def blocks(self, decoder: str, hashes: Sequence[bytes]) -> int:
        """How many of the leading blocks the decoder holds, by what prefill knows (asked of
        every candidate decoder: only `sent` and its events make a block recent)."""
        if decoder in self.keep_nothing:
            return 0
        return self.index.matched(decoder, [external(h) for h in hashes])

    def sent(self, decoder: str, hashes: Sequence[bytes]) -> None:
        """The decoder was handed these blocks (it keeps them, unless it keeps nothing): held
        from now, before its events of them come."""
        if decoder not in self.keep_nothing and hashes:
            self.index.sent(decoder, [external(h) for h in hashes], fed_too=True)

    def missing(self, decoder: str, hashes: Sequence[bytes], held: int, keeps: bool) -> None:
        """The decoder holds only the first `held` of these blocks (`keeps` false: no block
        at all, ever: its prefix cache is off)."""
        if not keeps:
            self.keep_nothing.add(decoder)
            self.index.forget(decoder)
            return
        self.index.removed(decoder, hashes[held:])

    def keep_only(self, decoders: Collection[str]) -> None:
        """Forget the decoders not among these (gone: a pod replaced under a headless Service
        comes back at another address, and empty), and follow the events of those that are."""
        for gone in [d for d in self.index.peers() if d not in decoders]:
            self.index.forget(gone)
        self.keep_nothing &= set(decoders)
        if self.listener is not None and set(decoders) != self.following:  # asked every request
            self.following = set(decoders)
            endpoints = {d: peer_endpoint(self.events, d) for d in decoders}
            self.listener.follow({d: e for d, e in endpoints.items() if e is not None})

    def lost(self, decoder: str) -> None:
        """The decoder's connection dropped: it may come back restarted, holding nothing (and
        with its prefix cache on again)."""
        self.index.forget(decoder)
        self.keep_nothing.discard(decoder)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
