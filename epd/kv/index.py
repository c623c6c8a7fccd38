"""Which KV blocks each of several peers holds, by vLLM's external block hash (the low 64 bits
of a block's digest, `events.py`): the router's view of its prefills, so that it sends a request
where its prefix is, and prefill's of its decoders, so that a hand-off leaves out what its
decoder holds.

A peer that publishes KV events is followed exactly: what it stored, less what it removed or
cleared (`listener.py` files them). One that does not is followed approximately, as SGLang's
router does it: the blocks of the requests sent to it (`sent`). Either way at most `limit`
blocks a peer, the least recently stored or sent out first (a peer's cache is bounded; a flood
of events must not be).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

MASK = 0xFFFF_FFFF_FFFF_FFFF


def external(digest: bytes | int) -> int:
    """A block hash as an event names it (vLLM's int form, or the digest), as one int."""
    if isinstance(digest, int):
        return digest & MASK
    return int.from_bytes(digest, "big") & MASK


class BlockIndex:
    """Block hashes per peer; written by the KV events' thread and the event loop, read by the
    loop (one lock: each call is a few dict operations per block)."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self.blocks: dict[str, OrderedDict[int, None]] = {}
        self.fed: set[str] = set()  # peers followed by their events
        self.limit = limit
        self.lock = threading.Lock()

    def stored(self, peer: str, hashes: Sequence[bytes | int]) -> None:
        named = [external(h) for h in hashes[-self.limit :]]  # past the limit: out at once
        with self.lock:
            self.fed.add(peer)
            held = self.blocks.setdefault(peer, OrderedDict())
            for h in named:
                held[h] = None
                held.move_to_end(h)
            self.trim(held)

    def removed(self, peer: str, hashes: Iterable[bytes | int]) -> None:
        named = [external(h) for h in hashes]
        with self.lock:
            self.fed.add(peer)
            held = self.blocks.get(peer, OrderedDict())
            for h in named:
                held.pop(h, None)

    def cleared(self, peer: str) -> None:
        with self.lock:
            self.fed.add(peer)
            self.blocks[peer] = OrderedDict()

    def forget(self, peer: str) -> None:
        """A peer gone (or restarted: its cache is empty)."""
        with self.lock:
            self.blocks.pop(peer, None)
            self.fed.discard(peer)

    def sent(self, peer: str, hashes: Sequence[int], fed_too: bool = False) -> None:
        """A request's blocks went to `peer`: where it publishes no events (or `fed_too`:
        where they are sure to be kept, and its events of them may not have come yet), take
        them as held from now on."""
        with self.lock:
            if peer in self.fed and not fed_too:
                return
            held = self.blocks.setdefault(peer, OrderedDict())
            for h in hashes:
                held[h] = None
                held.move_to_end(h)
            self.trim(held)

    def trim(self, held: OrderedDict[int, None]) -> None:
        while len(held) > self.limit:
            held.popitem(last=False)

    def peers(self) -> list[str]:
        with self.lock:
            return list(self.blocks)

    def held(self, peer: str) -> int:
        with self.lock:
            return len(self.blocks.get(peer, ()))

    def matched(self, peer: str, hashes: Sequence[int]) -> int:
        """How many of the prompt's first blocks the peer holds, in a row."""
        with self.lock:
            held = self.blocks.get(peer)
            if not held:
                return 0
            count = 0
            for h in hashes:
                if h not in held:
                    break
                count += 1
            return count
