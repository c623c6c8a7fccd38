"""Start-up phases and the progress of reading weights, as log lines."""

import logging
from pathlib import Path

import pytest

from epd.checkpoint import progress
from epd.checkpoint.progress import Reading, duration, phase, size


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger=progress.__name__)
    return lambda: [r.getMessage() for r in caplog.records if r.name == progress.__name__]


class Clock:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_sizes_and_durations_read_as_people_write_them():
    assert [size(n) for n in (14.2e9, 703_712, 2_048, 12)] == [
        "14.2 GB",
        "703.7 kB",
        "2.0 kB",
        "12 B",
    ]
    assert [duration(s) for s in (0.049, 41.27, 185)] == ["0.05 s", "41.3 s", "3 min 5 s"]


def test_a_phase_says_when_it_starts_and_what_it_did_in_how_long(lines):
    with phase("packing", "packed") as ending:
        assert lines() == ["packing"]
        ending.said = "packed 3 modules"
    assert lines()[1].startswith("packed 3 modules in ") and lines()[1].endswith(" s")


def test_a_phase_that_fails_leaves_the_word_to_its_error(lines):
    with pytest.raises(RuntimeError), phase("warming up", "warmed up"):
        raise RuntimeError("no")
    assert lines() == ["warming up"]


def test_a_slow_read_gets_a_line_at_each_tenth(lines):
    reading = Reading(2, 1000, Path("/ckpt"), Clock(1.0))  # a second per read
    for _ in range(2):
        reading.next_file()
        for _ in range(50):
            reading.read(10)
    reading.finish()
    said = lines()
    assert said[0] == "loading 2 weight files (1.0 kB) from /ckpt"
    assert [line.split(" (")[1].split(")")[0] for line in said[1:-1]] == [
        f"{p}%" for p in range(10, 100, 10)
    ]
    assert "file 1 of 2" in said[1] and "file 2 of 2" in said[-2]
    assert said[-1] == "loaded 2 files, 1.0 kB in 1 min 41 s"


def test_a_fast_read_says_only_where_it_starts_and_ends(lines):
    reading = Reading(1, 1000, Path("/ckpt"), Clock(0.001))
    reading.next_file()
    for _ in range(100):
        reading.read(10)
    reading.finish()
    assert lines() == [
        "loading 1 weight file (1.0 kB) from /ckpt",
        "loaded 1 file, 1.0 kB in 0.10 s",
    ]


def test_a_tenth_that_takes_long_still_gets_a_line_every_so_often(lines):
    reading = Reading(1, 1000, Path("/ckpt"), Clock(10.0))  # 10 s per byte
    reading.next_file()
    for _ in range(12):
        reading.read(1)
    assert len(lines()) == 1 + 4  # at 30, 60, 90 and 120 s, MAX_GAP_S apart
