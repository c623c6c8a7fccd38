"""Attention kernels, and which one is fastest on this CPU for a given dtype and shape.

Torch's fused CPU attention keeps scores in float32 and never writes them out. On a CPU that
multiplies bfloat16 natively but has no AMX (AVX512-BF16, as an AMD EPYC of zen 5), batched
products ran faster for decode's many queries and for prompts; with AMX (an Intel Xeon), in
float32 and float16, and where bfloat16 is converted on the fly, the fused kernel stays
(docs/benchmarks.md, "Kernels that depend on the CPU"). The products round the scores and the
softmax's weights to bfloat16, as the GPU path and transformers' eager attention do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from epd.model import cpu

# Causal attention of q (H, T, d) over k (H, K, d) and v (H, K, dv) with a scale → (H, T, dv).
Products = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

# From this many queries over their own rows, bfloat16 decode attention runs as two batched
# products on such a CPU (`products_win_on_cpu`).
MIN_PRODUCT_QUERIES = 4
# A prompt's attention runs as products up to this many keys (`prompt_products`), in bfloat16
# in blocks of this many queries. A block's scores, heads × 128 × keys, take up to 8 bytes each
# (in bfloat16, their softmax in float32, its bfloat16 copy): 2 MiB for the small model's 8 heads
# at 256 keys, 64 MiB for Kimi-VL's 16 at 4096. At 4096 the blocks gained only 1.1×; beyond,
# unmeasured, the fused kernel runs, which writes no scores.
PROMPT_BLOCK_QUERIES = 128
MAX_PROMPT_PRODUCT_KEYS = 4096
# A block's queries and the rows it scores, padded to multiples of these (`causal_products`).
QUERY_STEP, ROW_STEP = 32, 64
# In float32 a prompt's attention runs as products in blocks of queries whose scores hold at
# most BLOCK_SCORES elements (4 MiB; their softmax as much again), or PAST_BLOCK_SCORES (16
# MiB) where the queries attend mostly to a past, at least MIN_BLOCK_QUERIES queries
# (`blocked_products`).
BLOCK_SCORES, PAST_BLOCK_SCORES, MIN_BLOCK_QUERIES = 1 << 20, 1 << 22, 16
# The CPUs (vendors, as Linux names them) where float32 prompts were measured faster so.
MEASURED_FLOAT32_PRODUCTS = ("AuthenticAMD", "GenuineIntel")


def bfloat16_products_win(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` as bfloat16 natively and without AMX: where the
    products beat the fused kernel."""
    return dtype == torch.bfloat16 and cpu.runs_bfloat16() and not cpu.has_amx()


def products_win_on_cpu(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether, on a CPU, two batched products beat the fused kernel for queries (N, H, L)
    over each one's own rows (N, K, L): in bfloat16 from MIN_PRODUCT_QUERIES queries up
    (`bfloat16_products_win`). There (an AMD EPYC, zen 5; 8 heads, 160-wide rows) the fused
    kernel took 1.6-2.9× the products' time at N 16-64, 0.85-2.5× at N 4 (slower only for
    short caches), and whole steps ran 5% faster at batch 4 and 14-20% at 16-64; at one query
    it was 1.4-2.3× faster. With AMX (an Intel Xeon) a step ran ~5% faster fused. Shared rows
    stay fused: the products would write every chunk query's scores against the whole past."""
    return cache.dim() == 3 and q.shape[0] >= MIN_PRODUCT_QUERIES and bfloat16_products_win(q.dtype)


def prompt_products(q: torch.Tensor, keys: int) -> Products | None:
    """The products a prompt's queries (T, H, d) over `keys` rows run as on this CPU, up to
    MAX_PROMPT_PRODUCT_KEYS, or None for the fused kernel: `causal_products` in bfloat16 where
    `bfloat16_products_win`, `blocked_products` in float32 where `float32_products_win`. The
    fused kernel takes one head size for q, k and v, so values narrower than keys are padded
    for it, and in bfloat16 on an AMD EPYC (zen 5) it took 1.8-2.9× the blocked products' time
    at 128-2048 tokens; float32: docs/benchmarks.md, "A prompt's attention as products"."""
    if not q.is_cpu or keys > MAX_PROMPT_PRODUCT_KEYS:
        return None
    if bfloat16_products_win(q.dtype):
        return causal_products
    return blocked_products if float32_products_win(q.dtype) else None


def float32_products_win(dtype: torch.dtype) -> bool:
    """Whether `blocked_products` beat the fused kernel for a prompt in `dtype` on this CPU:
    float32 on the x86 CPUs they were measured on, an AMD EPYC (zen 5) and an Intel Xeon with
    AMX, where they ran as fast without a past and faster after one (the fused kernel takes
    a past's mask as a dense bias); elsewhere unmeasured, the fused kernel stays."""
    return dtype == torch.float32 and cpu.vendor() in MEASURED_FLOAT32_PRODUCTS


def blocked_products(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention as batched products in float32: q (H, T, d) over k (H, K, d) and v
    (H, K, dv), the T queries the last T of the K rows (query i sees rows up to K - T + i) →
    (H, T, dv).

    A block of queries at a time, each over the rows it can see, as many as keep the block's
    scores (H, queries, rows) within BLOCK_SCORES elements (beyond it only at MIN_BLOCK_QUERIES,
    over more rows than `prompt_products` gives it): the blocks skip the rows no query of theirs
    sees, and their scores stay small. Queries after a past at least as long as themselves skip
    few rows so, and every block reads the past's keys and values again: their blocks' scores
    go up to PAST_BLOCK_SCORES. The mask is added in the scores' product. Values keep their own
    width, where the fused kernel takes them padded to the keys'. Row counts are any: float32's
    batched products build no kernel per shape.
    """
    heads, queries = q.shape[:2]
    past = rows_before(q, k)
    out = q.new_empty(heads, queries, v.shape[-1])
    if not queries:
        return out
    budget = PAST_BLOCK_SCORES if past >= queries else BLOCK_SCORES
    step = max(MIN_BLOCK_QUERIES, budget // (heads * k.shape[1]))
    for start in range(0, queries, step):
        end = min(queries, start + step)
        seen = past + end  # the rows the block's last query sees
        # -inf past each query's last row (above the diagonal at past + start), 0 elsewhere
        mask = torch.full((end - start, seen), float("-inf"), dtype=q.dtype, device=q.device)
        mask.triu_(past + start + 1)
        scores = torch.baddbmm(mask, q[:, start:end], k[:, :seen].mT, alpha=scale)
        out[:, start:end] = torch.bmm(scores.softmax(-1), v[:, :seen])
    return out


def causal_products(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention as batched products: q (H, T, d) over k (H, K, d) and v (H, K, dv),
    the T queries the last T of the K rows (query i sees rows up to K - T + i) → (H, T, dv).

    A block of PROMPT_BLOCK_QUERIES queries at a time, each over the rows it can see: the rows
    past the block are never scored, and a short prompt's scores stay in the core's cache
    (whole prompts' scores at once ran slower, and by as much as 1.7× from run to run). The
    blocks' queries are padded to a multiple of QUERY_STEP and their rows to one of ROW_STEP
    (zeros, never seen by a real query): oneDNN builds a kernel for each shape it meets, and
    prompts of every length would fill its cache, a long-running server's forwards slowing
    as they evict one another's kernels.
    """
    queries, past = q.shape[1], rows_before(q, k)
    rows = round_up(k.shape[1], ROW_STEP)
    k, v = padded(k, rows), padded(v, rows)  # (H, rows, ·)
    out = q.new_empty(*q.shape[:2], v.shape[-1])
    for start in range(0, queries, PROMPT_BLOCK_QUERIES):
        end = min(queries, start + PROMPT_BLOCK_QUERIES)
        size = round_up(end - start, QUERY_STEP)
        seen = min(rows, round_up(past + start + size, ROW_STEP))  # past the block's last query
        block = padded(q[:, start:end], size) * scale  # (H, size, d)
        scores = torch.matmul(block, k[:, :seen].mT)  # (H, size, seen)
        hidden = torch.ones(size, seen, dtype=torch.bool, device=q.device)
        scores.masked_fill_(hidden.triu(past + start + 1), float("-inf"))
        weights = scores.softmax(-1, dtype=torch.float32).to(v.dtype)
        out[:, start:end] = torch.matmul(weights, v[:, :seen])[:, : end - start]
    return out


def rows_before(q: torch.Tensor, k: torch.Tensor) -> int:
    """The rows of k (H, K, d) before those of the T queries q (H, T, d), which are its last."""
    past = k.shape[1] - q.shape[1]
    if past < 0:
        raise ValueError(f"{q.shape[1]} queries over {k.shape[1]} rows: they are the last of them")
    return past


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (H, R, ·) with zero rows after its own up to `rows`, contiguous."""
    if x.shape[1] == rows and x.is_contiguous():
        return x
    out = x.new_zeros(x.shape[0], rows, x.shape[2])
    out[:, : x.shape[1]] = x
    return out


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def latent_attention(
    q: torch.Tensor, cache: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Multi-query attention of q (N, H, L) over latent rows (N, K, L), each query n its own,
    or (K, L), shared, where visible (N, K), as two batched products: scores (N, H, K), then
    values → (N, H, L). With visible (N, m, K), q's H rows are m groups of H / m (a request's
    m query rows, each with every head: speculative decoding), each seeing its own."""
    scores = torch.matmul(q * scale, cache.mT)  # (N, H, K)
    if visible.dim() == 3:
        grouped = scores.view(scores.shape[0], visible.shape[1], -1, scores.shape[-1])
        grouped.masked_fill_(~visible[:, :, None, :], float("-inf"))  # (N, m, H / m, K)
    else:
        scores.masked_fill_(~visible[:, None, :], float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32).to(cache.dtype)
    return torch.matmul(weights, cache)


def fused_latent_attention(
    q: torch.Tensor, cache: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """`latent_attention` in one fused kernel, never writing the (N, H, K) scores (where it
    wins: docs/benchmarks.md, "Kernels that depend on the CPU")."""
    n, heads = q.shape[:2]
    if cache.dim() == 2:  # shared: all N·H query rows in one batch
        q, cache = q.flatten(0, 1)[None], cache[None]  # (1, N·H, L), (1, K, L)
        visible = visible.repeat_interleave(heads, dim=0)[None]  # (1, N·H, K)
    else:
        visible = visible[:, None, :]  # (N, 1, K): every head of a query alike
    # One "head" whose H (or N·H) query positions share the keys (4-D, as the kernels take).
    out = F.scaled_dot_product_attention(
        q[:, None], cache[:, None], cache[:, None], visible[:, None], scale=scale
    )
    return out[:, 0].reshape(n, heads, -1)
