"""How much host memory this process may still take, for budgets sized at start-up."""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int:
    """Bytes this process may still take: Linux's MemAvailable (free pages plus the page cache
    it can drop, such as the checkpoint files just read), or less where a cgroup (a container's
    memory limit) leaves less; 0 where neither can be read."""
    figures = [meminfo_available(), cgroup_room()]
    known = [f for f in figures if f is not None]
    return min(known) if known else 0


def meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """cgroup v2's memory.max less memory.current; None without a limit."""
    try:
        limit = (root / "memory.max").read_text().strip()
        used = int((root / "memory.current").read_text())
        return None if limit == "max" else max(0, int(limit) - used)
    except (OSError, ValueError):  # no cgroup v2 here, or a file it does not write
        return None
