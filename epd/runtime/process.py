"""What every epd process does first and last: logging, stop signals, its supervisor, the ready
line. `epd serve`'s own process uses it too, and imports no torch (two seconds of every start):
the functions that set torch's threads import it where they run, in the roles."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
SUPERVISOR_ENV = "EPD_SUPERVISOR_PID"  # set by `epd serve`: its children end when it does
STOP_GRACE_S = 15.0  # a process asked to stop that has not finished by then exits at once
PR_SET_PDEATHSIG = 1
MAX_OPEN_FILES = 1 << 20  # the soft limit taken where the hard one is unlimited
# glibc's mallopt parameters, and the values a CPU role sets (`reuse_freed_memory`): blocks
# under 32 MiB (glibc's largest threshold) come from the heap, and up to 256 MiB freed at its
# top stays there for the next forward.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 256 << 20
# An operator's own settings of glibc's allocator win over `reuse_freed_memory`: these
# variables, or GLIBC_TUNABLES naming a `glibc.malloc.` tunable.
MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


class ProcessOptions(Protocol):
    """The settings every role's process starts with (`epd.config.roles.ModelOptions`)."""

    @property
    def threads(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def log_level(self) -> str: ...
    @property
    def log_format(self) -> str: ...


class JsonLines(logging.Formatter):
    """One JSON object per line: time (UTC), level, role, logger, message (and exception)."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "role": self.role,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(role: str, level: str = "", form: str = "text") -> None:
    """Every log line of the process, uvicorn's included, at `level` (default: $EPD_LOG_LEVEL,
    else info) as text or JSON lines."""
    handler = logging.StreamHandler()
    text = f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(JsonLines(role) if form == "json" else logging.Formatter(text))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("EPD_LOG_LEVEL", "") or "info").upper())
    # uvicorn's start and stop notices are noise next to the ready line; its access log is not.
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, root.level))
    # httpx's line per request (each image fetched, each scrape of a peer's /metrics: two a
    # Prometheus scrape) is noise beside the request's own line.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


def stop_event(grace_s: float = STOP_GRACE_S) -> threading.Event:
    """An event set by SIGINT or SIGTERM, so loops can finish their step and exit cleanly.

    A loop that is stuck never sees the event; the process then exits on its own after
    `grace_s`, so a stop request always ends it (PID 1 in a container cannot be SIGKILLed
    from inside).
    """
    event = threading.Event()

    def requested(*_: object) -> None:
        if not event.is_set():
            event.set()
            threading.Thread(target=_exit_after, args=(grace_s,), daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, requested)
    return event


def skip_collection_at_exit() -> None:
    """Leave the objects alive at exit to the OS instead of the interpreter's collector.

    As it ends, the interpreter collects cycles again and again over every object left (a
    model, a tokenizer, grammar tables): ~2 s of CPU in a decode role, so an idle `epd serve`
    took 3.9 s to stop on a 2-core machine, 9-14 s with other work on its cores, and 1.5 and
    2.6-2.9 s frozen. Objects freed by their reference counts still are, so what closes files
    or sockets when its last reference goes still runs; objects in reference cycles are no
    longer collected at exit, so their finalizers (`__del__`, weakref callbacks) do not run:
    whatever must happen at exit belongs in an explicit close or an `atexit` function.
    """
    atexit.register(gc.freeze)  # before the last collections, which skip frozen objects


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    # Say why from a thread of its own: if stderr is blocked, the exit must not wait for it.
    message = f"epd: still running {seconds:.0f}s after a stop request; exiting\n".encode()
    threading.Thread(target=os.write, args=(2, message), daemon=True).start()
    time.sleep(0.1)
    os._exit(1)


def follow_supervisor() -> None:
    """End this process (SIGTERM) when the `epd serve` that started it is gone, even by kill -9.

    Linux delivers the signal itself (parent-death signal); elsewhere, and for the moment before
    the signal was armed, a thread watches the parent's pid.
    """
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            errno = ctypes.get_errno()
            log.warning("no parent-death signal (errno %d): watching the parent only", errno)

    def watch() -> None:
        while os.getppid() == int(supervisor):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def announce_ready(role: str, **endpoints: str) -> None:
    """The one line `epd serve` and operators wait for."""
    where = ", ".join(f"{k} {v}" for k, v in endpoints.items())
    print(f"epd {role} ready (pid {os.getpid()}): {where}", flush=True)


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container's limit), or all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def torch_threads(threads: int, device: str, cores: int | None = None) -> int:
    """Threads a role gives torch: `threads`, or for 0 its `cores` (default: all), on a GPU
    at most 4, since there the CPU only feeds the device."""
    if threads:
        return threads
    cores = cores or available_cores()
    return min(4, cores) if device.startswith("cuda") else cores


def set_torch_threads(threads: int) -> None:
    """This thread's torch threads, kept: torch takes a thread's count from the last one set by
    any thread at the thread's first parallel op, unless it has read its own count before; a
    bare `torch.set_num_threads` on a thread that has not would be undone by that."""
    import torch

    torch.set_num_threads(threads)
    torch.get_num_threads()


def use_torch_threads(threads: int) -> None:
    """`set_torch_threads`, where `threads` is set (0: as they are) and differs from the count
    now: a role that changes its count between forwards calls this before each."""
    import torch

    if threads and torch.get_num_threads() != threads:
        set_torch_threads(threads)


def on_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a thread that ends when it returns, e.g. loading a model at start.

    libgomp (torch's OpenMP on Linux) keeps a pool of workers for every thread that has run a
    parallel op, for as long as that thread lives. Once a process's pools hold more threads than
    it has cores, idle workers spin only briefly before they sleep, and each of a forward's many
    small ops then waits for its workers to wake (docs/benchmarks.md, "Prefill's threads").
    Work done once on a thread of its own takes its pool
    with it when the thread ends.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="passing") as thread:
        return thread.submit(fn, *args).result()


def start_process(
    role: str, options: ProcessOptions, grace_s: float = STOP_GRACE_S
) -> threading.Event:
    """What every role does first: log as `role`, take stop signals, follow `epd serve`, and
    size torch's thread pool (three roles on one machine must not fight over its cores).

    Returns the event a stop signal sets; the process exits `grace_s` after it, whatever runs.
    """
    setup_logging(role, options.log_level, options.log_format)
    stop = stop_event(grace_s)
    skip_collection_at_exit()
    follow_supervisor()
    raise_file_limit()
    if not options.device.startswith("cuda"):
        reuse_freed_memory()
    set_torch_threads(torch_threads(options.threads, options.device))
    return stop


def reuse_freed_memory() -> bool:
    """Keep the memory a forward frees for the next one, where the allocator is glibc's and the
    environment leaves it as it is (MALLOC_SETTINGS; no other allocator preloaded): whether it
    was set.

    By default glibc gives a block of 128 KiB or more its own pages, returned when it is freed,
    and returns the heap's free top past 128 KiB too. A forward on a CPU allocates and frees
    tensors of a few MiB at every op, so each came back as fresh pages, and the kernel faults
    them in 4 KiB at a time as the op first writes them (docs/benchmarks.md, "Memory a forward
    reuses").
    """
    chosen = any(name in os.environ for name in MALLOC_SETTINGS)
    chosen |= "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    if chosen or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # another C library
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trimmed = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mapped and trimmed)


def raise_file_limit() -> None:
    """Let the process open as many files as its hard limit allows.

    Every ZeroMQ connection, accepted or made, takes a descriptor; at a soft limit of 1024 a
    thousand idle connections from anyone who can reach a port left decode unable to open a
    socket to its prefill, and prefill's API unable to answer (docs/architecture.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # e.g. a sandbox that forbids it
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
