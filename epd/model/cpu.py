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
    """Whether the CPU has AMX tiles, which torch's fused CPU attention uses for bfloat16
    (asked as torch's own compiler asks; False where this torch cannot tell)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if callable(probe) else False
