"""`epd make-checkpoint`: random Kimi-VL checkpoints in the real Hugging Face layout.

The weights are random but everything else is real: safetensors (sharded with an index, or one
file), the kimi_vl config, preprocessor and generation configs, and a tokenizer carrying Kimi's
special tokens and chat template in any of the layouts real checkpoints ship
(`synthetic_tokenizer.py`). Tests and benchmarks load them with the same code that loads the
real model; `published.py` makes them in the likeness of Kimi-VL's own checkpoints.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from epd.checkpoint.synthetic_tokenizer import Vocabulary, dump, write_tokenizer
from epd.model.config import KimiVLConfig, TextConfig, VisionConfig
from epd.model.kimi_vl import KimiVL

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

Sizes = tuple[VisionConfig, dict[str, Any]]  # the vision config, and the text config's sizes
PRESETS: dict[str, Sizes] = {
    # Fast enough for unit tests; a 16×16 position table forces interpolation.
    "tiny": (
        VisionConfig(32, 2, 2, 64, init_pos_emb_height=16, init_pos_emb_width=16),
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
        ),
    ),
    # Big enough that matrix multiplies, not Python, dominate a forward pass on a CPU.
    "small": (
        VisionConfig(256, 6, 4, 1024),
        dict(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=6,
            num_attention_heads=8,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            moe_intermediate_size=256,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
        ),
    ),
    # Kimi-VL-A3B's own sizes (all but the vocabulary): for GPU checks, written in bfloat16.
    "a3b": (
        VisionConfig(1152, 27, 16, 4304),
        dict(
            hidden_size=2048,
            intermediate_size=11264,
            num_hidden_layers=27,
            num_attention_heads=16,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
        ),
    ),
}
TEXT_DEFAULTS = dict(
    routed_scaling_factor=2.446,
    first_k_dense_replace=1,
    rms_norm_eps=1e-5,
    rope_theta=800000.0,
    max_position_embeddings=8192,
    norm_topk_prob=True,
)


def make_config(
    sizes: Sizes, vocab_size: int, placeholder_id: int, q_lora_rank: int | None
) -> KimiVLConfig:
    vision, text = sizes
    text_config = TextConfig(vocab_size=vocab_size, **text, **TEXT_DEFAULTS)  # type: ignore[arg-type]
    return KimiVLConfig(vision, replace(text_config, q_lora_rank=q_lora_rank), placeholder_id)


def init_weights(model: KimiVL, generator: torch.Generator) -> None:
    """Random weights: N(0, 0.02) matrices, norms near 1, small biases and routing biases."""
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator, device=tensor.device)
        if name.endswith(("norm.weight", "norm0.weight", "norm1.weight", "layernorm.weight")):
            tensor.copy_(1 + 0.1 * noise)
        else:
            tensor.copy_(0.02 * noise)


def save_sharded(state: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """`shards` files and their index; one shard is `model.safetensors` alone, as small
    checkpoints ship."""
    if shards == 1:
        whole = {n: t.contiguous().cpu() for n, t in state.items()}
        save_file(whole, out / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(state)
    per_shard = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n].contiguous().cpu() for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def config_json(
    config: KimiVLConfig, vocab: Vocabulary, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    text = asdict(config.text) | {
        "model_type": "deepseek_v3",
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "rope_scaling": None,
        "attention_bias": False,
        "bos_token_id": vocab.ids["[BOS]"],
        "eos_token_id": vocab.ids["[EOS]"],
        "pad_token_id": vocab.ids["[PAD]"],
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["KimiVLForConditionalGeneration"],
        "model_type": "kimi_vl",
        "vision_config": asdict(config.vision) | {"model_type": "moonvit"},
        "text_config": text,
        "media_placeholder_token_id": config.media_placeholder_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_side_files(
    out: Path, config: KimiVLConfig, vocab: Vocabulary, dtype: torch.dtype = torch.float32
) -> None:
    """config.json, and the image processor's and generation's configs."""
    dump(out / "config.json", config_json(config, vocab, dtype))
    write_processor_config(out, config.vision.patch_size, config.vision.merge_kernel_size)
    write_generation_config(out, vocab)


def write_processor_config(
    out: Path, patch_size: int, merge: tuple[int, int], in_token_limit: int = 4096
) -> None:
    processor = {
        "image_processor_type": "KimiVLImageProcessor",
        "patch_size": patch_size,
        "pad_input": True,
        "in_token_limit": in_token_limit,
        "merge_kernel_size": list(merge),
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
    }
    dump(out / "preprocessor_config.json", processor)


def write_generation_config(out: Path, vocab: Vocabulary) -> None:
    ids = vocab.ids
    generation = {
        "eos_token_id": [ids["[EOS]"], ids["<|im_end|>"]],
        "bos_token_id": ids["[BOS]"],
        "pad_token_id": ids["[PAD]"],
    }
    dump(out / "generation_config.json", generation)


def write_weights(
    out: Path,
    config: KimiVLConfig,
    seed: int = 0,
    shards: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    inv_freq: bool = False,
) -> None:
    """Random weights for `config` in `dtype` (`init_weights`); `shards` files, or as many as
    4 GiB pieces of the whole, each with an equal number of tensors. `inv_freq` adds each
    layer's `rotary_emb.inv_freq` buffer, as some real checkpoints hold (a loader skips it)."""
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device("meta"):
        model = KimiVL(config).to(dtype)
    model = model.to_empty(device=device)  # only now is memory taken, in the target dtype
    with torch.no_grad():
        init_weights(model, generator)
    state = model.state_dict()
    if inv_freq:
        state |= rotary_buffers(config.text)
    size = sum(t.numel() * t.element_size() for t in state.values())
    save_sharded(state, out, max(shards, math.ceil(size / (4 << 30))))


def rotary_buffers(text: TextConfig) -> dict[str, torch.Tensor]:
    """Each layer's RoPE frequencies, under the name DeepSeek's modelling code saved them."""
    dim = text.qk_rope_head_dim
    inv_freq = 1.0 / text.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    prefix = "language_model.model.layers"
    names = (f"{prefix}.{i}.self_attn.rotary_emb.inv_freq" for i in range(text.num_hidden_layers))
    return {name: inv_freq.clone() for name in names}


def make_checkpoint(
    out: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    q_lora_rank: int | None = None,
    vocab_size: int = 512,
    shards: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tokenizer: str = "appended",
    inv_freq: bool = False,
) -> Path:
    """Write a random checkpoint of `preset` size into `out` and return its path.

    `device` is where the weights are drawn (a GPU draws billions in seconds); `tokenizer` is
    the tokenizer's layout (`synthetic_tokenizer.LAYOUTS`); `shards` 1 writes one
    `model.safetensors`; `inv_freq` adds the RoPE buffers some checkpoints hold.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    max_length = int(TEXT_DEFAULTS["max_position_embeddings"])
    vocab = write_tokenizer(out, tokenizer, vocab_size, max_length)
    config = make_config(PRESETS[preset], vocab.size, vocab.ids["<|media_pad|>"], q_lora_rank)
    write_weights(out, config, seed, shards, dtype, device, inv_freq)
    write_side_files(out, config, vocab, dtype)
    return out
