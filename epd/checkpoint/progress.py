"""Signs of life while a role starts: a line as each start-up phase begins, one with its
duration as it ends, and how far reading the weights has come. A real checkpoint takes minutes
to load and pack, which must not pass in silence.

Plain log lines whatever the output is: under `epd serve` each role writes into a pipe, in its
own format (text or JSON), where a carriage-return bar would only garble the lines; and few
enough of them (`Reading`) that a log file stays readable.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
STEPS = 10  # a progress line at each tenth of the bytes,
MIN_GAP_S = 2.0  # but never sooner than this after the last line (a fast load says nothing),
MAX_GAP_S = 30.0  # and after this long without one even if a tenth takes longer


def size(nbytes: float) -> str:
    """Bytes for people, in powers of 1000 as download sizes are: '14.2 GB', '703.7 kB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def duration(seconds: float) -> str:
    """'0.05 s', '41.3 s', '3 min 5 s'."""
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


@dataclass
class Ending:
    """What a phase's last line says before its duration; the phase may set it as it learns."""

    said: str


@contextlib.contextmanager
def phase(doing: str, done: str) -> Iterator[Ending]:
    """Log `doing` as a start-up phase begins and, once it has ended well, `done` (or what the
    phase set instead) with the time it took. A phase that raises says no more: its error does."""
    log.info("%s", doing)
    ending, start = Ending(done), time.monotonic()
    yield ending
    log.info("%s in %s", ending.said, duration(time.monotonic() - start))


class Reading:
    """How far reading `total` bytes of weights from `files` files has come: a line as it
    starts, one at each tenth of the bytes (at most every MIN_GAP_S, at least every MAX_GAP_S
    while it lasts) naming the file it is in, and the totals at the end."""

    def __init__(
        self, files: int, total: int, where: Path, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.files, self.total, self.clock = files, total, clock
        self.file, self.done, self.tenths = 0, 0, 0
        self.start = self.last_line = clock()
        noun = "file" if files == 1 else "files"
        log.info("loading %d weight %s (%s) from %s", files, noun, size(total), where)

    def next_file(self) -> None:
        self.file += 1

    def read(self, nbytes: int) -> None:
        """`nbytes` more of the total have been read."""
        self.done += nbytes
        now, tenths = self.clock(), self.done * STEPS // max(self.total, 1)
        quiet = now - self.last_line
        if (
            self.done < self.total
            and quiet >= MIN_GAP_S
            and (tenths > self.tenths or quiet >= MAX_GAP_S)
        ):
            self.tenths, self.last_line = tenths, now
            log.info(
                "loaded %s of %s (%d%%), file %d of %d, %s so far",
                size(self.done),
                size(self.total),
                100 * self.done // max(self.total, 1),
                self.file,
                self.files,
                duration(now - self.start),
            )

    def finish(self) -> None:
        noun = "file" if self.files == 1 else "files"
        elapsed = duration(self.clock() - self.start)
        log.info("loaded %d %s, %s in %s", self.files, noun, size(self.done), elapsed)
