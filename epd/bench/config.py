"""What one benchmark run sends and how: a frozen dataclass, so its flags come from the fields.

A field that means what a `vllm bench serve` flag means takes that flag too (`vllm=`), so a
vLLM benchmark's command line runs `epd bench`.
"""

from __future__ import annotations

from dataclasses import dataclass

from epd.config.roles import Settings, option

DATASETS = ("random", "sharegpt")
CHAT, COMPLETIONS = "/chat/completions", "/completions"
BACKENDS = {"openai-chat": CHAT, "openai": COMPLETIONS, "vllm": COMPLETIONS}  # vLLM's names


@dataclass(frozen=True)
class BenchConfig(Settings):
    base_url: str = option(
        "",
        "the server: its OpenAI base (http://host:8000/v1) or its root, as vLLM's "
        "(default: http://--host:--port)",
        vllm="--base-url",
    )
    host: str = option("127.0.0.1", "the server's host, where --base-url is not given", "--host")
    port: int = option(8000, "the server's port, where --base-url is not given", "--port")
    endpoint: str = option(
        "",
        "the API route: /v1/chat/completions, or the legacy /v1/completions (text only) "
        "(default: chat, or completions where --backend is openai or vllm)",
        vllm="--endpoint",
    )
    backend: str = option(
        "",
        "vLLM's name of the request's form, for its command lines: openai-chat (chat), openai "
        "or vllm (legacy completions) (default: as --endpoint)",
        vllm="--backend",
    )
    model: str = option("", "model name to ask for (default: the server's first)", "--model")
    api_key: str = option(
        "", "sent as a bearer token, if the server needs one (default: $OPENAI_API_KEY)"
    )
    requests: int = option(64, "requests to send (after the warm-up)", "--num-prompts")
    concurrency: int = option(
        0,
        "requests in flight at once: a closed loop of that many, or with --rate the most "
        "(default: 1, or no limit with --rate)",
        vllm="--max-concurrency",
    )
    rate: float = option(
        0.0,
        "Poisson arrivals per second, inf: all at once; 0: a closed loop at --concurrency",
        vllm="--request-rate",
    )
    dataset: str = option(
        "random",
        "random (prompts of --prompt-tokens words) or sharegpt (--dataset-path's conversations)",
        vllm="--dataset-name",
    )
    dataset_path: str = option(
        "", "the ShareGPT JSON file: each conversation's first turns", "--dataset-path"
    )
    sharegpt_output_tokens: int = option(
        0, "max_tokens of each ShareGPT request (0: its reply's length)", "--sharegpt-output-len"
    )
    prompt_tokens: int = option(
        256, "words of text per prompt (a word is a token or more)", "--random-input-len"
    )
    system_prompt_tokens: int = option(
        0, "words of a system prompt, the same in every request (a prefix a cache may reuse)"
    )
    turns: int = option(
        1,
        "turns of each conversation, one after another: each turn's prompt is the turns "
        "before (a reply of --output-tokens words each) and a new user message; --requests "
        "counts turns",
    )
    output_tokens: int = option(64, "max_tokens of each request", "--random-output-len")
    ignore_eos: bool = option(True, "ask for exactly max_tokens (ignore_eos)", "--ignore-eos")
    images: int = option(0, "images per request")
    image_width: int = option(448, "image width in pixels")
    image_height: int = option(448, "image height in pixels")
    repeat_images: bool = option(False, "send the same images in every request")
    warmup: int = option(1, "requests sent first and left out of the results", "--num-warmups")
    seed: int = option(0, "seed of the prompts, images and ShareGPT's order", "--seed")
    goodput_ttft_ms: float = option(0.0, "TTFT target for goodput (0: none)")
    goodput_tpot_ms: float = option(0.0, "TPOT target for goodput (0: none)")
    timeout_s: float = option(600.0, "longest a request may take, start to end")
    label: str = option("", "name of this run in a plot (default: the model)", "--label")
    json: str = option(
        "", "write the summary and every request's timings here", "--result-filename"
    )
    save_result: bool = option(
        False, "write them even without --json, to a file named after the run", "--save-result"
    )
    result_dir: str = option(
        "", "the folder --json's file or --save-result's goes in", "--result-dir"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("requests", "prompt_tokens", "output_tokens", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        for name in (
            "concurrency",
            "images",
            "system_prompt_tokens",
            "sharegpt_output_tokens",
            "warmup",
            "rate",
            "goodput_ttft_ms",
            "goodput_tpot_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must not be negative")
        self._check_server()
        self._check_dataset()

    def _check_server(self) -> None:
        if self.base_url and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={self.base_url!r}: must be an http(s) URL")
        if not self.host or any(c in self.host for c in "/?#@ "):
            raise ValueError(f"host={self.host!r}: must be a host name or address")
        if self.backend and self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: must be one of {', '.join(BACKENDS)}")
        if not (self.route.startswith("/") and self.route.endswith(COMPLETIONS)):
            raise ValueError(
                f"endpoint={self.endpoint!r}: must be a path such as /v1/chat/completions "
                "or /v1/completions"
            )
        if self.backend and self.route.endswith(CHAT) != (BACKENDS[self.backend] == CHAT):
            raise ValueError(f"backend={self.backend}: it does not send to {self.endpoint}")
        if self.images and not self.chat:
            raise ValueError(f"images={self.images}: {self.route} takes text only")

    def _check_dataset(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset={self.dataset!r}: must be one of {', '.join(DATASETS)}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset=sharegpt: name its JSON file with --dataset-path")
        if self.dataset == "random" and self.dataset_path:
            raise ValueError(
                f"dataset_path={self.dataset_path!r}: the random dataset reads no file "
                "(--dataset-name sharegpt reads one)"
            )
        if self.dataset == "sharegpt" and self.turns > 1:
            raise ValueError(f"turns={self.turns}: ShareGPT gives each conversation one turn")

    @property
    def route(self) -> str:
        """The endpoint, given or as the backend's."""
        if self.endpoint:
            return self.endpoint
        return "/v1" + BACKENDS.get(self.backend, CHAT)

    @property
    def chat(self) -> bool:
        """Whether requests go to chat completions (else the legacy completions)."""
        return self.route.endswith(CHAT)

    @property
    def api_base(self) -> str:
        """The folder of the endpoint, where /models is too: a /v1 that ends --base-url and
        starts --endpoint written once (OpenAI clients' base URLs end with it; vLLM's do not)."""
        server = self.base_url or f"http://{bracketed(self.host)}:{self.port}"
        folder = self.route.removesuffix(CHAT if self.chat else COMPLETIONS)
        server = server.rstrip("/")
        if server.endswith("/v1") and (folder == "/v1" or folder.startswith("/v1/")):
            folder = folder.removeprefix("/v1")
        return server + folder

    @property
    def request_url(self) -> str:
        return self.api_base + (CHAT if self.chat else COMPLETIONS)


def bracketed(host: str) -> str:
    """An IPv6 address in brackets, as a URL writes it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
