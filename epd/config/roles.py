"""One frozen dataclass per process role: every setting, its default, its help and the vLLM
flag it stands for, if one does.

CLI flags and config-file keys are generated from these fields (see `sources`), so they cannot
drift from what the code reads. A bad value raises a ValueError naming the setting (`settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd.config.settings import ADDRESS_SCHEMES as ADDRESS_SCHEMES  # the wire's, too
from epd.config.settings import UVICORN_LOG_LEVELS, Settings, option, required
from epd.config.vllm import VllmFlag, dtype_name, image_limit, readable_int


@dataclass(frozen=True)
class ModelOptions(Settings):
    model: str = required(
        "checkpoint directory (Hugging Face layout), or a Hugging Face repository name such as "
        "moonshotai/Kimi-VL-A3B-Instruct, found in the Hugging Face cache or downloaded into it "
        "(only found, with HF_HUB_OFFLINE=1); or give it first, as vLLM's: epd serve MODEL",
        vllm="--model",
    )
    revision: str = option(
        "", "a repository's branch, tag or commit to serve (default: main)", vllm="--revision"
    )
    download_dir: str = option(
        "",
        "the Hugging Face cache a repository is found in and downloaded to (default: "
        "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)",
        vllm="--download-dir",
    )
    served_model_name: tuple[str, ...] = option(
        (),
        "names clients may give as `model`; replies and metrics carry the first (default: the "
        "repository name given as the model, else the checkpoint's folder, or for a folder of "
        "the Hugging Face cache the path given)",
        vllm="--served-model-name",
    )
    device: str = option("cpu", "torch device, e.g. cpu or cuda:0")
    dtype: str = option(
        "auto",
        "auto (the checkpoint's torch_dtype where the device runs it, else float32 on CPU and "
        "bfloat16 on CUDA), float32, bfloat16, float16",
        vllm=VllmFlag("--dtype", dtype_name, "half and float too"),
    )
    trust_remote_code: bool = option(
        False,
        "run the checkpoint's own tokenizer code where it ships no tokenizer.json nor "
        "tiktoken.model (never needed for Kimi-VL)",
        vllm="--trust-remote-code",
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

    @property
    def model_name(self) -> str:
        """The name replies and metrics carry: the first served name, else the checkpoint's
        folder, or the path as given where that folder is a snapshot of the Hugging Face cache
        (named by a commit hash)."""
        if self.served_model_name:
            return self.served_model_name[0]
        folder = Path(self.model).resolve()
        return self.model if folder.parent.name == "snapshots" else folder.name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give as `model`: the served names, and the model given."""
        return (*(self.served_model_name or (self.model_name,)), self.model)


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


def max_model_len_option() -> Any:
    return option(
        0,
        "most tokens one request may use, its prompt (images included) and output together "
        "(0: the checkpoint's max_position_embeddings; more than that is an error)",
        vllm=VllmFlag("--max-model-len", readable_int, "32768, 32k or 32K"),
    )


def max_image_bytes_option() -> Any:
    return option(20 * 1024 * 1024, "size limit of one image, encoded")


def max_request_bytes_option() -> Any:
    return option(100 * 1024 * 1024, "request bodies over this size get 413 before they are read")


def max_text_request_bytes_option() -> Any:
    return option(
        16 * 1024 * 1024,
        "the same for routes that take no images (/v1/completions, /detokenize)",
    )


def allowed_origins_option() -> Any:
    return option(
        (),
        "origins browsers may call the API from (CORS), e.g. https://app.example; * for any; "
        "listed with spaces, or as vLLM's JSON list '[\"*\"]'",
        vllm="--allowed-origins",
    )


def kv_events_option() -> Any:
    return option(
        "",
        "publish the KV cache's stored and removed blocks as vLLM does, for a KV-aware router, "
        'in vLLM\'s JSON: \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"topic": "kv-events"}\' (replay_endpoint, buffer_steps, hwm, max_queue_size and '
        "publisher as vLLM's; default: off)",
        vllm="--kv-events-config",
    )


IMAGE_LIMIT = VllmFlag("--limit-mm-per-prompt", image_limit, "image=N, or '{\"image\": N}'")


@dataclass(frozen=True)
class EncodeConfig(ModelOptions):
    bind: str = option("tcp://127.0.0.1:7101", "ZeroMQ address that receives encode requests")
    prefills: tuple[str, ...] = prefills_option()
    health_host: str = option("127.0.0.1", "host of the GET /health endpoint")
    health_port: int = option(7111, "port of the GET /health endpoint")
    max_image_pixels: int = option(50_000_000, "refuse decoded images larger than this")
    max_image_bytes: int = max_image_bytes_option()
    max_images: int = option(16, "most images in one encode request", vllm=IMAGE_LIMIT)
    batch_patches: int = option(
        0,
        "image patches encoded together in one forward, across waiting requests (0: 16384 on "
        "a GPU; one request at a time on a CPU, where batching measured slower)",
    )
    alone_threads: int = option(
        0,
        "torch threads for a forward while the machine's other processes leave its cores idle "
        "(0: threads); on a CPU epd serve sets the machine's cores: the other roles then wait",
    )
    watchdog_s: float = watchdog_option()


@dataclass(frozen=True)
class DecodeConfig(ModelOptions):
    bind: str = option("tcp://127.0.0.1:7103", "ZeroMQ address that receives KV hand-offs")
    prefills: tuple[str, ...] = prefills_option()
    health_host: str = option("127.0.0.1", "host of the GET /health endpoint")
    health_port: int = option(7113, "port of the GET /health endpoint")
    max_batch_size: int = option(
        64, "most sequences advanced together in one decode step", vllm="--max-num-seqs"
    )
    max_kv_tokens: int = option(
        0,
        "most tokens the KV cache holds over all running sequences, in blocks of 16; others "
        "wait (0: every batch slot at max_model_len, or what half the free memory holds; "
        "on a CPU a quarter, as decode keeps a copy of the running caches, up to as much again)",
    )
    max_model_len: int = max_model_len_option()
    enable_prefix_caching: bool = option(
        True,
        "keep the blocks of prompts' KV after their requests (in free space only), so that a "
        "hand-off of a prompt that begins as one before did carries only the rows after them",
        vllm="--enable-prefix-caching",
    )
    gpu_memory_utilization: float = option(
        0.0,
        "share of the device's memory decode may use, weights and KV cache together: an "
        "automatic KV budget (max_kv_tokens 0) takes what the share leaves once the weights are "
        "loaded, within the memory free; on a CPU, the share of the memory free then that the "
        "cache and its gathered copy take together (0: half the free memory, on a CPU a quarter)",
        vllm="--gpu-memory-utilization",
    )
    kv_events_config: str = kv_events_option()
    speculative_config: str = option(
        "",
        'speculative decoding, in vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2}\' '
        "(n-gram prompt lookup: each step verifies up to that many drafted tokens at once; "
        "outputs are distributed as without; default: off)",
        vllm="--speculative-config",
    )
    drain_timeout_s: float = option(
        30.0,
        "on SIGTERM, how long the sequences under way may take to finish (new hand-offs "
        "are refused)",
    )
    alone_threads: int = option(
        0,
        "torch threads for a step while the machine's other processes leave its cores idle "
        "(0: threads); on a CPU epd serve sets the machine's cores",
    )
    watchdog_s: float = watchdog_option()


@dataclass(frozen=True)
class PrefillConfig(ModelOptions):
    host: str = option("127.0.0.1", "host of the OpenAI-compatible HTTP API", vllm="--host")
    port: int = option(8000, "port of the OpenAI-compatible HTTP API", vllm="--port")
    bind: str = option("tcp://127.0.0.1:7102", "ZeroMQ address that receives embeddings and tokens")
    advertise: str = option("", "address peers reply to (default: the bind address)")
    encoders: tuple[str, ...] = option(("tcp://127.0.0.1:7101",), "encode addresses")
    decoders: tuple[str, ...] = option(("tcp://127.0.0.1:7103",), "decode addresses")
    decoder_kv_events: str = option(
        "",
        "where each decoder publishes its KV events (its --kv-events-config endpoint, bound), "
        "as a ZeroMQ address where {host} is the decoder's host, {port} its port and {port+N} "
        "that plus N, e.g. tcp://{host}:5557: every prefill then knows what every decoder holds, "
        "not only what it handed it (default: none; epd serve sets it for a fleet)",
    )
    peer_metrics: tuple[str, ...] = option(
        (),
        "other roles' GET /metrics URLs whose series this API's /metrics serves too, so one "
        "scrape target carries the stack (epd serve sets its encoder's and decoder's)",
    )
    encode_timeout_s: float = option(60.0, "longest wait for an image payload")
    token_timeout_s: float = option(60.0, "longest wait for the next token from decode")
    migration_limit: int = option(
        3,
        "times a stream may move to another decoder when the one streaming it dies: prefilled "
        "again with its reply so far (from the prefix cache), it goes on with no token lost or "
        "repeated (Dynamo's name; 0: a dead decoder ends its streams; requests of n > 1 never "
        "move)",
    )
    image_fetch_timeout_s: float = option(
        10.0, "time limit for fetching an http(s) image, redirects and headers included"
    )
    allowed_media_domains: tuple[str, ...] = option(
        (),
        "hosts image URLs may name, at any address, e.g. images.internal (default: any host "
        "with only public addresses)",
        vllm="--allowed-media-domains",
    )
    allowed_local_media_path: str = option(
        "",
        "a directory whose images requests may name as file:// URLs; any client may then read "
        "any image under it (default: none, file:// URLs are refused)",
        vllm="--allowed-local-media-path",
    )
    max_image_bytes: int = max_image_bytes_option()
    max_image_pixels: int = option(50_000_000, "refuse images larger than this (from their header)")
    max_images: int = option(16, "most images in one request", vllm=IMAGE_LIMIT)
    default_max_tokens: int = option(1024, "max_tokens when a request gives none")
    generation_config: str = option(
        "auto",
        "sampling defaults for what a request leaves out: auto, the checkpoint's "
        "generation_config.json; vllm, none (temperature 1 and so on); or a directory holding "
        "a generation_config.json",
        vllm="--generation-config",
    )
    override_generation_config: str = option(
        "",
        "sampling defaults over those, as a JSON object: '{\"temperature\": 0.6}' (temperature, "
        "top_p, top_k, min_p, repetition_penalty, max_new_tokens)",
        vllm="--override-generation-config",
    )
    seed: int = option(
        -1,
        "seed of the draws of requests that give no seed: a server started again answers the "
        "same requests, sent one at a time, alike (-1: fresh draws)",
        vllm="--seed",
    )
    max_n: int = option(16, "most choices (n) one request may ask for, up to 128")
    reasoning_parser: str = option(
        "auto",
        "kimi_vl: chat replies give the reasoning between ◁think▷ and ◁/think▷ as `reasoning` "
        "beside `content`, and structured outputs apply to the answer; none: all is content; "
        "auto: kimi_vl for a thinking checkpoint (its chat template names ◁think▷, or its name "
        "is a -Thinking model's)",
        vllm="--reasoning-parser",
    )
    max_prefill_tokens: int = option(
        0,
        "prompt tokens prefilled in one forward: waiting prompts fill it, one that does not fit "
        "runs in chunks (0: 512 on a CPU, 4096 on a GPU)",
        vllm="--max-num-batched-tokens",
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
        "next turn of a chat, a shared system prompt, the same image) prefills only the rest",
        vllm="--enable-prefix-caching",
    )
    prefix_cache_bytes: int = option(
        1024 * 1024 * 1024,
        "memory for the prefix cache's KV blocks, least recently used out first (taken as "
        "prompts are kept, not at start)",
    )
    kv_events_config: str = kv_events_option()
    max_request_bytes: int = max_request_bytes_option()
    max_text_request_bytes: int = max_text_request_bytes_option()
    max_request_bytes_at_once: int = option(
        300 * 1024 * 1024,
        "request bodies over 1 MiB being read and parsed hold at most this many bytes together; "
        "past it a new one gets 503 with Retry-After before it is read (a body alone is always "
        "read)",
    )
    max_arriving_bodies: int = option(
        128,
        "request bodies that may be arriving at once; past it a new one gets 503 with "
        "Retry-After before it is read",
    )
    max_arriving_bodies_per_client: int = option(
        32,
        "of those, how many may come from one client address (behind a proxy every client has "
        "the proxy's: raise it to max_arriving_bodies there); past it a new one gets 503",
    )
    request_body_timeout_s: float = option(
        30.0,
        "longest time from a request's headers to its body's last byte (a small body gets "
        "less: 2 s and a second per 64 KiB); past it the request gets 408 and its connection "
        "closes",
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
        "",
        "key every /v1 request must send as 'Authorization: Bearer' (or set EPD_API_KEY)",
        vllm="--api-key",
    )
    access_log: bool = option(False, "log a line per HTTP request (uvicorn's access log)")
    disable_log_requests: bool = option(
        False,
        "the line logged as each request ends (its id, tokens, images, TTFT and time) only at "
        "debug level",
        vllm="--disable-log-requests",
    )
    uvicorn_log_level: str = option(
        "",
        f"level of uvicorn's own log lines: {', '.join(UVICORN_LOG_LEVELS)} (default: warning, "
        "or --log-level where that is higher)",
        vllm="--uvicorn-log-level",
    )
    allowed_origins: tuple[str, ...] = allowed_origins_option()
    max_model_len: int = max_model_len_option()
    chat_template: str = option(
        "",
        "a chat template instead of the checkpoint's: a file holding it, or the Jinja text "
        "itself (default: the checkpoint's)",
        vllm="--chat-template",
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


ROUTINGS = ("cache-aware", "round-robin", "least-loaded")


@dataclass(frozen=True)
class RouteConfig(ModelOptions):
    """`epd route`: the OpenAI API in front of several prefills. It reads the checkpoint's
    tokenizer, chat template and image processor (to name each request's KV blocks as prefill
    does) and holds no weights; device, dtype and threads do not apply."""

    host: str = option("127.0.0.1", "host of the OpenAI-compatible HTTP API", vllm="--host")
    port: int = option(8000, "port of the OpenAI-compatible HTTP API", vllm="--port")
    prefill_urls: tuple[str, ...] = option(
        ("http://127.0.0.1:8001",),
        "the prefills' API URLs; a host name is looked up again every 5 s and each address it "
        "gives is a prefill (a Kubernetes headless Service)",
    )
    routing: str = option(
        "cache-aware",
        "cache-aware: the prefill that holds the longest prefix of the request's KV blocks, "
        "weighed against its load; round-robin; least-loaded: fewest requests in flight",
    )
    kv_events_bind: str = option(
        "tcp://127.0.0.1:5557",
        "ZeroMQ address the prefills' KV events come to (their --kv-events-config endpoint, "
        "each with a topic of its own, named in its /health); empty: none, and cache-aware "
        "routing follows the requests it sent each prefill instead",
    )
    health_interval_s: float = option(1.0, "how often each prefill's /health is read")
    max_image_bytes: int = max_image_bytes_option()
    max_request_bytes: int = max_request_bytes_option()
    max_text_request_bytes: int = max_text_request_bytes_option()
    api_key: str = option(
        "",
        "key every /v1 request must send as 'Authorization: Bearer' (or set EPD_API_KEY); "
        "it is passed on to the prefills, which check the same key",
        vllm="--api-key",
    )
    allowed_origins: tuple[str, ...] = allowed_origins_option()
    max_model_len: int = max_model_len_option()
    chat_template: str = option(
        "",
        "the chat template the prefills were given (--chat-template), so that blocks are "
        "named alike (default: the checkpoint's)",
        vllm="--chat-template",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        if not self.prefill_urls:
            raise ValueError("prefill_urls: give at least one prefill")
        for url in self.prefill_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"prefill_urls: {url!r} is not an http:// or https:// URL")


@dataclass(frozen=True)
class ServeConfig(ModelOptions):
    host: str = option("127.0.0.1", "host of the OpenAI-compatible HTTP API", vllm="--host")
    port: int = option(8000, "port of the OpenAI-compatible HTTP API", vllm="--port")
    internal_base_port: int = option(
        7101,
        "loopback ports for the processes' traffic: ZeroMQ on N..N+2, health on N+10, N+12; "
        "the second of each role 100 higher, and so on; with several prefills, their APIs on "
        "N+21 (+100 each) and their KV events to the router on N+30",
    )
    max_restart_delay_s: float = option(30.0, "longest wait before restarting a child that died")
    encoders: int = option(1, "encode processes to start")
    prefills: int = option(
        1, "prefill processes to start; more than one start behind `epd route`, on the API port"
    )
    decoders: int = option(1, "decode processes to start")

    def count(self, role: str) -> int:
        """How many of `role` serve starts (the router only in front of several prefills)."""
        counts = {"encode": self.encoders, "prefill": self.prefills, "decode": self.decoders}
        return counts.get(role, int(self.prefills > 1))

    def __post_init__(self) -> None:
        super().__post_init__()
        for role in ("encoders", "prefills", "decoders"):
            if not 1 <= getattr(self, role) <= 32:
                raise ValueError(f"{role} must be 1 to 32")

    def zmq(self, role: str, i: int) -> str:
        offset = {"encode": 0, "prefill": 1, "decode": 2}[role]
        return f"tcp://127.0.0.1:{self.internal_base_port + 100 * i + offset}"

    def health_port(self, role: str, i: int) -> int:
        offset = {"encode": 10, "prefill": 21, "decode": 12}[role]  # prefill's: its API
        return self.internal_base_port + 100 * i + offset

    @property
    def kv_events_port(self) -> int:
        return self.internal_base_port + 30

    def addresses(self, role: str, i: int = 0) -> dict[str, Any]:
        """The loopback addresses `epd serve` gives its `i`-th child of `role`."""
        every = {r: tuple(self.zmq(r, j) for j in range(self.count(r))) for r in PIPELINE}
        if role in ("encode", "decode"):
            return {
                "bind": self.zmq(role, i),
                "health_port": self.health_port(role, i),
                "prefills": every["prefill"],
            }
        if role == "prefill":
            behind = self.count("route") > 0  # the router has the API port
            peers = [
                self.health_port(r, j) for r in ("encode", "decode") for j in range(self.count(r))
            ]
            return {
                "bind": self.zmq(role, i),
                "host": "127.0.0.1" if behind else self.host,
                "port": self.health_port(role, i) if behind else self.port,
                "encoders": every["encode"],
                "decoders": every["decode"],
                "peer_metrics": tuple(f"http://127.0.0.1:{port}/metrics" for port in peers),
            }
        urls = (f"http://127.0.0.1:{self.health_port('prefill', j)}" for j in range(self.prefills))
        return {
            "host": self.host,
            "port": self.port,
            "prefill_urls": tuple(urls),
            "kv_events_bind": f"tcp://127.0.0.1:{self.kv_events_port}",
        }

    def ports(self) -> dict[int, str]:
        """Every port serve's children listen on: "API" or "internal"."""
        taken = {self.port: "API"}
        for role in PIPELINE:
            for i in range(self.count(role)):
                taken[int(self.zmq(role, i).rsplit(":", 1)[1])] = "internal"
                if role != "prefill" or self.count("route"):
                    taken[self.health_port(role, i)] = "internal"
        if self.count("route"):
            taken[self.kv_events_port] = "internal"
        return taken


PIPELINE = ("encode", "prefill", "decode")
ROLES: dict[str, type[ModelOptions]] = {
    "encode": EncodeConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
    "route": RouteConfig,
    "serve": ServeConfig,
}
