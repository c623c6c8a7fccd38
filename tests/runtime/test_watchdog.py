"""The watchdog: GET /health tells a stalled process from a working one, and a stall ends it."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from epd.runtime.health import HealthServer, health_router
from epd.runtime.watchdog import Watchdog


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_turns_503_while_an_activity_is_silent_and_back_when_it_beats():
    watchdog = Watchdog(0.5)
    server = HealthServer(health_router("encode", watchdog), "127.0.0.1", 0)
    try:
        assert get(server.url)[0] == 200
        time.sleep(1.0)
        watchdog.beat("wire")
        status, body = get(server.url)
        assert status == 503 and body["status"] == "stalled" and list(body["stalled_s"]) == ["loop"]
        watchdog.beat("loop")
        assert get(server.url)[0] == 200
    finally:
        server.close()


def test_the_health_endpoint_says_what_stalled_and_the_role_status():
    watchdog = Watchdog(0.2)
    server = HealthServer(health_router("decode", watchdog, lambda: {"running": 0}), "127.0.0.1", 0)
    try:
        time.sleep(0.5)
        status, body = get(server.url)
        assert status == 503 and set(body["stalled_s"]) == {"loop", "wire"}
        assert body["role"] == "decode" and body["running"] == 0
    finally:
        server.close()


def test_a_process_stalled_for_twice_the_limit_exits_to_be_restarted():
    stalled = (
        "from epd.runtime.watchdog import Watchdog; import time; "
        "Watchdog(0.2).start(); time.sleep(30)"
    )
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", stalled], capture_output=True, timeout=30)
    assert result.returncode == 70 and time.monotonic() - start < 10
    assert b"no progress" in result.stderr
