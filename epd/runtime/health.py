"""GET /health, the same route for every role: 200 while it makes progress, 503 once it stalls.

Prefill serves it on its API port; encode and decode, which have no HTTP API, serve it from a
small server in a background thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from epd.runtime.watchdog import Watchdog

Status = Callable[[], dict[str, object]]
Problems = Callable[[], list[str]]
Trusted = Callable[[Request], bool]
DRAINING = "draining: shutting down"  # the problem a stopping process names
START_TIMEOUT_S = 10.0
# uvicorn's HTTP parser for every server here, named so that an installed httptools is not
# picked up: with it uvicorn bounds no request's headers (a 64 MB one was read whole and
# answered), where h11 refuses headers past 16 KiB with a 400.
HTTP_PROTOCOL = "h11"


def health_router(
    role: str,
    watchdog: Watchdog,
    status: Status = dict,
    problems: Problems = list,
    trusted: Trusted = lambda request: True,
) -> APIRouter:
    """GET /health: the role, its pid and, to a `trusted` caller, `status()`; 503 on a stall
    (with what stalled) or while `problems()` names any (what the process lacks to serve, e.g.
    a reachable peer). Others get the status code and state, which probes read, without the
    counts: those tell one client of a shared server about the others' requests."""
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        stalled, missing = watchdog.stalled(), problems()
        state = "stalled" if stalled else "unavailable" if missing else "ok"
        body: dict[str, object] = {"status": state, "role": role, "pid": os.getpid()}
        if trusted(request):
            body |= status()
        if stalled:
            body["stalled_s"] = stalled
        if missing:
            body["problems"] = missing
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @router.get("/health/live")
    async def live() -> JSONResponse:
        """Whether the process itself still makes progress: 503 on a stall only, never for a
        missing peer (a liveness probe restarts the process, which would not bring one back)."""
        stalled = watchdog.stalled()
        body = {"status": "stalled" if stalled else "ok", "role": role, "pid": os.getpid()}
        return JSONResponse(body, status_code=503 if stalled else 200)

    for path, answer in (("/health", health), ("/health/live", live)):  # probes that read no body
        router.add_api_route(path, answer, methods=["HEAD"], include_in_schema=False)
    return router


class HealthServer:
    """A router served over HTTP from a daemon thread (port 0 picks a free one)."""

    def __init__(self, router: APIRouter, host: str, port: int) -> None:
        app = FastAPI(openapi_url=None)
        app.include_router(router)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            http=HTTP_PROTOCOL,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="health", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"cannot serve GET /health on {host}:{port}")
            time.sleep(0.01)
        bound = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}/health"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
