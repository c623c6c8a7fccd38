"""Per-role configuration: one frozen dataclass per process, the single source of CLI flags.

Each field becomes a `--flag` (underscores → dashes) with its type, default and help text, so the
flags cannot drift from the config the code reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def required(help: str) -> Any:
    return field(metadata={"help": help})


@dataclass(frozen=True)
class ModelOptions:
    model: str = required("checkpoint directory (Hugging Face layout)")
    device: str = option("cpu", "torch device, e.g. cpu or cuda:0")
    dtype: str = option(
        "auto", "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16"
    )
    trust_remote_code: bool = option(False, "allow the checkpoint's tokenizer code (real Kimi-VL)")


@dataclass(frozen=True)
class EncodeConfig(ModelOptions):
    bind: str = option("tcp://127.0.0.1:7101", "ZeroMQ address that receives encode requests")
    health_host: str = option("127.0.0.1", "host of the GET /health endpoint")
    health_port: int = option(7111, "port of the GET /health endpoint")
    max_image_pixels: int = option(50_000_000, "refuse decoded images larger than this")


@dataclass(frozen=True)
class DecodeConfig(ModelOptions):
    bind: str = option("tcp://127.0.0.1:7103", "ZeroMQ address that receives KV hand-offs")
    health_host: str = option("127.0.0.1", "host of the GET /health endpoint")
    health_port: int = option(7113, "port of the GET /health endpoint")
    max_batch_size: int = option(64, "most sequences advanced together in one decode step")


@dataclass(frozen=True)
class PrefillConfig(ModelOptions):
    host: str = option("127.0.0.1", "host of the OpenAI-compatible HTTP API")
    port: int = option(8000, "port of the OpenAI-compatible HTTP API")
    bind: str = option("tcp://127.0.0.1:7102", "ZeroMQ address that receives embeddings and tokens")
    advertise: str = option("", "address peers reply to (default: --bind)")
    encoders: tuple[str, ...] = option(("tcp://127.0.0.1:7101",), "encode addresses")
    decoders: tuple[str, ...] = option(("tcp://127.0.0.1:7103",), "decode addresses")
    served_model_name: str = option("", "model name in the API (default: checkpoint folder)")
    encode_timeout_s: float = option(60.0, "longest wait for an image payload")
    token_timeout_s: float = option(60.0, "longest wait for the next token from decode")
    image_fetch_timeout_s: float = option(10.0, "time limit for fetching an http(s) image")
    max_image_bytes: int = option(20 * 1024 * 1024, "size limit of one image, encoded")
    max_images: int = option(16, "most images in one request")
    max_image_pixels: int = option(50_000_000, "refuse images larger than this (from their header)")
    default_max_tokens: int = option(1024, "max_tokens when a request gives none")

    @property
    def reply_address(self) -> str:
        return self.advertise or self.bind


@dataclass(frozen=True)
class ServeConfig(ModelOptions):
    host: str = option("127.0.0.1", "host of the OpenAI-compatible HTTP API")
    port: int = option(8000, "port of the OpenAI-compatible HTTP API")
    internal_base_port: int = option(
        7101, "loopback ports for the processes' traffic: ZeroMQ on N..N+2, health on N+10, N+12"
    )
    max_restart_delay_s: float = option(30.0, "longest wait before restarting a child that died")

    def role_flags(self, role: str) -> list[str]:
        """Command-line flags that make one child of `epd serve`."""
        n, loopback = self.internal_base_port, "tcp://127.0.0.1"
        common = ["--model", self.model, "--device", self.device, "--dtype", self.dtype]
        common += ["--trust-remote-code"] if self.trust_remote_code else []
        encode, prefill, decode = (f"{loopback}:{n + i}" for i in range(3))
        flags = {
            "encode": ["--bind", encode, "--health-port", str(n + 10)],
            "prefill": [
                "--bind",
                prefill,
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--encoders",
                encode,
                "--decoders",
                decode,
            ],
            "decode": ["--bind", decode, "--health-port", str(n + 12)],
        }
        return common + flags[role]


def _flag_type(hint: Any) -> tuple[Any, dict[str, Any]]:
    origin = typing.get_origin(hint)
    if hint is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if origin is tuple:
        return typing.get_args(hint)[0], {"nargs": "+"}
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint, {}


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, extra = _flag_type(hints[f.name])
        name = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"help": f.metadata.get("help", ""), **extra}
        if kind is not None:
            kwargs["type"] = kind
        if f.default is dataclasses.MISSING:
            parser.add_argument(name, required=True, **kwargs)
        else:
            kwargs["help"] += f" (default: {f.default})"
            parser.add_argument(name, default=f.default, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)
