"""The prefill process's drain, as far as it runs in one process."""

import threading
from types import SimpleNamespace

import uvicorn

from epd.api.middleware import Gate
from epd.api.server import DrainingServer


async def no_routes(scope, receive, send) -> None:
    raise AssertionError("no request is expected")


def test_a_stop_signal_before_uvicorn_took_the_signals_drains_as_it_starts():
    """The signal went to the process's own handler (`stop` set, its exit timer started): the
    server drains and stops as soon as it is up, rather than serve until the timer kills it."""
    service = SimpleNamespace(gate=Gate(), config=SimpleNamespace(drain_timeout_s=30.0))
    stop = threading.Event()
    stop.set()
    config = uvicorn.Config(no_routes, port=0, log_config=None, lifespan="off")
    server = DrainingServer(config, service, stop)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and server.started  # up, then stopped at once
    assert service.gate.draining  # so /health is 503 and `run` announces no readiness
