"""The machinery of settings: a field's default, help and vLLM flag (`option`), and the checks
every value passes (`Settings`), whichever dataclass holds it; `roles` holds the roles' own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd.config.speculative import SpeculativeConfig
from epd.config.vllm import VllmFlag
from epd.dtypes import MODEL_DTYPES

DTYPE_CHOICES = ("auto", *MODEL_DTYPES)
ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")
LOG_LEVELS = ("debug", "info", "warning", "error")
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "critical", "trace")
REASONING_PARSERS = ("auto", "none", "kimi_vl")
# The sampling defaults a generation_config.json may give, and --override-generation-config.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_FIELDS = (*SAMPLING_FIELDS, "max_new_tokens")
# vLLM's --kv-events-config keys; epd.kv.events.KVEventsConfig reads them fully.
KV_EVENTS_FIELDS = (
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
)
AUTOMATIC = (  # 0: by device, or by the checkpoint
    "threads",
    "batch_patches",
    "max_prefill_tokens",
    "max_kv_tokens",
    "max_model_len",
)


def option(default: Any, help: str, vllm: str | VllmFlag = "") -> Any:
    """A setting: its default, its help, and the vLLM flag it stands for, if one does."""
    return field(default=default, metadata=metadata(help, vllm))


def required(help: str, vllm: str | VllmFlag = "") -> Any:
    return field(metadata=metadata(help, vllm))


def metadata(help: str, vllm: str | VllmFlag) -> dict[str, Any]:
    if isinstance(vllm, str):  # the name alone: vLLM writes the value as epd does
        return {"help": help, "vllm": VllmFlag(vllm) if vllm else None}
    return {"help": help, "vllm": vllm}


def _check_value(name: str, value: Any) -> str | None:
    """Why `value` is not acceptable for a setting called `name`, or None."""
    # A NaN passes `< 0` and `>= 1`; a benchmark's rate may be inf (all at once, as vLLM's).
    if (
        isinstance(value, float)
        and not math.isfinite(value)
        and (name, value) != ("rate", math.inf)
    ):
        return "must be a finite number"
    if name == "dtype" and value not in DTYPE_CHOICES:
        return f"must be one of {', '.join(DTYPE_CHOICES)}"
    if name.endswith("port") and not 0 < value < 65536:
        return "must be a port number, 1 to 65535"
    if name.endswith("_s") and not value > 0:
        return "must be a positive number of seconds"
    if name in AUTOMATIC:
        return "must be 0 (automatic) or a positive number" if value < 0 else None
    if name == "allowed_local_media_path" and value and not Path(value).is_dir():
        return "must be a directory"
    own_file = name == "generation_config" and value not in ("auto", "vllm")
    if own_file and not Path(value, "generation_config.json").is_file():
        return "must be auto, vllm or a directory holding a generation_config.json"
    if name == "override_generation_config" and value:
        return generation_overrides_problem(value)
    if name == "kv_events_config" and value:
        return json_object_problem(value, KV_EVENTS_FIELDS)
    if name == "decoder_kv_events" and value:
        return peer_endpoint_problem(value)
    if name == "speculative_config" and value:
        return speculative_problem(value)
    if name == "seed" and not -1 <= value < 2**63:
        return "must be -1 (fresh draws) or from 0 to 2**63 - 1"
    if name == "min_chunk_tokens" and value < 0:
        return "must be 0 (off) or a positive number"
    if name in ("busy_threads", "alone_threads") and value < 0:
        return "must be 0 (as threads) or a positive number"
    if name == "gpu_memory_utilization" and not 0 <= value <= 1:
        return "must be a share in (0, 1], or 0 (automatic)"
    if name.startswith("max_") and not value >= 1:
        return "must be at least 1"
    if name == "log_level" and value.lower() not in ("", *LOG_LEVELS):
        return f"must be one of {', '.join(LOG_LEVELS)}"
    if name == "uvicorn_log_level" and value not in ("", *UVICORN_LOG_LEVELS):
        return f"must be one of {', '.join(UVICORN_LOG_LEVELS)}"
    if name == "reasoning_parser" and value not in REASONING_PARSERS:
        return f"must be one of {', '.join(REASONING_PARSERS)}"
    if name == "log_format" and value not in ("text", "json"):
        return "must be text or json"
    addresses = value if isinstance(value, tuple) else (value,)
    # (serve's encoders, decoders and prefills are counts of processes, not addresses)
    is_address = (
        name in ("bind", "encoders", "decoders", "prefills") and not isinstance(value, int)
    ) or (name == "advertise" and value)
    if is_address and not (addresses and all(a.startswith(ADDRESS_SCHEMES) for a in addresses)):
        return "must be ZeroMQ addresses such as tcp://127.0.0.1:7101"
    return None


def json_object_problem(text: str, known: tuple[str, ...]) -> str | None:
    """Why `text` is not a JSON object of keys among `known`, or None (its values are for the
    setting's reader to check)."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError:
        given = None
    if not isinstance(given, dict):
        return f"must be a JSON object of {', '.join(known)}"
    unknown = sorted(set(given) - set(known))
    return f"has unknown keys {', '.join(unknown)}; known: {', '.join(known)}" if unknown else None


PEER_FIELD = re.compile(r"\{(host|port(?:[+-]\d{1,5})?)\}")


def peer_endpoint(template: str, address: str) -> str | None:
    """A peer's endpoint by `template`, from its ZeroMQ address: `{host}` its host, `{port}` its
    port, `{port+N}` that plus N (tcp://10.0.0.5:7103 by tcp://{host}:5557 is
    tcp://10.0.0.5:5557). None where the address is not tcp:// and the template needs a field."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    tcp = address.startswith("tcp://") and host and port.isdigit()

    def field(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == "host":
            return host
        return str(int(port) + int(name[4:] or 0))

    if not tcp and PEER_FIELD.search(template):
        return None
    endpoint = PEER_FIELD.sub(field, template)
    port = endpoint.rpartition(":")[2]
    if endpoint.startswith("tcp://") and not (port.isdigit() and 0 < int(port) < 65536):
        return None  # {port+N} past the last port: that decoder cannot be followed
    return endpoint


def peer_endpoint_problem(template: str) -> str | None:
    if not template.startswith(ADDRESS_SCHEMES):
        return "must be a ZeroMQ address such as tcp://{host}:5557"
    rest = PEER_FIELD.sub("", template)
    if "{" in rest or "}" in rest:
        return "may hold only {host}, {port} and {port+N} (a peer's host, its port, that plus N)"
    if rest == template:  # one endpoint for every peer: each credited with all the others' blocks
        return "must name each peer's own endpoint, by {host}, {port} or {port+N}"
    if "*" in template or "::" in template:
        return "is where to connect to each peer's publisher: a host, not a wildcard"
    return None


def speculative_problem(text: str) -> str | None:
    """What is wrong with a --speculative-config, or None."""
    try:
        SpeculativeConfig.from_json(text)
    except ValueError as e:
        return str(e)
    return None


def generation_overrides_problem(text: str) -> str | None:
    try:
        given = json.loads(text)
    except json.JSONDecodeError:
        given = None
    known = ", ".join(GENERATION_FIELDS)
    if not isinstance(given, dict) or not set(given) <= set(GENERATION_FIELDS):
        return f"must be a JSON object of {known}"
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in given.values()):
        return "must give each field a number"
    return None


@dataclass(frozen=True)
class Settings:
    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _check_value(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: {problem}")
