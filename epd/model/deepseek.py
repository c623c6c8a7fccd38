"""The DeepSeek-V3 language model of Kimi-VL, with prefill and latent-cache decode paths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, cast

import torch
from torch import nn

from epd.model.config import TextConfig
from epd.model.cpu_gathered import KeepGathered
from epd.model.mla import MLAttention
from epd.model.moe import MLP, MoE
from epd.model.norm import RMSNorm
from epd.model.paged import BlockReader, GatherEachStep, PagedBatch
from epd.model.rope import rotor, text_angles


class Past(Protocol):
    """A prompt's rows prefilled before (a `BlockTable`): what its next chunk attends to."""

    length: int

    def layer(self, index: int) -> torch.Tensor:
        """That layer's rows, (length, latent_dim)."""
        ...


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, index: int) -> None:
        super().__init__()
        d = config.hidden_size
        self.self_attn = MLAttention(config, index)
        self.mlp = MoE(config) if config.is_moe_layer(index) else MLP(d, config.intermediate_size)
        self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)

    def prefill(
        self,
        x: torch.Tensor,
        angles: torch.Tensor,
        lengths: list[int] | None = None,
        pasts: list[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.input_layernorm(x)
        attended, latent = self.self_attn.prefill(normed, angles, lengths, pasts)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), latent

    def decode(self, x: torch.Tensor, angles: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        x = x + self.self_attn.decode(self.input_layernorm(x), angles, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def decoder_layers(self) -> Iterator[DecoderLayer]:
        """The layers, typed (iterating a ModuleList gives plain Modules)."""
        return cast(Iterator[DecoderLayer], iter(self.layers))


class DeepseekV3ForCausalLM(nn.Module):
    """Positions are plain 1-D token indices; RoPE covers only the qk_rope_head_dim part."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states (..., D) → float32 logits (..., vocab)."""
        return self.lm_head(hidden).float()

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotor of 1-D positions (T,) → (T, rope/2), shared by every layer."""
        return rotor(text_angles(positions, self.config.qk_rope_head_dim, self.config.rope_theta))

    def prefill(
        self,
        embeds: torch.Tensor,
        lengths: list[int] | None = None,
        pasts: list[Past | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings (T, D) → final hidden states (T, D) and their latent cache rows
        (layers, T, latent_dim).

        With `lengths`, embeds holds several prompts back to back: each attends only to itself
        (split the rows by `lengths` on dim 1 for each prompt's). With `pasts`, a prompt's
        embeddings continue one whose earlier tokens are in its past (chunked prefill, a prefix
        found cached): they start at the past's length and attend to it, read one layer at a
        time; the rows returned are the new ones only.
        """
        lengths = lengths or [embeds.shape[0]]
        pasts = pasts or [None] * len(lengths)
        starts = [0 if past is None else past.length for past in pasts]
        spans = zip(starts, lengths, strict=True)
        positions = torch.cat([torch.arange(s, s + n, device=embeds.device) for s, n in spans])
        angles = self.angles(positions)
        x, latents = embeds, []
        for index, layer in enumerate(self.model.decoder_layers()):
            rows = [None if not past or not past.length else past.layer(index) for past in pasts]
            x, latent = layer.prefill(x, angles, lengths, rows)
            latents.append(latent)
        return self.model.norm(x), torch.stack(latents)

    def block_reader(self) -> BlockReader:
        """How decode steps read a `BlockPool`'s blocks on this model's device: on a CPU, where
        no paged attention kernel reads them in place and memory is plentiful, from a copy kept
        gathered between steps; elsewhere gathered every step (a kept copy is unmeasured there,
        and device memory tighter)."""
        if self.lm_head.weight.device.type == "cpu":
            return KeepGathered()
        return GatherEachStep()

    def decode(self, input_ids: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """The step's tokens (R,): one per request, or several (its last and its drafts, each
        request's together) → final hidden states (R, D); each cache grows by its rows, written
        into its blocks (`BlockReader.batch` makes the batch over a pool; `PagedBatch.keep`
        rolls back the rows refused)."""
        angles = self.angles(batch.positions)
        x = self.embed(input_ids)
        for layer in self.model.decoder_layers():
            x = layer.decode(x, angles, batch)
        batch.advance()
        return self.model.norm(x)
