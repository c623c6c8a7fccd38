"""The host memory a process may still take: MemAvailable, bounded by a container's limit."""

from epd import memory


def test_a_containers_memory_limit_bounds_what_is_available(tmp_path):
    assert memory.cgroup_room(tmp_path) is None  # no cgroup v2 files
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert memory.cgroup_room(tmp_path) is None
    (tmp_path / "memory.max").write_text("1000\n")
    assert memory.cgroup_room(tmp_path) == 600


def test_available_memory_is_the_least_of_what_is_known(monkeypatch):
    monkeypatch.setattr(memory, "meminfo_available", lambda: 1000)
    monkeypatch.setattr(memory, "cgroup_room", lambda: 600)
    assert memory.available_memory() == 600
    monkeypatch.setattr(memory, "cgroup_room", lambda: None)
    assert memory.available_memory() == 1000
    monkeypatch.setattr(memory, "meminfo_available", lambda: None)
    assert memory.available_memory() == 0  # unknown


def test_a_cgroup_v1_limit_counts_too(tmp_path):
    """Docker on cgroup v1 hosts writes memory.limit_in_bytes and memory.usage_in_bytes."""
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.usage_in_bytes").write_text("400\n")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory.cgroup_room(tmp_path) is None
    (v1 / "memory.limit_in_bytes").write_text("1000\n")
    assert memory.cgroup_room(tmp_path) == 600


def test_the_page_cache_a_container_may_drop_is_room(tmp_path):
    """Usage counts the page cache (the checkpoint files just read); its inactive part is room."""
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("900\n")
    (tmp_path / "memory.stat").write_text("anon 300\ninactive_file 500\nactive_file 100\n")
    assert memory.cgroup_room(tmp_path) == 600
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("1000\n")
    (v1 / "memory.usage_in_bytes").write_text("900\n")
    (v1 / "memory.stat").write_text("cache 600\ntotal_inactive_file 400\n")
    assert memory.cgroup_room(tmp_path / "v1") == 500
