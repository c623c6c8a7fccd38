"""What one benchmark run sends and how: a frozen dataclass, so its flags come from the fields."""

from __future__ import annotations

from dataclasses import dataclass

from epd.config.roles import Settings, option


@dataclass(frozen=True)
class BenchConfig(Settings):
    base_url: str = option("http://127.0.0.1:8000/v1", "OpenAI-compatible API to load")
    model: str = option("", "model name to ask for (default: the server's first)")
    api_key: str = option("", "sent as a bearer token, if the server needs one")
    requests: int = option(64, "requests to send (after the warm-up)")
    concurrency: int = option(
        0,
        "requests in flight at once: a closed loop of that many, or with --rate the most "
        "(default: 1, or no limit with --rate)",
    )
    rate: float = option(0.0, "Poisson arrivals per second; 0: a closed loop at --concurrency")
    prompt_tokens: int = option(256, "words of text per prompt (a word is a token or more)")
    system_prompt_tokens: int = option(
        0, "words of a system prompt, the same in every request (a prefix a cache may reuse)"
    )
    turns: int = option(
        1,
        "turns of each conversation, one after another: each turn's prompt is the turns "
        "before (a reply of --output-tokens words each) and a new user message; --requests "
        "counts turns",
    )
    output_tokens: int = option(64, "max_tokens of each request")
    ignore_eos: bool = option(True, "ask for exactly --output-tokens (ignore_eos)")
    images: int = option(0, "images per request")
    image_width: int = option(448, "image width in pixels")
    image_height: int = option(448, "image height in pixels")
    repeat_images: bool = option(False, "send the same images in every request")
    warmup: int = option(1, "requests sent first and left out of the results")
    seed: int = option(0, "seed of the prompts and images")
    goodput_ttft_ms: float = option(0.0, "TTFT target for goodput (0: none)")
    goodput_tpot_ms: float = option(0.0, "TPOT target for goodput (0: none)")
    timeout_s: float = option(600.0, "longest a request may take, start to end")
    label: str = option("", "name of this run in a plot (default: the model)")
    json: str = option("", "write the summary and every request's timings here")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("requests", "prompt_tokens", "output_tokens", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        for name in (
            "concurrency",
            "images",
            "system_prompt_tokens",
            "warmup",
            "rate",
            "goodput_ttft_ms",
            "goodput_tpot_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must not be negative")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={self.base_url!r}: must be an http(s) URL")
