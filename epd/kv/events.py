"""KV cache events as vLLM publishes them (`--kv-events-config`), so that a KV-aware router
written for vLLM (llm-d, Dynamo, ...) follows epd's blocks too.

The block bookkeeping records what it stored and removed (`KVEvents`); each engine step ends
with a `flush`: one `KVEventBatch`, as vLLM sends one per scheduler step, through vLLM's ZeroMQ
publisher (`publisher`). The messages are vLLM's (vllm/distributed/kv_events.py): the batch a
msgpack array `[ts, events, data_parallel_rank]`, each event a map tagged by `"type"` (the class
name), its fields in vLLM's order, those at their defaults left out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import msgspec

from epd.kv.publisher import ZmqPublisher

# vLLM's ExternalBlockHash: the low 64 bits of the digest as an int (its default), or the
# digest itself where VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
ExternalBlockHash: TypeAlias = bytes | int

# What vLLM's block pool names every block of the engine's own KV cache, on any platform (its
# CPU backend runs the same block pool): "CPU" is its offloading connector's second tier, blocks
# copied out to host memory, and routers file it as that lower tier. epd's blocks are the
# engine's own cache even where that lies in CPU memory, so "GPU", as vLLM would name them.
MEDIUM = "GPU"
# Kimi-VL's language model is DeepSeek-V3's, one group of MLA layers: vLLM's kv_cache_spec_kind
# for it, and its only KV cache group.
SPEC_KIND = "mla_attention"
GROUP = 0


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the cache; a map on the wire, `"type"` naming the class."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]  # the blocks' tokens, block_size for each hash
    block_size: int
    lora_id: int | None  # epd serves no LoRA adapters: None, as lora_name
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events: an array on the wire."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


PUBLISHERS = ("zmq", "null")
ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py): its JSON keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: zmq where enabled, else null (as vLLM)
    endpoint: str = "tcp://*:5557"  # bound where it has * or ::, else connected (as vLLM)
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        problem = self._problem()
        if problem:
            raise ValueError(f"kv_events_config: {problem}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The JSON object vLLM takes; a ValueError names a key it does not know or a value of
        the wrong type."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config: not JSON ({e}): {text!r}") from None
        if not isinstance(given, dict):
            raise ValueError(f"kv_events_config: must be a JSON object, got {text!r}")
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(given) - set(hints))
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                f"(vLLM's are {', '.join(f.name for f in dataclasses.fields(cls))})"
            )
        for key, value in given.items():
            if not _is_a(value, hints[key]):
                raise ValueError(f"kv_events_config: {key} must be {_named(hints[key])}")
        return cls(**given)

    def _problem(self) -> str | None:
        if self.publisher not in PUBLISHERS:
            return f"publisher {self.publisher!r}: epd publishes with zmq (or null: not at all)"
        if self.publishes and not self.endpoint.startswith(ADDRESS_SCHEMES):
            return f"endpoint {self.endpoint!r}: events need a ZeroMQ address (tcp://*:5557)"
        if self.replay_endpoint is not None and not self.replay_endpoint.startswith(
            ADDRESS_SCHEMES
        ):
            return f"replay_endpoint {self.replay_endpoint!r}: not a ZeroMQ address"
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 0:
                return f"{name} must be 0 or more"
        return None


def _is_a(value: Any, hint: Any) -> bool:
    """`value` (from JSON) is of the field type `hint`; a bool is no int here."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return any(type(value) is option for option in options)


def _named(hint: Any) -> str:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return " or ".join("null" if o is type(None) else o.__name__ for o in options)


def with_port_offset(endpoint: str, offset: int) -> str:
    """`endpoint` with `offset` added to its port: vLLM's endpoint for a data-parallel rank
    (tcp://*:5557 for rank 0 is tcp://*:5558 for rank 1); epd serve gives each role one."""
    if offset == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r}: only a tcp:// endpoint's port can be moved (by {offset})")
    host, _, port = endpoint.rpartition(":")
    moved = int(port) + offset if port.isdigit() else 0
    if host == "tcp" or not 0 < moved < 65536:
        raise ValueError(f"{endpoint!r} plus {offset}: not a tcp://HOST:PORT with a port")
    return f"{host}:{moved}"


class KVEvents(Protocol):
    """Where the block bookkeeping says what changed; `flush` at the end of each step."""

    def stored(
        self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int
    ) -> None: ...

    def removed(self, block_hashes: list[bytes]) -> None: ...

    def cleared(self) -> None: ...

    def flush(self) -> None:
        """Send what was recorded since the last flush as one KVEventBatch (nothing if empty)."""

    def close(self) -> None: ...

    @property
    def endpoint(self) -> str | None:
        """Where subscribers find the events (None: nowhere, they are off)."""


def kv_events_endpoints(events: KVEvents) -> dict[str, str]:
    """For a role's ready line: where its KV events go, if anywhere."""
    return {} if events.endpoint is None else {"kv_events": events.endpoint}


class NoEvents:
    """Events off: nothing recorded, nothing sent."""

    endpoint = None

    def stored(
        self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int
    ) -> None:
        pass

    def removed(self, block_hashes: list[bytes]) -> None:
        pass

    def cleared(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_kv_events(kv_events_config: str, data_parallel_rank: int = 0) -> NoEvents | ZmqKVEvents:
    """The sink a role's `kv_events_config` setting asks for: NoEvents where it is empty or
    publishes nothing."""
    config = KVEventsConfig.from_json(kv_events_config) if kv_events_config else None
    if config is None or not config.publishes:
        return NoEvents()
    return ZmqKVEvents(config, data_parallel_rank)


class ZmqKVEvents:
    """Records events between flushes and publishes one KVEventBatch per flush, as vLLM's
    `ZmqEventPublisher` does. Used from one thread (the engine's); never blocks it."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        assert config.publishes, "open_kv_events gives NoEvents for a config that publishes none"
        self.data_parallel_rank = data_parallel_rank
        self.endpoint: str | None = with_port_offset(config.endpoint, data_parallel_rank)
        self._hashes_as_int = _hashes_as_int()
        self._recorded: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._publisher = ZmqPublisher(
            self.endpoint,
            _replay_endpoint(config, data_parallel_rank),
            buffer_steps=config.buffer_steps,
            hwm=config.hwm,
            max_queue_size=config.max_queue_size,
            topic=config.topic,
        )

    @property
    def dropped(self) -> int:
        """Batches dropped because the publisher's queue was full."""
        return self._publisher.dropped

    def stored(
        self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int
    ) -> None:
        stored = BlockStored(
            block_hashes=self._external(block_hashes),
            parent_block_hash=None if parent is None else self._external([parent])[0],
            token_ids=list(token_ids),  # a copy: the thread encodes it after the caller goes on
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
            group_idx=GROUP,
            kv_cache_spec_kind=SPEC_KIND,
        )
        self._recorded.append(stored)

    def removed(self, block_hashes: list[bytes]) -> None:
        removed = BlockRemoved(self._external(block_hashes), medium=MEDIUM, group_idx=GROUP)
        self._recorded.append(removed)

    def cleared(self) -> None:
        self._recorded.append(AllBlocksCleared())

    def flush(self) -> None:
        if not self._recorded:
            return
        batch = KVEventBatch(time.time(), self._recorded, self.data_parallel_rank)
        self._recorded = []
        self._publisher.publish(batch)

    def close(self) -> None:
        """Send what is queued (for up to half a second), stop the publisher's thread and close
        its sockets; returns within a second."""
        self._publisher.close()

    def _external(self, digests: list[bytes]) -> list[ExternalBlockHash]:
        if not self._hashes_as_int:
            return list(digests)
        return [int.from_bytes(d, "big") & 0xFFFF_FFFF_FFFF_FFFF for d in digests]


def _replay_endpoint(config: KVEventsConfig, data_parallel_rank: int) -> str | None:
    if config.replay_endpoint is None:
        return None
    return with_port_offset(config.replay_endpoint, data_parallel_rank)


def _hashes_as_int() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default 1: ints), read as vLLM reads it."""
    value = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES={value!r}: must be 0 or 1") from None
