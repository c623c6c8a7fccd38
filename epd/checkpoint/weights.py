"""Strict loading of a checkpoint's safetensors into a role's modules.

Module attribute paths equal the checkpoint's tensor names, so loading is a lookup. The model is
built on the meta device and each tensor is read straight to its target device and dtype, so a
role never materialises the other part's tensors.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from epd.checkpoint.config import CheckpointError, load_model_config, read_json, stored_dtype
from epd.dtypes import TENSOR_DTYPES
from epd.model import cpu
from epd.model.kimi_vl import ROLE_PREFIXES, KimiVL, Role
from epd.model.moe import FLOAT32_TENSOR_SUFFIXES
from epd.model.packed import bucket_rows, pack_for_cpu, packs_many_rows

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, never loaded


def default_dtype(device: torch.device, stored: str | None = None) -> torch.dtype:
    """The dtype 'auto' runs a checkpoint saved in `stored` in: its own where the device runs it
    natively (as vLLM's 'auto' does for 16-bit checkpoints). On CUDA a 16-bit one as saved and
    float32 as bfloat16; on a CPU bfloat16 where the CPU multiplies it natively (a decode step
    reads half the bytes, docs/benchmarks.md), anything else as float32 (float16 products are
    slow there)."""
    saved = TENSOR_DTYPES[stored] if stored else torch.float32
    if device.type == "cuda":
        return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16
    if device.type == "cpu" and saved == torch.bfloat16 and cpu.runs_bfloat16():
        return torch.bfloat16
    return torch.float32


def tensor_files(checkpoint: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file that holds it."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        return {name: checkpoint / file for name, file in weight_map.items()}
    single = checkpoint / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{checkpoint} has neither model.safetensors nor its index")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def select(files: dict[str, Path], role: Role, expected: set[str]) -> dict[str, Path]:
    """The role's tensors; raise naming every missing or unexpected tensor."""
    prefixes = ROLE_PREFIXES[role]
    names = {n for n in files if not n.endswith(SKIPPED_SUFFIXES)}
    foreign = {n for n in names if not n.startswith(ROLE_PREFIXES["all"])}
    wanted = {n for n in names if n.startswith(prefixes)}
    missing, unexpected = expected - wanted, (wanted - expected) | foreign
    problems = [f"missing tensor {n}" for n in sorted(missing)]
    problems += [f"unexpected tensor {n}" for n in sorted(unexpected)]
    if problems:
        shown = "; ".join(problems[:20]) + (
            f"; and {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        raise CheckpointError(f"checkpoint does not match the {role!r} model: {shown}")
    return {n: files[n] for n in wanted}


def read_tensors(
    files: dict[str, Path], shapes: dict[str, torch.Size], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    state = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise CheckpointError(f"{file} is named by the index but missing")
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in names:
                tensor = f.get_tensor(name)
                if tensor.shape != shapes[name]:
                    raise CheckpointError(
                        f"tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(shapes[name])}"
                    )
                target = torch.float32 if name.endswith(FLOAT32_TENSOR_SUFFIXES) else dtype
                state[name] = tensor.to(target) if tensor.is_floating_point() else tensor
    return state


def load_model(
    checkpoint: str | Path,
    role: Role = "all",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    copies: bool = True,
) -> KimiVL:
    """Build the role's part of Kimi-VL and fill it from the checkpoint, strictly, for inference
    (on a CPU, with `copies`, the language model's weights are then packed for oneDNN,
    `epd/model/packed.py`; the vision tower's only where products of many rows gain from it,
    `packs_many_rows`; in bfloat16 every plain product gets its rows bucketed)."""
    checkpoint, device = Path(checkpoint), torch.device(device)
    config = load_model_config(checkpoint)
    with torch.device("meta"):
        model = KimiVL(config, role)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    files = select(tensor_files(checkpoint), role, set(shapes))
    dtype = dtype or default_dtype(device, stored_dtype(checkpoint))
    state = read_tensors(files, shapes, device, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if device.type == "cpu" and copies:
        # One call, so that all the copies together stay within its memory budget.
        packed = model if packs_many_rows(dtype) else getattr(model, "language_model", None)
        if packed is not None:
            pack_for_cpu(packed)
    bucket_rows(model)
    return model.eval()
