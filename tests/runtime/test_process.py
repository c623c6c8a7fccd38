"""What every process sets up first: its log lines, its open files limit; and work that must
not outlive its thread."""

import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from epd.runtime.process import MAX_OPEN_FILES, on_passing_thread, set_torch_threads


def test_log_level_and_json_lines(capsys):
    import json
    import logging

    from epd.runtime.process import setup_logging

    try:
        setup_logging("decode", "warning", "json")
        logging.getLogger("epd.x").info("hidden")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("epd.x").exception("shown %d", 7)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1
        entry = json.loads(lines[0])
        assert entry["message"] == "shown 7" and entry["role"] == "decode"
        assert entry["level"] == "ERROR" and "ValueError: boom" in entry["exception"]
    finally:
        logging.getLogger().handlers.clear()
        logging.getLogger().setLevel(logging.WARNING)


def thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists Linux threads")
def test_work_on_a_passing_thread_leaves_no_threads_behind():
    """A thread that has run torch on 2 threads keeps an OpenMP worker while it lives; on a
    passing thread both are gone when the work returns (what loading prefill's model needs)."""

    def work() -> set[str]:
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        (x @ x).exp_()  # parallel ops: the thread starts its OpenMP workers
        return thread_ids()

    main_threads, before = torch.get_num_threads(), thread_ids()
    during = on_passing_thread(work)
    deadline = time.monotonic() + 3  # the workers end a moment after their thread
    while thread_ids() & (during - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(during - before) >= 2 and not thread_ids() & (during - before)
    staying = ThreadPoolExecutor(1)
    try:
        started = staying.submit(work).result() - before
        assert len(started) >= 2 and started <= thread_ids()  # the thread and its worker stay
    finally:
        staying.submit(torch.set_num_threads, main_threads).result()  # threads start from it
        staying.shutdown()


def test_a_threads_count_set_with_set_torch_threads_is_kept():
    """Another thread setting its count later does not change this one's at its next op."""

    def loop_like(keep: bool) -> int:
        if keep:
            set_torch_threads(1)
        else:
            torch.set_num_threads(1)  # not read back: its first op takes the last count set
        with ThreadPoolExecutor(1) as other:
            other.submit(lambda: (torch.get_num_threads(), torch.set_num_threads(2))).result()
        torch.cat([torch.randn(256, 2048), torch.randn(256, 2048)])
        return torch.get_num_threads()

    main_threads = torch.get_num_threads()
    try:
        assert on_passing_thread(loop_like, True) == 1
        assert on_passing_thread(loop_like, False) == 2  # why set_torch_threads reads it back
    finally:
        torch.set_num_threads(main_threads)


def test_a_role_raises_its_open_files_limit_to_the_hard_one():
    """Each ZeroMQ connection takes a descriptor: a role must not stop at a low soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import resource; from epd.runtime.process import raise_file_limit; "
        "raise_file_limit(); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    raised = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
        capture_output=True,
        text=True,
        check=True,
    )
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    assert int(raised.stdout) == wanted > 256


# Where glibc put a 4 MiB tensor (its own pages, or the heap), and how much of the heap stayed
# free for the next after it was freed, after `reuse` ran or not.
WHERE_MEMORY_GOES = """
import ctypes, json, sys, torch
from epd.runtime.process import reuse_freed_memory
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]
mallinfo = ctypes.CDLL(None).mallinfo2
mallinfo.restype = Info
was_set = reuse_freed_memory() if sys.argv[1] == "reuse" else False
before = mallinfo().hblkhd
tensor = torch.ones(1 << 20)
own_pages = mallinfo().hblkhd - before
del tensor
print(json.dumps({"set": was_set, "own_pages": own_pages, "kept_free": mallinfo().fordblks}))
"""


def where_memory_goes(how: str, **env: str) -> dict[str, Any]:
    chosen = ("MALLOC_", "GLIBC_", "LD_PRELOAD")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(chosen)}
    done = subprocess.run(
        [sys.executable, "-c", WHERE_MEMORY_GOES, how],
        env=clean | env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


GLIBC = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's allocator (2.33 or later)"
)


@GLIBC
def test_a_role_keeps_the_memory_a_forward_freed_for_the_next():
    """By default glibc gives a block of 4 MiB its own pages and returns them at free, so the
    next op's output must be faulted in afresh; a role takes it from the heap and keeps it."""
    reused = where_memory_goes("reuse")
    assert reused["set"] and reused["own_pages"] == 0 and reused["kept_free"] >= 4 << 20
    # Unrelated glibc settings leave it on.
    assert where_memory_goes("reuse", GLIBC_TUNABLES="glibc.pthread.rseq=0")["set"]


@GLIBC
def test_an_operators_own_allocator_settings_are_left_alone():
    for setting in (
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
        {"LD_PRELOAD": "libjemalloc.so.2"},
    ):
        assert where_memory_goes("reuse", **setting)["set"] is False
