"""Strict loading of a checkpoint's safetensors into a role's modules.

Module attribute paths equal the checkpoint's tensor names, so loading is a lookup. The model is
built on the meta device and each tensor is read straight to its target device and dtype, so a
role never materialises the other part's tensors. The load says what it reads and how far it
has come (`epd/checkpoint/progress.py`). A tensor kept in its file's dtype on a CPU stays mapped
from the file (safetensors maps it), read from disk where it is first used: packing, which is
logged as a phase of its own, or the first requests.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from epd.checkpoint.config import CheckpointError, load_model_config, read_json, stored_dtype
from epd.checkpoint.progress import Reading, phase
from epd.dtypes import tensor_dtype
from epd.model import cpu
from epd.model.kimi_vl import ROLE_PREFIXES, KimiVL, Role
from epd.model.moe import FLOAT32_TENSOR_SUFFIXES
from epd.model.packed import Repacked, bucket_rows, pack_for_cpu, packs_many_rows

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, never loaded
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a file's header
PACKING = "packing weights for oneDNN: copies laid out for this CPU"


def default_dtype(device: torch.device, stored: str | None = None) -> torch.dtype:
    """The dtype 'auto' runs a checkpoint saved in `stored` in: its own where the device runs it
    natively (as vLLM's 'auto' does for 16-bit checkpoints). On CUDA a 16-bit one as saved and
    float32 as bfloat16; on a CPU bfloat16 where the CPU multiplies it natively (a decode step
    reads half the bytes, docs/benchmarks.md), anything else as float32 (float16 products are
    slow there)."""
    saved = tensor_dtype(stored) if stored else torch.float32
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


def stored_bytes(file: Path) -> dict[str, int]:
    """Each tensor's bytes in a safetensors file, from its header alone (8 bytes of length, then
    that much JSON), so that a load can say how much it will read before it reads it."""
    if not file.is_file():
        raise CheckpointError(f"{file} is named by the index but missing")
    try:
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        offsets = {name: entry["data_offsets"] for name, entry in header.items()}
        return {name: end - start for name, (start, end) in offsets.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{file} is not a safetensors file ({e})") from e


def read_tensors(
    checkpoint: Path,
    files: dict[str, Path],
    shapes: dict[str, torch.Size],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The tensors named, file by file, their progress logged (`Reading`)."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    sizes = {file: stored_bytes(file) for file in by_file}
    total = sum(sizes[file].get(name, 0) for name, file in files.items())
    progress = Reading(len(by_file), total, checkpoint)
    state = {}
    for file, names in by_file.items():
        progress.next_file()
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in names:
                state[name] = read_tensor(f, name, shapes[name], dtype)
                progress.read(sizes[file].get(name, 0))
    progress.finish()
    return state


def read_tensor(f: Any, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` of an open safetensors file, checked against the model's `shape`, in the
    dtype it runs in."""
    tensor = f.get_tensor(name)
    if tensor.shape != shape:
        raise CheckpointError(
            f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
        )
    target = torch.float32 if name.endswith(FLOAT32_TENSOR_SUFFIXES) else dtype
    return tensor.to(target) if tensor.is_floating_point() else tensor


def pack(model: nn.Module) -> None:
    """`pack_for_cpu` as a start-up phase: it can take a while, and it says what it packed."""
    with phase(PACKING, "packed") as ending:
        pack_for_cpu(model)
        count = sum(isinstance(m, Repacked) for m in model.modules())
        ending.said = f"packed the weights of {count} modules for oneDNN"


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
    state = read_tensors(checkpoint, files, shapes, device, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if device.type == "cpu" and copies:
        # One call, so that all the copies together stay within its memory budget.
        packed = model if packs_many_rows(dtype) else getattr(model, "language_model", None)
        if packed is not None:
            pack(packed)
    bucket_rows(model)
    return model.eval()
