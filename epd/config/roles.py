"""One frozen dataclass per process role: every setting, its default, its help and its checks.

CLI flags and config-file keys are generated from these fields (see `sources`), so they cannot
drift from what the code reads. A bad value raises a ValueError naming the setting.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd.dtypes import MODEL_DTYPES

DTYPE_CHOICES = ("auto", *MODEL_DTYPES)
ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")
LOG_LEVELS = ("debug", "info", "warning", "error")
REASONING_PARSERS = ("auto", "none", "kimi_vl")
AUTOMATIC = ("threads", "batch_patches", "max_prefill_tokens", "max_kv_tokens")  # 0: by device


def option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def required(help: str) -> Any:
    return field(metadata={"help": help})


def _check_value(name: str, value: Any) -> str | None:
    """Why `value` is not acceptable for a setting called `name`, or None."""
    if isinstance(value, float) and not math.isfinite(value):  # a NaN passes `< 0` and `>= 1`
        return "must be a finite number"
    if name == "dtype" and value not in DTYPE_CHOICES:
        return f"must be one of {', '.join(DTYPE_CHOICES)}"
    if name.endswith("port") and not 0 < value < 65536:
        return "must be a port number, 1 to 65535"
    if name.endswith("_s") and not value > 0:
        return "must be a positive number of seconds"
    if name in AUTOMATIC:
        return "must be 0 (automatic) or a positive number" if value < 0 else None
    if name == "min_chunk_tokens" and value < 0:
        return "must be 0 (off) or a positive number"
    if name == "busy_threads" and value < 0:
        return "must be 0 (as threads) or a positive number"
    if name.startswith("max_") and not value >= 1:
        return "must be at least 1"
    if name == "log_level" and value.lower() not in ("", *LOG_LEVELS):
        return f"must be one of {', '.join(LOG_LEVELS)}"
    if name == "reasoning_parser" and value not in REASONING_PARSERS:
        return f"must be one of {', '.join(REASONING_PARSERS)}"
    if name == "log_format" and value not in ("text", "json"):
        return "must be text or json"
    addresses = value if isinstance(value, tuple) else (value,)
    is_address = name in ("bind", "encoders", "decoders", "prefills") or (
        name == "advertise" and value
    )
    if is_address and not (addresses and all(a.startswith(ADDRESS_SCHEMES) for a in addresses)):
        return "must be ZeroMQ addresses such as tcp://127.0.0.1:7101"
    return None


@dataclass(frozen=True)
class Settings:
    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _check_value(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: {problem}")


@dataclass(frozen=True)
class ModelOptions(Settings):
    model: str = required("checkpoint directory (Hugging Face layout)")
    device: str = option("cpu", "torch device, e.g. cpu or cuda:0")
    dtype: str = option(
        "auto",
        "auto (the checkpoint's torch_dtype where the device runs it, else float32 on CPU and "
        "bfloat16 on CUDA), float32, bfloat16, float16",
    )
    trust_remote_code: bool = option(
        False,
        "run the checkpoint's own tokenizer code where it ships no tokenizer.json nor "
        "tiktoken.model (never needed for Kimi-VL)",
    )
    cpu_weight_copies: bool = option(
        True,
        "on a CPU, keep copies of the weights laid out for oneDNN (faster products), within "
        "half the memory free once the weights are read; --no-cpu-weight-copies where roles "
        "that start together share too little memory",
    )
    threads: int = option(
        0, "torch threads (0: the machine's cores, 4 on a GPU; epd serve gives each role a share)"
    )
    log_level: str = option(
        "", "debug, info, warning or error (default: $EPD_LOG_LEVEL, else info)"
    )
    log_format: str = option("text", "text, or json: one JSON object per log line")
    zmq_curve_keys: str = option(
        "",
        "directory of ZeroMQ CURVE keys (made by `epd keys`): encrypted traffic, and peers "
        "without the keys are refused (default: off, for loopback)",
    )


def prefills_option() -> Any:
    return option(
        ("tcp://127.0.0.1:7102",),
        "prefill addresses this role replies to: exact, or tcp://NETWORK:PORT such as "
        "tcp://10.0.0.0/8:7102 (port * for any); requests naming another are refused",
    )


def watchdog_option() -> Any:
    return option(
        10.0, "GET /health answers 503 after this long without progress; twice that, it exits"
    )


@dataclass(frozen=True)
class EncodeConfig(ModelOptions):
    bind: str = option("tcp://127.0.0.1:7101", "ZeroMQ address that receives encode requests")
    prefills: tuple[str, ...] = prefills_option()
    health_host: str = option("127.0.0.1", "host of the GET /health endpoint")
    health_port: int = option(7111, "port of the GET /health endpoint")
    max_image_pixels: int = option(50_000_000, "refuse decoded images larger than this")
    max_image_bytes: int = option(20 * 1024 * 1024, "size limit of one image, encoded")
    max_images: int = option(16, "most images in one encode request")
    batch_patches: int = option(
        0,
        "image patches encoded together in one forward, across waiting requests (0: 16384 on "
        "a GPU; one request at a time on a CPU, where batching measured slower)",
    )
    watchdog_s: float = watchdog_option()


@dataclass(frozen=True)
class DecodeConfig(ModelOptions):
    bind: str = option("tcp://127.0.0.1:7103", "ZeroMQ address that receives KV hand-offs")
    prefills: tuple[str, ...] = prefills_option()
    health_host: str = option("127.0.0.1", "host of the GET /health endpoint")
    health_port: int = option(7113, "port of the GET /health endpoint")
    max_batch_size: int = option(64, "most sequences advanced together in one decode step")
    max_kv_tokens: int = option(
        0,
        "most tokens the KV cache holds over all running sequences, in blocks of 16; others "
        "wait (0: every batch slot at the full context, or what half the free memory holds; "
        "on a CPU a quarter, as decode keeps a copy of the running caches, up to as much again)",
    )
    drain_timeout_s: float = option(
        30.0,
        "on SIGTERM, how long the sequences under way may take to finish (new hand-offs "
        "are refused)",
    )
    watchdog_s: float = watchdog_option()


@dataclass(frozen=True)
class PrefillConfig(ModelOptions):
    host: str = option("127.0.0.1", "host of the OpenAI-compatible HTTP API")
    port: int = option(8000, "port of the OpenAI-compatible HTTP API")
    bind: str = option("tcp://127.0.0.1:7102", "ZeroMQ address that receives embeddings and tokens")
    advertise: str = option("", "address peers reply to (default: the bind address)")
    encoders: tuple[str, ...] = option(("tcp://127.0.0.1:7101",), "encode addresses")
    decoders: tuple[str, ...] = option(("tcp://127.0.0.1:7103",), "decode addresses")
    served_model_name: str = option("", "model name in the API (default: checkpoint folder)")
    encode_timeout_s: float = option(60.0, "longest wait for an image payload")
    token_timeout_s: float = option(60.0, "longest wait for the next token from decode")
    image_fetch_timeout_s: float = option(
        10.0, "time limit for fetching an http(s) image, redirects and headers included"
    )
    allowed_media_domains: tuple[str, ...] = option(
        (),
        "hosts image URLs may name, at any address, e.g. images.internal (default: any host "
        "with only public addresses)",
    )
    max_image_bytes: int = option(20 * 1024 * 1024, "size limit of one image, encoded")
    max_image_pixels: int = option(50_000_000, "refuse images larger than this (from their header)")
    max_images: int = option(16, "most images in one request")
    default_max_tokens: int = option(1024, "max_tokens when a request gives none")
    max_n: int = option(16, "most choices (n) one request may ask for, up to 128")
    reasoning_parser: str = option(
        "auto",
        "kimi_vl: chat replies give the reasoning between ◁think▷ and ◁/think▷ as `reasoning` "
        "beside `content`, and structured outputs apply to the answer (vLLM's flag); none: "
        "all is content; auto: kimi_vl for a thinking checkpoint (its chat template names "
        "◁think▷, or its name is a -Thinking model's)",
    )
    max_prefill_tokens: int = option(
        0,
        "prompt tokens prefilled in one forward: waiting prompts fill it, one that does not fit "
        "runs in chunks (0: 512 on a CPU, 4096 on a GPU)",
    )
    busy_threads: int = option(
        0,
        "torch threads for a forward while other requests are in flight (0: threads); "
        "where prefill shares cores with decode, epd serve sets what decode's share leaves",
    )
    min_chunk_tokens: int = option(
        0,
        "0: prompts behind one that runs in chunks wait for its last chunk (first come, first "
        "served); N: those that fit whole may pass it into a forward while its chunk keeps at "
        "least N tokens",
    )
    image_cache_bytes: int = option(
        512 * 1024 * 1024, "memory for embeddings of images seen before (0: no cache)"
    )
    enable_prefix_caching: bool = option(
        True,
        "keep prompts' KV after their requests, so a prompt that begins as one before did (the "
        "next turn of a chat, a shared system prompt, the same image) prefills only the rest "
        "(vLLM's flag)",
    )
    prefix_cache_bytes: int = option(
        1024 * 1024 * 1024,
        "memory for the prefix cache's KV blocks, least recently used out first (taken as "
        "prompts are kept, not at start)",
    )
    max_request_bytes: int = option(
        100 * 1024 * 1024, "request bodies over this size get 413 before they are read"
    )
    max_text_request_bytes: int = option(
        16 * 1024 * 1024,
        "the same for routes that take no images (/v1/completions, /detokenize)",
    )
    max_queued_requests: int = option(
        256,
        "requests that may wait for image fetching, encode or prefill at once; past it a new "
        "one gets 503 with Retry-After at once",
    )
    drain_timeout_s: float = option(
        30.0, "on SIGTERM, how long requests in flight may take to finish (new ones get 503)"
    )
    api_key: str = option(
        "", "key every /v1 request must send as 'Authorization: Bearer' (or set EPD_API_KEY)"
    )
    access_log: bool = option(False, "log a line per HTTP request (uvicorn's access log)")
    allowed_origins: tuple[str, ...] = option(
        (), "origins browsers may call the API from (CORS), e.g. https://app.example; * for any"
    )
    watchdog_s: float = watchdog_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        host = self.bind.split("://", 1)[1].rsplit(":", 1)[0]
        if host in ("*", "0.0.0.0", "[::]", "::") and not self.advertise:
            raise ValueError(
                f"advertise is required when bind={self.bind!r} listens on every interface: "
                "peers need an address they can reply to"
            )

    @property
    def reply_address(self) -> str:
        return self.advertise or self.bind

    @property
    def model_name(self) -> str:
        """The name clients put in `model`: the served name, else the checkpoint's folder."""
        return self.served_model_name or Path(self.model).resolve().name


@dataclass(frozen=True)
class ServeConfig(ModelOptions):
    host: str = option("127.0.0.1", "host of the OpenAI-compatible HTTP API")
    port: int = option(8000, "port of the OpenAI-compatible HTTP API")
    internal_base_port: int = option(
        7101, "loopback ports for the processes' traffic: ZeroMQ on N..N+2, health on N+10, N+12"
    )
    max_restart_delay_s: float = option(30.0, "longest wait before restarting a child that died")

    def addresses(self, role: str) -> dict[str, Any]:
        """The loopback addresses `epd serve` gives one of its children."""
        n, loopback = self.internal_base_port, "tcp://127.0.0.1"
        encode, prefill, decode = (f"{loopback}:{n + i}" for i in range(3))
        return {
            "encode": {"bind": encode, "health_port": n + 10, "prefills": (prefill,)},
            "prefill": {
                "bind": prefill,
                "host": self.host,
                "port": self.port,
                "encoders": (encode,),
                "decoders": (decode,),
            },
            "decode": {"bind": decode, "health_port": n + 12, "prefills": (prefill,)},
        }[role]


ROLES: dict[str, type[ModelOptions]] = {
    "encode": EncodeConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "serve": ServeConfig,
}
