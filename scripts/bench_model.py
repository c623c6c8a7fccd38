"""Model-core throughput on this machine: vision images/s, prefill and decode tokens/s.

Builds a random `small` checkpoint (or uses --checkpoint), then reports achieved FLOP/s as a
fraction of the machine's own measured float32 matmul FLOP/s, so numbers from different machines
can be compared. A decode step of a few rows is bound by reading the weights, not by FLOPs: its
table gives the bytes of weights each step needs (every weight but the embedding's, and only the
routed experts some row chose) and the rate it read them at. Not a test: run it with `make
bench` and write the results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model
from epd.dtypes import MODEL_DTYPES, tensor_dtype
from epd.kv.hashing import BLOCK_TOKENS
from epd.kv.pool import BlockPool
from epd.model.config import KimiVLConfig, TextConfig
from epd.model.deepseek import DeepseekV3ForCausalLM
from epd.model.moe import Experts, Router
from epd.model.paged import GatherEachStep
from epd.runtime.process import reuse_freed_memory


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_seconds(lambda: a @ b, repeats)


def read_bytes_per_s(mib: int = 512, repeats: int = 3) -> float:
    """The rate this process reads memory at: a sum over `mib` MiB, far past the caches."""
    x = torch.ones(mib * 2**18)
    return x.nbytes / best_seconds(lambda: x.sum(), repeats)


def vision_flops(config: KimiVLConfig, grids: list[tuple[int, int]]) -> float:
    v = config.vision
    d, total = v.hidden_size, 0.0
    for h, w in grids:
        length = h * w
        total += 2 * length * 3 * v.patch_size**2 * d  # patch embedding
        per_block = 2 * length * d * (3 * d + d + 2 * v.intermediate_size)  # qkv, wo, mlp
        per_block += 4 * length * length * d  # q·k and p·v
        total += v.num_hidden_layers * per_block
        tokens = length // 4
        total += 2 * tokens * config.merged_dim * (config.merged_dim + config.text.hidden_size)
    return total


def prefill_flops(t: TextConfig, tokens: int) -> float:
    d, heads = t.hidden_size, t.num_attention_heads
    attn = 2 * tokens * d * heads * t.qk_head_dim  # q_proj
    attn += 2 * tokens * d * t.latent_dim  # kv_a_proj_with_mqa
    attn += 2 * tokens * t.kv_lora_rank * heads * (t.qk_nope_head_dim + t.v_head_dim)  # kv_b
    attn += 2 * tokens * heads * t.v_head_dim * d  # o_proj
    attn += tokens * (tokens + 1) * heads * (t.qk_head_dim + t.v_head_dim)  # causal scores + sum
    total = 0.0
    for i in range(t.num_hidden_layers):
        total += attn
        if t.is_moe_layer(i):
            experts = t.num_experts_per_tok + t.n_shared_experts
            total += 2 * tokens * d * (t.n_routed_experts or 0)  # router
            total += 2 * tokens * experts * 3 * d * t.moe_intermediate_size
        else:
            total += 2 * tokens * 3 * d * t.intermediate_size
    return total + 2 * d * t.vocab_size  # logits of the last token


def decode_step_seconds(
    lm: DeepseekV3ForCausalLM, batch: int, context: int, repeats: int, kept: bool = True
) -> float:
    """Median time of one decode step for `batch` requests with `context`-token caches, in a
    `BlockPool` as decode holds them (keeping the gathered caches between steps where decode
    does, unless not `kept`)."""
    t = lm.config
    dtype, device = lm.lm_head.weight.dtype, lm.lm_head.weight.device
    budget = batch * (context + repeats + 2 * BLOCK_TOKENS)
    reader = lm.block_reader() if kept else GatherEachStep()
    pool = BlockPool(t.num_hidden_layers, t.latent_dim, device, dtype, budget)
    shape = (t.num_hidden_layers, context, t.latent_dim)
    caches = [pool.table() for _ in range(batch)]
    for cache in caches:
        pool.write(cache, torch.randn(shape, dtype=dtype, device=device))
    ids = torch.randint(0, t.vocab_size, (batch,), device=device)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for cache in caches:
            pool.make_room(cache)
        lm.decode(ids, reader.batch(pool.storage, caches, pool.max_bytes))
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def weights_needed(lm: DeepseekV3ForCausalLM, batch: int, context: int) -> int:
    """Bytes of weights one decode step of `batch` requests must read: every weight of the
    language model but the embedding's (a row per request) and the routed experts', plus each
    routed expert that some row chose (counted by the routers of one step)."""
    routers = [m for m in lm.modules() if isinstance(m, Router)]
    experts = [m for m in lm.modules() if isinstance(m, Experts)]
    chosen: list[int] = []
    hooks = [
        r.register_forward_hook(lambda _m, _i, out: chosen.append(out[1].unique().numel()))
        for r in routers
    ]
    try:
        decode_step_seconds(lm, batch, context, 1)
    finally:
        for hook in hooks:
            hook.remove()
    skipped = {id(p) for m in experts for p in m.parameters()}
    skipped |= {id(p) for p in lm.model.embed_tokens.parameters()}
    dense = sum(p.nbytes for p in lm.parameters() if id(p) not in skipped)
    per_expert = [sum(p.nbytes for p in m.parameters()) // len(m) for m in experts]
    last_step = chosen[len(chosen) - len(routers) :]  # after the warm-up step's
    return dense + sum(n * b for n, b in zip(last_step, per_expert, strict=True))


def run(
    checkpoint: Path,
    images: int,
    side: int,
    tokens: int,
    repeats: int,
    profile: Path | None,
    dtype: torch.dtype,
    context: int = 300,
    kept: bool = True,
) -> None:
    torch.manual_seed(0)
    peak, read_rate = matmul_flops(), read_bytes_per_s()
    model = load_model(checkpoint, dtype=dtype)
    config = model.config
    grid = (side // 14, side // 14)
    grids = [grid] * images
    pixels = torch.randn(images * grid[0] * grid[1], 3, 14, 14, dtype=dtype)
    lm = model.language_model
    embeds = lm.embed(torch.randint(0, config.text.vocab_size, (tokens,)))

    def prefill() -> torch.Tensor:
        hidden, _ = lm.prefill(embeds)
        return lm.logits(hidden[-1])

    with torch.inference_mode():
        vision_s = best_seconds(lambda: model.encode_images(pixels, grids), repeats)
        prefill_s = best_seconds(prefill, repeats)
    v_rate, p_rate = (
        vision_flops(config, grids) / vision_s,
        prefill_flops(config.text, tokens) / prefill_s,
    )
    cpu = platform.processor() or platform.machine()
    print(
        f"machine: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{str(dtype).removeprefix('torch.')}"
    )
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s (2048×2048)")
    print(f"measured memory read rate: {read_rate / 1e9:.1f} GB/s (a sum over 512 MiB)")
    print("| step | workload | throughput | achieved GFLOP/s | of matmul peak |")
    print("|---|---|---|---|---|")
    print(
        f"| vision tower + projector | {images} images of {side}×{side} px ({grid[0]}×{grid[1]} "
        f"patches) | {images / vision_s:.2f} images/s | {v_rate / 1e9:.1f} | {v_rate / peak:.0%} |"
    )
    print(
        f"| language prefill | {tokens}-token prompt | {tokens / prefill_s:.0f} tokens/s | "
        f"{p_rate / 1e9:.1f} | {p_rate / peak:.0%} |"
    )
    print()
    print(f"| decode batch | step ({context}-token caches) | tokens/s | weights needed | read at |")
    print("|---|---|---|---|---|")
    steps = {}
    with torch.inference_mode():
        for batch in (1, 4, 16, 32, 64):
            steps[batch] = step = decode_step_seconds(lm, batch, context, 4 * repeats, kept)
            needed = weights_needed(lm, batch, context)
            print(
                f"| {batch} | {step * 1e3:.1f} ms | {batch / step:.0f} | "
                f"{needed / 2**20:.0f} MiB | {needed / step / 1e9:.1f} GB/s |"
            )
    if profile is not None:  # what `epd plan --profile` reads: one replica of each role
        measured = f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
        rates = {
            "measured": f"{measured}, {checkpoint.name}, in one process (no wire)",
            "encode": {"images_per_s": round(images / vision_s, 3), "image_side": side},
            "prefill": {"tokens_per_s": round(tokens / prefill_s, 1)},
            "decode": {"step_s": {b: round(s, 6) for b, s in steps.items()}},
        }
        profile.write_text(yaml.safe_dump(rates, sort_keys=False))
        print(f"wrote the profile for epd plan to {profile}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", type=Path, help="default: a fresh random `small` one")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--side", type=int, default=448, help="image side in pixels")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=Path, help="write the rates for `epd plan` here (YAML)")
    parser.add_argument("--dtype", default="float32", choices=MODEL_DTYPES)
    parser.add_argument("--context", type=int, default=300, help="decode's cache length")
    parser.add_argument(
        "--gather-every-step",
        action="store_true",
        help="decode gathers the caches out of the pool's blocks every step, as on a GPU",
    )
    args = parser.parse_args()
    reuse_freed_memory()  # as a served role keeps its memory
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or make_checkpoint(Path(tmp) / "small", "small")
        dtype = tensor_dtype(args.dtype)
        run(
            checkpoint,
            *(args.images, args.side, args.tokens, args.repeats, args.profile, dtype),
            args.context,
            not args.gather_every_step,
        )


if __name__ == "__main__":
    main()
