"""Which KV blocks each prefill holds, by vLLM's external block hash (the low 64 bits of a
block's digest, `kv/events.py`), so the router can send a request where its prefix is.

A prefill that publishes KV events is followed exactly: what it stored, less what it removed or
cleared. One that does not is followed approximately, as SGLang's router does it: the blocks of
the requests sent to it. Either way at most `limit` blocks a prefill, the least recently
stored or sent out first (a prefill's cache is bounded; a flood of events must not be).
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


class PrefixIndex:
    """Block hashes per prefill; written by the KV events' thread and the event loop, read by
    the loop (one lock: each call is a few dict operations per block)."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self.blocks: dict[str, OrderedDict[int, None]] = {}
        self.fed: set[str] = set()  # prefills followed by their events
        self.limit = limit
        self.lock = threading.Lock()

    def stored(self, prefill: str, hashes: Iterable[bytes | int]) -> None:
        with self.lock:
            self.fed.add(prefill)
            held = self.blocks.setdefault(prefill, OrderedDict())
            for h in hashes:
                held[external(h)] = None
                held.move_to_end(external(h))
            self.trim(held)

    def removed(self, prefill: str, hashes: Iterable[bytes | int]) -> None:
        with self.lock:
            self.fed.add(prefill)
            held = self.blocks.get(prefill, OrderedDict())
            for h in hashes:
                held.pop(external(h), None)

    def cleared(self, prefill: str) -> None:
        with self.lock:
            self.fed.add(prefill)
            self.blocks[prefill] = OrderedDict()

    def forget(self, prefill: str) -> None:
        """A prefill gone (or restarted: its cache is empty)."""
        with self.lock:
            self.blocks.pop(prefill, None)
            self.fed.discard(prefill)

    def sent(self, prefill: str, hashes: Sequence[int]) -> None:
        """A request's blocks went to `prefill`: where it publishes no events, take them as
        held from now on."""
        with self.lock:
            if prefill in self.fed:
                return
            held = self.blocks.setdefault(prefill, OrderedDict())
            for h in hashes:
                held[h] = None
                held.move_to_end(h)
            self.trim(held)

    def trim(self, held: OrderedDict[int, None]) -> None:
        while len(held) > self.limit:
            held.popitem(last=False)

    def held(self, prefill: str) -> int:
        with self.lock:
            return len(self.blocks.get(prefill, ()))

    def matched(self, prefill: str, hashes: Sequence[int]) -> int:
        """How many of the prompt's first blocks the prefill holds, in a row."""
        with self.lock:
            held = self.blocks.get(prefill)
            if not held:
                return 0
            count = 0
            for h in hashes:
                if h not in held:
                    break
                count += 1
            return count
