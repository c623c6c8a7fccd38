"""Frozen views of a checkpoint's config files.

Every number comes from the checkpoint's own `config.json`, `preprocessor_config.json` and
`generation_config.json`; nothing here is specific to one checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from epd.config.settings import SAMPLING_FIELDS
from epd.dtypes import MODEL_DTYPES
from epd.model.config import KimiVLConfig, TextConfig, VisionConfig

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or holds something we cannot serve."""


@dataclass(frozen=True)
class ProcessorConfig:
    """`preprocessor_config.json`: the image processor's rules."""

    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    patch_size: int = 14
    in_token_limit: int = 4096
    pad_input: bool = True
    merge_kernel_size: tuple[int, int] = (2, 2)


@dataclass(frozen=True)
class GenerationConfig:
    """`generation_config.json`: the token ids that end a reply, and the sampling defaults a
    request that leaves a field out gets (the keys vLLM takes, `max_new_tokens` as `max_tokens`)."""

    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, float] = dataclasses.field(default_factory=dict)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def from_dict(cls: type[T], raw: dict[str, Any], where: str) -> T:
    """Build a config dataclass from the keys it names; extra keys in `raw` are ignored."""
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in raw:
            value = raw[field.name]
            kwargs[field.name] = tuple(value) if isinstance(value, list) else value
        elif field.default is dataclasses.MISSING:
            raise CheckpointError(f"{where} lacks required key {field.name!r}")
    return cls(**kwargs)


def _check_text(raw: dict[str, Any]) -> None:
    supported = {
        "topk_method": ("noaux_tc", None),
        "scoring_func": ("sigmoid", None),
        "hidden_act": ("silu", None),
        "rope_scaling": (None,),
        "tie_word_embeddings": (False, None),
        "attention_bias": (False, None),
    }
    for key, allowed in supported.items():
        if raw.get(key) not in allowed:
            raise CheckpointError(
                f"config.json text_config.{key}={raw.get(key)!r} is not supported "
                f"(expected one of {allowed})"
            )


def load_model_config(checkpoint: str | Path) -> KimiVLConfig:
    checkpoint = Path(checkpoint)
    raw = read_json(checkpoint / "config.json")
    if raw.get("model_type") != "kimi_vl":
        raise CheckpointError(
            f"{checkpoint}/config.json has model_type {raw.get('model_type')!r}, expected 'kimi_vl'"
        )
    if raw.get("tie_word_embeddings"):
        raise CheckpointError("config.json tie_word_embeddings=true is not supported")
    for part in ("vision_config", "text_config", "media_placeholder_token_id"):
        if part not in raw:
            raise CheckpointError(f"{checkpoint}/config.json lacks {part!r}")
    _check_text(raw["text_config"])
    return KimiVLConfig(
        vision=from_dict(VisionConfig, raw["vision_config"], "config.json vision_config"),
        text=from_dict(TextConfig, raw["text_config"], "config.json text_config"),
        media_placeholder_token_id=int(raw["media_placeholder_token_id"]),
    )


def context_length(text: TextConfig, max_model_len: int = 0) -> int:
    """The tokens one request may use, prompt and output: the checkpoint's context, or the
    `max_model_len` asked for. More than the checkpoint's is refused, as vLLM refuses it:
    positions past those it was trained on give wrong outputs."""
    own = text.max_position_embeddings
    if max_model_len > own:
        raise CheckpointError(
            f"max_model_len={max_model_len} is more than the checkpoint's context length "
            f"({own}, max_position_embeddings in config.json)"
        )
    return max_model_len or own


def stored_dtype(checkpoint: str | Path) -> str | None:
    """The dtype config.json says the weights were saved in (`torch_dtype`, or `dtype` as newer
    transformers write it): Kimi-VL's own is bfloat16. None when it names none we run."""
    raw = read_json(Path(checkpoint) / "config.json")
    name = raw.get("torch_dtype", raw.get("dtype"))
    return name if name in MODEL_DTYPES else None


def load_processor_config(checkpoint: str | Path) -> ProcessorConfig:
    raw = read_json(Path(checkpoint) / "preprocessor_config.json")
    return from_dict(ProcessorConfig, raw, "preprocessor_config.json")


def load_generation_config(checkpoint: str | Path) -> GenerationConfig:
    raw = read_json(Path(checkpoint) / "generation_config.json")
    eos = raw.get("eos_token_id")
    if eos is None:
        raise CheckpointError("generation_config.json lacks 'eos_token_id'")
    ids = (eos,) if isinstance(eos, int) else tuple(int(i) for i in eos)
    return GenerationConfig(eos_token_ids=ids, sampling_defaults=sampling_defaults(raw))


def load_sampling_defaults(
    folder: str | Path, source: str = "auto", overrides: str = ""
) -> dict[str, float]:
    """What a request that leaves sampling fields out gets, as vLLM's `--generation-config`
    says: auto, the checkpoint's generation_config.json; vllm, nothing; else that of the
    directory `source` names (which may hold sampling fields alone); then `overrides`, a JSON
    object of such fields (`--override-generation-config`)."""
    found = {}
    if source != "vllm":
        folder = folder if source == "auto" else source
        found = sampling_defaults(read_json(Path(folder) / "generation_config.json"))
    return found | sampling_overrides(overrides)


def sampling_overrides(text: str) -> dict[str, float]:
    """`--override-generation-config`'s JSON object (checked with the settings)."""
    return sampling_defaults(json.loads(text)) if text else {}


def sampling_defaults(raw: dict[str, Any]) -> dict[str, float]:
    defaults = {key: raw[key] for key in SAMPLING_FIELDS if raw.get(key) is not None}
    if raw.get("max_new_tokens") is not None:
        defaults["max_tokens"] = raw["max_new_tokens"]
    for key, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"generation_config.json: {key} must be a number, not {value!r}")
    return defaults
