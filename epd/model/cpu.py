"""What this CPU is, where the fastest kernel for a product depends on it (docs/benchmarks.md)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def vendor() -> str:
    """The CPU's vendor as Linux names it (GenuineIntel, AuthenticAMD), or "" unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX tiles, which torch's fused CPU attention uses for bfloat16."""
    return torch_says("_is_amx_tile_supported")


@functools.cache
def runs_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): elsewhere oneDNN
    converts it on the fly, and bfloat16 can run slower than float32."""
    return (
        torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and (torch_says("_is_avx512_bf16_supported") or has_amx())
    )


def torch_says(check: str) -> bool:
    """One of torch's own CPU feature checks (those its compiler asks), False where this torch
    has none by that name."""
    probe = getattr(torch.cpu, check, None)
    return bool(probe()) if callable(probe) else False
