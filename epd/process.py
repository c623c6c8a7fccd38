"""What every epd process shares: logging, stop signals, the ready line and GET /health."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def setup_logging(role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("EPD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )


def stop_event() -> threading.Event:
    """An event set by SIGINT or SIGTERM, so loops can finish their step and exit cleanly."""
    event = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: event.set())
    return event


def announce_ready(role: str, **endpoints: str) -> None:
    """The one line `epd serve` and operators wait for."""
    where = ", ".join(f"{k} {v}" for k, v in endpoints.items())
    print(f"epd {role} ready (pid {os.getpid()}): {where}", flush=True)


def health(role: str) -> dict[str, object]:
    return {"status": "ok", "role": role, "pid": os.getpid()}


class HealthServer:
    """GET /health over HTTP in a daemon thread, for processes without an HTTP API of their own."""

    def __init__(
        self, role: str, host: str, port: int, status: Callable[[], dict[str, object]] = dict
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                found = self.path == "/health"
                body = health(role) | status() if found else {"error": "not found"}
                self.send_response(200 if found else 404)
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
