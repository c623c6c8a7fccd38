"""The watchdog: whether a process still makes progress, and an end to one that does not."""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)


class Watchdog:
    """Knows whether a process still makes progress.

    Each named activity ("loop": the role's main loop; "wire": a message round trip through
    ZeroMQ) calls `beat(name)` as it makes progress. One silent for longer than `limit_s`
    makes the process unhealthy (GET /health answers 503); silent for twice that, the process
    exits, so whatever supervises it (`epd serve`, docker-compose, Kubernetes) starts it again.
    """

    def __init__(self, limit_s: float, names: tuple[str, ...] = ("loop", "wire")) -> None:
        self.limit_s, self.names = limit_s, names
        self.beats = dict.fromkeys(names, time.monotonic())
        self.closing = threading.Event()
        self.started = False

    def start(self) -> None:
        """Count from now, and exit the process once a stall lasts twice the limit.

        Not started (in tests, or while a model loads), the watchdog only reports stalls.
        """
        if self.started:
            return
        self.started, self.beats = True, dict.fromkeys(self.names, time.monotonic())
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def beat(self, name: str) -> None:
        self.beats[name] = time.monotonic()

    def stalled(self) -> dict[str, float]:
        """Seconds since each activity that has been silent for longer than the limit."""
        now = time.monotonic()
        ages = {name: round(now - last, 1) for name, last in self.beats.items()}
        return {name: age for name, age in ages.items() if age > self.limit_s}

    def _watch(self) -> None:
        while not self.closing.wait(self.limit_s / 4):
            stalled = self.stalled()
            if any(age > 2 * self.limit_s for age in stalled.values()):
                log.critical("no progress for %s seconds: exiting so it is restarted", stalled)
                logging.shutdown()
                os._exit(70)

    def close(self) -> None:
        self.closing.set()
