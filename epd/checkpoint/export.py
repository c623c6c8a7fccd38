"""The language model of a Kimi-VL checkpoint as a plain DeepSeek-V3 checkpoint.

transformers has no Kimi-VL, but it has DeepSeek-V3: exported, the language half loads in its
`DeepseekV3ForCausalLM` (the oracle of tests/model), in `transformers serve` and in vLLM, with
the same weights and tokenizer.

The exported config says, explicitly, every setting our model computes with, as our model reads
it (`load_model_config`: a key the checkpoint leaves out takes *our* default, which is often not
transformers'), so that no reader falls back on a default of its own: transformers' DeepseekV3
defaults `n_group` 8, `topk_group` 4, `routed_scaling_factor` 2.5, `first_k_dense_replace` 3 and
`q_lora_rank` 1536; vLLM's DeepseekV3 routes with softmax where `scoring_func` is missing and
leaves out `e_score_correction_bias` unless `topk_method` is "noaux_tc". What DeepSeek-V3 cannot
express (another scoring function or top-k method, MoE layers that are not all the layers from one
on) is refused, naming the field, rather than exported as a different model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from epd.checkpoint.config import CheckpointError, from_dict, load_model_config, read_json
from epd.checkpoint.weights import SKIPPED_SUFFIXES, tensor_files
from epd.model.config import TextConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PREFIX = "language_model."

# Settings that pick an algorithm rather than size one: DeepSeek-V3 (transformers' DeepseekV3,
# which hard-codes them, and DeepSeek's own code) implements only these, and so does our model. A
# key left out means the same to our model, so it is written out for readers whose default differs.
ONLY_VALUES: dict[str, object] = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

# Keys of text_config that the export writes itself (from what our model reads), or that
# DeepSeek-V3 spells otherwise (`rope_theta` and `rope_scaling` are `rope_parameters` in
# transformers 5).
REWRITTEN = (
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_interleave",
    "moe_layer_freq",
    "num_key_value_heads",
    "num_nextn_predict_layers",
    "architectures",
)


class ExportError(CheckpointError):
    """The checkpoint's language model is one a DeepSeek-V3 checkpoint cannot describe."""


def export_language_model(kimi: Path, out: Path) -> Path:
    """Write the language-model half of a Kimi-VL checkpoint as a plain DeepSeek-V3 one, with
    its tokenizer: what transformers' DeepseekV3ForCausalLM (and `transformers serve`) load.

    Raises ExportError, naming the field, where DeepSeek-V3 cannot express what our model runs.
    """
    raw = read_json(kimi / "config.json").get("text_config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{kimi}/config.json lacks 'text_config'")
    config = deepseek_v3_config(raw)
    load_model_config(kimi)  # what our model refuses to run, it refuses to export
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    by_file: dict[Path, list[str]] = {}
    for name, file in tensor_files(kimi).items():
        if name.startswith(PREFIX) and not name.endswith(SKIPPED_SUFFIXES):
            by_file.setdefault(file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            state |= {name.removeprefix(PREFIX): f.get_tensor(name) for name in names}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (kimi / name).is_file():
            shutil.copy(kimi / name, out / name)
    return out


def deepseek_v3_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The DeepSeek-V3 `config.json` of the language model that `raw`, a Kimi-VL checkpoint's
    text_config, describes to our model: every value as our model reads it; `raw`'s other keys
    (token ids, dtype, …) stay."""
    for key, only in ONLY_VALUES.items():
        if raw.get(key, only) != only:
            raise ExportError(
                f"cannot export text_config.{key}={raw[key]!r}: DeepSeek-V3 (transformers' "
                f"DeepseekV3) implements only {key}={only!r}, and would silently run "
                "a different model"
            )
    text = from_dict(TextConfig, raw, "config.json text_config")
    ours = asdict(text)
    for key in ("rope_theta", "moe_layer_freq", "first_k_dense_replace", "n_routed_experts"):
        del ours[key]  # each written below, in DeepSeek-V3's terms
    kept = {k: v for k, v in raw.items() if k not in REWRITTEN}
    return (
        kept
        | ours
        | moe_layers(text)
        | ONLY_VALUES
        | {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "rope_parameters": {"rope_type": "default", "rope_theta": text.rope_theta},
            "rope_interleave": True,  # our RoPE is the interleaved (GPT-J) form
            "num_key_value_heads": text.num_attention_heads,
            "num_nextn_predict_layers": 0,
        }
    )


def moe_layers(text: TextConfig) -> dict[str, Any]:
    """`n_routed_experts`, `first_k_dense_replace` and `moe_layer_freq` giving DeepSeek-V3 (whose
    MoE layers are those from `first_k_dense_replace` on) the MoE layers our model has."""
    layers = text.num_hidden_layers
    moe = [i for i in range(layers) if text.is_moe_layer(i)]
    if not moe:  # a dense model: no layer is at or past the first MoE one
        return {"n_routed_experts": 0, "first_k_dense_replace": layers, "moe_layer_freq": 1}
    if moe != list(range(moe[0], layers)):
        raise ExportError(
            f"cannot export text_config.moe_layer_freq={text.moe_layer_freq} (MoE layers "
            f"{moe} of {layers}): DeepSeek-V3 (transformers' DeepseekV3) makes every layer "
            "from first_k_dense_replace on a MoE layer"
        )
    return {
        "n_routed_experts": text.n_routed_experts,
        "first_k_dense_replace": moe[0],
        "moe_layer_freq": 1,
    }
