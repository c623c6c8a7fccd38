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


# cgroup v2's files, then v1's (under its memory controller): the limit, what is used, and
# where the page cache it may drop is counted (its inactive part: what Docker and the kubelet
# leave out of a container's working set).
CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    (
        "memory/memory.limit_in_bytes",
        "memory/memory.usage_in_bytes",
        "memory/memory.stat",
        "total_inactive_file",
    ),
)
NO_LIMIT = 1 << 60  # v1 says "no limit" with the largest page-aligned 64-bit count


def cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """A container's memory limit less its working set, from cgroup v2 or v1; None without a
    limit (or where neither can be read)."""
    for limit_file, used_file, stat_file, inactive in CGROUP_FILES:
        try:
            limit = (root / limit_file).read_text().strip()
            used = int((root / used_file).read_text())
        except (OSError, ValueError):  # not this version, or a file it does not write
            continue
        if limit.isdigit() and int(limit) < NO_LIMIT:
            return max(0, int(limit) - used + stat_value(root / stat_file, inactive))
        return None  # "max" (v2) or v1's no-limit value
    return None


def stat_value(path: Path, key: str) -> int:
    """A value of a cgroup's memory.stat ("key value" lines); 0 where it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
