"""Data-parallel training on one machine: worker processes that keep one model in step.

A small model's training step is mostly per-operation overhead, which threads inside one process
barely share; separate processes, one per core, each on part of the batch, do. Each worker
computes gradients on its share, the gradients are summed across workers (gloo, over a file
store), and every worker applies the same update, so the copies stay identical.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launch(fn: Callable[..., None], workers: int, *args: Any) -> None:
    """Run `fn(rank, workers, *args)` in `workers` processes (in this one if `workers` is 1)."""
    if workers == 1:
        fn(0, 1, *args)
        return
    with tempfile.TemporaryDirectory() as store:
        init = (Path(store) / "rendezvous").as_uri()
        mp.spawn(_worker, args=(workers, init, fn, args), nprocs=workers)


def _worker(rank: int, workers: int, init: str, fn: Callable[..., None], args: Any) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=workers)
    torch.set_num_threads(max(1, cores() // workers))
    try:
        fn(rank, workers, *args)
    finally:
        dist.destroy_process_group()


def cores() -> int:
    """CPU cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):  # Linux: honours taskset and container CPU sets
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parallel() -> bool:
    """Whether this process is one of several workers."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait until every worker gets here."""
    if parallel():
        dist.barrier()


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of `values` over the workers."""
    if parallel():
        values = values.clone()
        dist.all_reduce(values)
    return values


def sum_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Replace each gradient by its sum over the workers, in one collective.

    A parameter this worker's share did not reach (an idle expert) gets a zero gradient, in one
    process as in many, so that the optimiser treats it the same whatever the worker count.
    """
    params = list(parameters)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not parallel():
        return
    # One float32 buffer whatever the parameters' dtypes (routing weights stay float32).
    flat = torch.cat([p.grad.flatten().float() for p in params])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    for p, summed in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad = summed.view_as(p).to(p.dtype)
