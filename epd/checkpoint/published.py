"""Random checkpoints in the likeness of Kimi-VL's published ones: their `config.json`, their
image processor's limit, their tokenizer's layout and vocabulary (tiktoken, 163,584 ranks and
256 special tokens above them), their RoPE buffers, bfloat16 weights; the depth cut so that a
test can load them (a dense and a mixture-of-experts layer; one vision block), every width kept.

`KIMI_VL_A3B` is Kimi-VL-A3B-Instruct's `config.json` as published (revision 398eede). The two
Thinking models are fine-tunes of it: the same architecture, so the same values; they differ
in their name, in what they write (their reasoning first, between ◁think▷ and ◁/think▷) and,
for -Thinking-2506, in the image processor's limit (3.2 million pixels: 16384 patches).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epd.checkpoint.config import load_model_config
from epd.checkpoint.synthetic import (
    write_generation_config,
    write_processor_config,
    write_weights,
)
from epd.checkpoint.synthetic_tokenizer import dump, write_tokenizer

KIMI_VL_RANKS = 163584

KIMI_VL_A3B: dict[str, Any] = {
    "architectures": ["KimiVLForConditionalGeneration"],
    "auto_map": {
        "AutoConfig": "configuration_kimi_vl.KimiVLConfig",
        "AutoModel": "modeling_kimi_vl.KimiVLForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_vl.KimiVLForConditionalGeneration",
    },
    "vision_config": {
        "model_type": "moonvit",
        "patch_size": 14,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "init_pos_emb_height": 64,
        "init_pos_emb_width": 64,
        "merge_kernel_size": [2, 2],
        "torch_dtype": "bfloat16",
    },
    "text_config": {
        "vocab_size": 163840,
        "max_position_embeddings": 131072,
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "ep_size": 1,
        "routed_scaling_factor": 2.446,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 6,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-05,
        "pretraining_tp": 1,
        "use_cache": True,
        "rope_theta": 800000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 163584,
        "pad_token_id": 163839,
        "eos_token_id": 163585,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "ignore_index": -100,
    "media_placeholder_token_id": 163605,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.3",
    "tie_word_embeddings": False,
    "vocab_size": 163840,
    "model_type": "kimi_vl",
}


@dataclass(frozen=True)
class Published:
    config: dict[str, Any]
    in_token_limit: int = 4096  # preprocessor_config.json


PUBLISHED = {
    "Kimi-VL-A3B-Instruct": Published(KIMI_VL_A3B),
    "Kimi-VL-A3B-Thinking": Published(KIMI_VL_A3B),
    "Kimi-VL-A3B-Thinking-2506": Published(KIMI_VL_A3B, in_token_limit=16384),
}


def make_published(
    out: str | Path,
    name: str,
    layers: int = 2,
    vision_layers: int = 1,
    seed: int = 0,
    shards: int = 2,
    weights: Path | None = None,
) -> Path:
    """Write a random checkpoint in the likeness of `name` (see the module's docstring) into
    `out`, `layers` deep, its tower `vision_layers` deep; with `weights`, the safetensors of
    another such checkpoint of the same depth are linked instead of drawn anew."""
    published = PUBLISHED[name]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(published.config)
    config["text_config"]["num_hidden_layers"] = layers
    config["vision_config"]["num_hidden_layers"] = vision_layers
    text = config["text_config"]
    vocab = write_tokenizer(out, "tiktoken", 512, text["max_position_embeddings"], KIMI_VL_RANKS)
    assert vocab.size == text["vocab_size"] and vocab.ids["[BOS]"] == text["bos_token_id"]
    dump(out / "config.json", config)
    vision = config["vision_config"]
    merge = tuple(vision["merge_kernel_size"])
    write_processor_config(out, vision["patch_size"], merge, published.in_token_limit)  # type: ignore[arg-type]
    write_generation_config(out, vocab)
    if weights is None:
        model = load_model_config(out)
        write_weights(out, model, seed, shards, torch.bfloat16, inv_freq=True)
    else:
        link_weights(weights, out)
    return out


def link_weights(source: Path, out: Path) -> None:
    """The safetensors files (and index) of `source`, linked into `out`."""
    names = [p.name for p in source.iterdir() if p.name.startswith("model")]
    for name in names:
        (out / name).symlink_to((source / name).resolve())
