"""Multi-head latent attention (MLA), DeepSeek-V3 style.

Per token: q = q_proj(x) → (q_nope, q_pe) per head; kv_a_proj_with_mqa(x) → (c_kv, k_pe) where
k_pe is one head shared by all. The cache keeps c_kv after `kv_a_layernorm` and k_pe after RoPE.
Prefill expands c_kv with `kv_b_proj` into per-head k_nope and v. Decode never expands the cache:
it absorbs kv_b_proj's key half into the query and its value half into the output, so scores are
taken against c_kv directly (multi-query attention over the latent). A small chunk after a long
past (chunked prefill) does the same, rather than expand the whole past again (`absorbs`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from epd.model.attention import (
    fused_latent_attention,
    latent_attention,
    products_win_on_cpu,
    prompt_products,
)
from epd.model.config import TextConfig
from epd.model.norm import RMSNorm
from epd.model.paged import PagedBatch, Part
from epd.model.rope import rotate


@functools.cache
def bottom_right_causal() -> Any:
    """torch's causal bias aligned to the bottom right, `causal_lower_right`. Imported at its
    first use, not with this module: its module brings torch's compiler with it (1.5 s of a
    process's start on 2 cores), which encode and decode never run; prefill calls this as it
    starts, so that no request waits for the import."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right


class MLAttention(nn.Module):
    def __init__(self, config: TextConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.heads, self.nope, self.rope = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
        )
        self.rank, self.v_dim = c.kv_lora_rank, c.v_head_dim
        self.scale = c.qk_head_dim**-0.5
        q_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.num_attention_heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(c.num_attention_heads * self.v_dim, c.hidden_size, bias=False)
        # On a CPU, the weight kv_b_proj's float32 halves copy (its key) and them (`absorbing`)
        self.copies: tuple[tuple[int, int, torch.dtype], torch.Tensor, torch.Tensor] | None = None

    def queries(self, x: torch.Tensor, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) → q_nope (N, H, nope), rotated q_pe (N, H, rope)."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.unflatten(-1, (self.heads, -1)).split([self.nope, self.rope], dim=-1)
        return q_nope, rotate(q_pe, angles)

    def latent(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x (N, D) → cache rows (N, rank + rope): normalised c_kv | rotated k_pe."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        return torch.cat((self.kv_a_layernorm(c_kv), rotate(k_pe, angles)), dim=-1)

    def prefill(
        self,
        x: torch.Tensor,
        angles: torch.Tensor,
        lengths: list[int] | None = None,
        pasts: list[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention over prompts: x (T, D) → output (T, D), cache rows (T, rank+rope).

        `lengths` splits x into prompts packed back to back; each attends only within itself.
        `pasts` gives each prompt the cache rows (P, rank + rope) of its tokens prefilled before
        (chunked prefill): its T new tokens come after them and attend to them too.
        """
        q_nope, q_pe = self.queries(x, angles)  # (T, H, nope), (T, H, rope)
        latent = self.latent(x, angles)
        lengths = lengths or [x.shape[0]]
        pieces = [
            self.attend(qn, qp, rows, past)
            for qn, qp, rows, past in zip(
                q_nope.split(lengths),
                q_pe.split(lengths),
                latent.split(lengths),
                pasts or [None] * len(lengths),
                strict=True,
            )
        ]
        return self.o_proj(torch.cat(pieces).flatten(1)), latent

    def absorbs(self, new: int, total: int) -> bool:
        """Whether `new` queries over `total` cache rows (their past and their own) attend more
        cheaply through the latent, as decode does, than with every row expanded by kv_b_proj.
        Per head, in multiply-adds: through the latent, total × new × (2·rank + rope) plus
        new × rank × (nope + v) to fold kv_b_proj into the queries and outputs; expanded,
        total × rank × (nope + v) for the rows plus total × new × (nope + rope + v). Small
        chunks after a long past take the first: expanding the past again for each of them
        costs more than their attention."""
        latent = total * new * (2 * self.rank + self.rope) + new * self.rank * (
            self.nope + self.v_dim
        )
        expanded = total * (
            self.rank * (self.nope + self.v_dim) + new * (self.nope + self.rope + self.v_dim)
        )
        return latent < expanded

    def attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        rows: torch.Tensor,
        past: torch.Tensor | None,
    ) -> torch.Tensor:
        """One prompt's queries (T, H, ·) over its past rows (P, rank + rope), if any, and its
        own (T, rank + rope) → attention output (T, H, v), query i seeing rows up to P + i."""
        if past is None:
            return self.expanded(q_nope, q_pe, rows)
        new, rows = rows.shape[0], torch.cat((past, rows))
        total = rows.shape[0]
        if not self.absorbs(new, total):
            return self.expanded(q_nope, q_pe, rows)
        visible = torch.ones(new, total, dtype=torch.bool, device=rows.device).tril(total - new)
        return self.through_latent(q_nope, q_pe, rows, visible)

    def expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Queries (T, H, ·) over the last T of rows (P + T, rank + rope), keys and values
        expanded per head by kv_b_proj (`prompt_products` or a fused kernel) → (T, H, v)."""
        q = torch.cat((q_nope, q_pe), dim=-1)  # (T, H, nope + rope)
        c_kv, k_pe = rows.split([self.rank, self.rope], dim=-1)
        k_nope, v = (
            self.kv_b_proj(c_kv).unflatten(-1, (self.heads, -1)).split([self.nope, self.v_dim], -1)
        )
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.heads, -1)), dim=-1)
        products = prompt_products(q, k.shape[0])
        if products is not None:  # (H, ·, ·) each
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            return products(q, k, v, self.scale).transpose(0, 1)
        # Fused attention kernels want one head size for q, k and v: pad v (v_dim < nope + rope)
        # with zeros and drop the padding after. Shapes (1, H, T, ·), the 4-D form they take.
        v = F.pad(v, (0, max(0, q.shape[-1] - self.v_dim)))
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        if k.shape[2] > q.shape[2]:  # after a past: query i sees the past and new rows up to i
            # Causal from the bottom right, as a bias object rather than a boolean mask, so CUDA
            # keeps its fused kernels.
            bias = bottom_right_causal()(q.shape[2], k.shape[2])
            out = F.scaled_dot_product_attention(q, k, v, bias, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out[0].transpose(0, 1)[..., : self.v_dim]

    def decode(self, x: torch.Tensor, angles: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """The step's new tokens, x (R, D) → (R, D), attending through the latent cache: one per
        request, or several (speculative decoding, `PagedBatch`), each seeing its request's
        rows up to its own.

        Every head scores the same latent rows, so attention is two batched matrix multiplies
        over the cache as it is (multi-query attention), never a per-head copy of it.
        """
        q_nope, q_pe = self.queries(x, angles)
        parts = batch.append_and_gather(self.layer, self.latent(x, angles))
        if batch.several:
            return self.o_proj(self.several(q_nope, q_pe, parts).flatten(1))
        if len(parts) == 1:  # every request in one call: (B, T, rank + rope) caches
            out = self.through_latent(q_nope, q_pe, parts[0].cache, parts[0].visible)
        else:  # requests of similar lengths together, so a long one pads only its own part
            out = q_nope.new_empty(*q_nope.shape[:2], self.v_dim)  # (B, H, v)
            for rows, cache, visible in parts:
                out[rows] = self.through_latent(q_nope[rows], q_pe[rows], cache, visible)
        return self.o_proj(out.flatten(1))

    def several(self, q_nope: torch.Tensor, q_pe: torch.Tensor, parts: list[Part]) -> torch.Tensor:
        """Queries (R, H, ·), several rows per request, over their parts' caches → (R, H, v).

        A request's m rows attend together as m · H query rows over its cache (n, K, L): the
        cache is read once for all of them, never copied per row (as FlashMLA folds a
        speculative step's rows into its heads)."""
        rows, heads = q_nope.shape[:2]
        w_uk, w_uv_t = self.absorbing()
        q = self.absorbed(q_nope, q_pe, w_uk)  # (R, H, L)
        q = torch.cat((q, q[:1]))  # row R: the scratch row that padding slots read and write
        out = q.new_empty(rows + 1, heads, self.rank)
        for slots, cache, visible in parts:  # slots (n, m)
            assert slots is not None  # several rows: always named
            attended = latent_attention(q[slots].flatten(1, 2), cache, visible, self.scale)
            out[slots] = attended[..., : self.rank].unflatten(1, (slots.shape[1], heads))
        return self.unabsorbed(out[:rows], w_uv_t)

    def through_latent(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Queries (N, H, ·) scored against latent cache rows, never expanded: the rows are
        (N, K, rank + rope), each query its own, or (K, rank + rope), shared by all; query n
        sees the rows where visible (N, K) holds → (N, H, v)."""
        w_uk, w_uv_t = self.absorbing()  # looked up once a call: it checks the weight's key
        q = self.absorbed(q_nope, q_pe, w_uk)  # (N, H, L)
        return self.unabsorbed(self.attend_latent(q, cache, visible)[..., : self.rank], w_uv_t)

    def absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor
    ) -> torch.Tensor:
        """Queries (N, H, ·) with the key up-projection W_uk (`absorbing`) absorbed,
        q_nope·(W_uk c) = (q_nope W_uk)·c, batched over heads → (N, H, rank + rope), scored
        against c directly."""
        q_latent = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk)  # (H, N, rank)
        return torch.cat((q_latent.transpose(0, 1).to(q_pe.dtype), q_pe), dim=-1)

    def unabsorbed(self, out: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """Attention over the latent, (N, H, rank) → values (N, H, v): W_uvᵀ applied after."""
        out = torch.bmm(out.transpose(0, 1).to(w_uv_t.dtype), w_uv_t)  # (H, N, v)
        return out.transpose(0, 1).to(self.o_proj.weight.dtype)

    def absorbing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key half W_uk (H, nope, rank) and its value half transposed, W_uvᵀ
        (H, rank, v): views of the weight, or on a CPU for a weight narrower than float32,
        contiguous float32 copies.

        There, the two batched products over bfloat16 views copied W_uvᵀ into new memory on
        every call and ran a slow kernel (docs/benchmarks.md, "The absorbed products in
        float32"). The copies (a layer's kv_b_proj in float32: 8 MiB for Kimi-VL-A3B) are made
        again whenever the weight moves or changes (its address or version), as plain tensors
        even in inference mode. Where autograd records the weight, the views serve: gradients
        reach it.
        """
        weight = self.kv_b_proj.weight
        if (
            not weight.is_cpu
            or weight.dtype == torch.float32
            or (torch.is_grad_enabled() and weight.requires_grad)
        ):
            self.copies = None  # moved off the CPU, say: nothing stale held
            return self.halves(weight)
        version = 0 if weight.is_inference() else weight._version  # inference tensors have none
        key = (weight.data_ptr(), version, weight.dtype)
        if self.copies is None or self.copies[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                w_uk, w_uv_t = (w.float().contiguous() for w in self.halves(weight))
            self.copies = (key, w_uk, w_uv_t)
        return self.copies[1], self.copies[2]

    def halves(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight: W_uk (H, nope, rank) and W_uvᵀ (H, rank, v)."""
        w_uk, w_uv = weight.unflatten(0, (self.heads, -1)).split([self.nope, self.v_dim], dim=1)
        return w_uk, w_uv.mT

    def attend_latent(
        self, q: torch.Tensor, cache: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Multi-query attention of q (N, H, L) over latent rows (N, K, L), each query n its
        own, or (K, L), shared, where visible (N, K) → (N, H, L), the whole rows as values
        (k_pe's columns come out too, for the caller to drop: a value tensor of
        cache[..., :rank] would first copy that strided slice of every row)."""
        if q.device.type == "cpu" and not products_win_on_cpu(q, cache):
            return fused_latent_attention(q, cache, visible, self.scale)
        # On a GPU the fused kernels that take a mask run a block per request's few query rows
        # and do not split a long cache across blocks; two batched products spread it.
        # (Unmeasured: no GPU has been lent. docs/benchmarks.md)
        return latent_attention(q, cache, visible, self.scale)
