"""The runtime's HTTP servers: what a client can make them read."""

import http.client

from epd.runtime.health import HealthServer, health_router
from epd.runtime.watchdog import Watchdog


def status_for_header(url: str, value: str) -> int | None:
    """The status of GET /health with a header of `value`; None if the server cut the
    connection while the header was still being sent (it answers 400 and closes)."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", "/health", headers={"X-Padding": value})
        return connection.getresponse().status
    except ConnectionError:
        return None
    finally:
        connection.close()


def test_headers_past_a_bound_are_refused_and_the_server_goes_on():
    """uvicorn with httptools (taken when installed) reads headers of any size: 64 MB ones
    were read whole and answered. The runtime's servers name h11, which bounds them."""
    server = HealthServer(health_router("decode", Watchdog(60)), "127.0.0.1", 0)
    try:
        assert status_for_header(server.url, "a" * 1_000_000) in (400, None)
        assert status_for_header(server.url, "a" * 100) == 200
    finally:
        server.close()
