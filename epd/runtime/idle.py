"""Whether the other processes on this machine leave its cores idle, from Linux's CPU times.

Roles that share a machine (`epd serve` on a CPU) each get a share of its cores; a role whose
peers have nothing to do may use theirs too (decode at one stream, say). `OthersIdle` tells it so:
every WINDOW_S it reads the machine's busy time (/proc/stat) and this process's own
(/proc/self/stat), and the others are idle while they kept less than IDLE_CORES of a core busy
in the last window. A window is a tenth of a second behind; `OthersIdle.now` says whether any
other thread is runnable at this moment (/proc/loadavg), which a window cannot tell just after
the others' work ended. Where /proc cannot be read, the others never count as idle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

WINDOW_S = 0.1  # a tick is 10 ms: fewer than ~10 per window would be too coarse
IDLE_CORES = 0.3  # what the others may use and still leave the machine to this process
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_ticks() -> int:
    """Ticks every core spent working since boot: user, nice, system, irq and softirq time
    (not idle, I/O wait, or time the hypervisor stole)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = stat.readline().split()[1:]
    user, nice, system, _, _, irq, softirq = (int(f) for f in fields[:7])
    return user + nice + system + irq + softirq


def own_busy_ticks() -> int:
    """Ticks this process (every thread) spent working since it started."""
    with open("/proc/self/stat", encoding="ascii") as stat:
        text = stat.read()
    fields = text[text.rfind(")") + 2 :].split()  # after the name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime


def runnable_elsewhere() -> int:
    """Threads of other processes runnable at this moment: /proc/loadavg's count of runnable
    scheduling entities (this thread among them) less this process's own."""
    with open("/proc/loadavg", encoding="ascii") as loadavg:
        runnable = int(loadavg.read().split()[3].split("/")[0])
    own = 0
    for task in os.scandir("/proc/self/task"):
        try:
            with open(f"{task.path}/stat", encoding="ascii") as stat:
                text = stat.read()
        except OSError:  # the thread ended
            continue
        own += text[text.rfind(")") + 2] == "R"
    return runnable - own


class OthersIdle:
    def __init__(
        self,
        window_s: float = WINDOW_S,
        idle_cores: float = IDLE_CORES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s, self.idle_cores, self.clock = window_s, idle_cores, clock
        self.idle = False
        self.since = self.sample()

    def sample(self) -> tuple[float, int, int] | None:
        try:
            return self.clock(), machine_busy_ticks(), own_busy_ticks()
        except (OSError, ValueError):  # no /proc here
            return None

    def assume_idle(self) -> None:
        """Idle from now, until the next full window says otherwise: for a decoder given its
        one request, whose prefill (the others' work in the window so far) is done."""
        self.since = self.sample()
        self.idle = self.since is not None  # without /proc the others never count as idle

    def __call__(self) -> bool:
        """Whether the others used less than `idle_cores` in the last full window."""
        if self.since is None or self.clock() - self.since[0] < self.window_s:
            return self.idle
        now = self.sample()
        if now is None:
            return self.idle
        seconds = now[0] - self.since[0]
        others = (now[1] - self.since[1]) - (now[2] - self.since[2])
        self.idle = others / TICKS / seconds < self.idle_cores
        self.since = now
        return self.idle

    def now(self) -> bool:
        """Whether no other process has a thread runnable at this moment."""
        try:
            return runnable_elsewhere() <= 0
        except (OSError, ValueError, IndexError):  # no /proc here
            return False
