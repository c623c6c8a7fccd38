"""The model's sizes: frozen dataclasses with the fields of a checkpoint's `config.json`.

`epd.checkpoint.config` reads them from a checkpoint directory; the model only needs the values.
"""

from __future__ import annotations

from dataclasses import dataclass

Grid = tuple[int, int]  # an image's (h, w) in patches


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT (`vision_config`, model_type `moonvit`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    merge_kernel_size: tuple[int, int] = (2, 2)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class TextConfig:
    """DeepSeek-V3 language model (`text_config`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the KV cache holds per token per layer: normalised c_kv then rotated k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.n_routed_experts is not None
            and index >= self.first_k_dense_replace
            and index % self.moe_layer_freq == 0
        )


@dataclass(frozen=True)
class KimiVLConfig:
    """`config.json` of a `kimi_vl` checkpoint."""

    vision: VisionConfig
    text: TextConfig
    media_placeholder_token_id: int

    @property
    def merged_dim(self) -> int:
        """Width of one merged token entering the projector: 2×2 patches of the tower's width."""
        mh, mw = self.vision.merge_kernel_size
        return self.vision.hidden_size * mh * mw
