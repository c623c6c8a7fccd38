"""What every epd process shares: logging, stopping, the ready line, a watchdog and GET /health."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)
SUPERVISOR_ENV = "EPD_SUPERVISOR_PID"  # set by `epd serve`: its children end when it does
STOP_GRACE_S = 15.0  # a process asked to stop that has not finished by then exits at once
PR_SET_PDEATHSIG = 1


def setup_logging(role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("EPD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )


def stop_event() -> threading.Event:
    """An event set by SIGINT or SIGTERM, so loops can finish their step and exit cleanly.

    A loop that is stuck never sees the event; the process then exits on its own after
    STOP_GRACE_S, so a stop request always ends it (PID 1 in a container cannot be SIGKILLed
    from inside).
    """
    event = threading.Event()

    def requested(*_: object) -> None:
        if not event.is_set():
            event.set()
            threading.Thread(target=_exit_after, args=(STOP_GRACE_S,), daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, requested)
    return event


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    print(f"epd: still running {seconds:.0f}s after a stop request; exiting", flush=True)
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


class Watchdog:
    """Knows whether a process still makes progress.

    Each named activity ("loop": the role's main loop; "wire": a message round trip through
    ZeroMQ) calls `beat(name)` as it makes progress. One silent for longer than `limit_s`
    makes the process unhealthy (GET /health answers 503); silent for twice that, the process
    exits, so whatever supervises it (`epd serve`, docker-compose, Kubernetes) starts it again.
    """

    def __init__(
        self, limit_s: float, names: tuple[str, ...] = ("loop", "wire"), exits: bool = True
    ) -> None:
        self.limit_s = limit_s
        self.beats = dict.fromkeys(names, time.monotonic())
        self.closing = threading.Event()
        if exits:
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


def health(role: str, watchdog: Watchdog | None = None) -> tuple[int, dict[str, object]]:
    """GET /health's status code and body: 503 while the watchdog sees a stall."""
    body: dict[str, object] = {"status": "ok", "role": role, "pid": os.getpid()}
    stalled = watchdog.stalled() if watchdog else {}
    if stalled:
        body |= {"status": "stalled", "stalled_s": stalled}
    return (503 if stalled else 200), body


class HealthServer:
    """GET /health over HTTP in a daemon thread, for processes without an HTTP API of their own."""

    def __init__(
        self,
        role: str,
        host: str,
        port: int,
        watchdog: Watchdog | None = None,
        status: Callable[[], dict[str, object]] = dict,
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, body = health(role, watchdog) if self.path == "/health" else (404, {})
                body = body | status() if code != 404 else {"error": "not found"}
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())

            def log_message(self, *args: object) -> None:  # probes are not news
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/health"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
