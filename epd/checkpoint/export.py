"""The language model of a Kimi-VL checkpoint as a plain DeepSeek-V3 checkpoint.

transformers has no Kimi-VL, but it has DeepSeek-V3: exported, the language half loads in its
`DeepseekV3ForCausalLM` (the oracle of tests/model) and in `transformers serve` (the baseline of
scripts/bench_serving.py), with the same weights and tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PREFIX = "language_model."


def export_language_model(kimi: Path, out: Path) -> Path:
    """Write the language-model half of a Kimi-VL checkpoint as a plain DeepSeek-V3 one, with
    its tokenizer: what transformers' DeepseekV3ForCausalLM (and `transformers serve`) load."""
    text = json.loads((kimi / "config.json").read_text())["text_config"]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta")}
    for key in ("topk_method", "scoring_func", "rope_scaling", "moe_layer_freq"):
        text.pop(key, None)
    text["num_key_value_heads"] = text["num_attention_heads"]
    text["num_nextn_predict_layers"] = 0
    out.mkdir()
    (out / "config.json").write_text(
        json.dumps(text | {"architectures": ["DeepseekV3ForCausalLM"]})
    )
    state: dict[str, torch.Tensor] = {}
    index = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    for file in set(index.values()):
        with safe_open(kimi / file, framework="pt") as f:
            names = [k for k in f.keys() if k.startswith(PREFIX)]  # noqa: SIM118 (not a dict)
            state |= {k.removeprefix(PREFIX): f.get_tensor(k) for k in names}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (kimi / name).is_file():
            shutil.copy(kimi / name, out / name)
    return out
