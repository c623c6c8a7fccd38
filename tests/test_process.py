"""The watchdog: GET /health tells a stalled process from a working one, and a stall ends it."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from epd.process import HealthServer, Watchdog, health


def test_health_turns_503_while_an_activity_is_silent_and_back_when_it_beats():
    watchdog = Watchdog(0.5, exits=False)
    assert health("encode", watchdog)[0] == 200
    time.sleep(1.0)
    watchdog.beat("wire")
    status, body = health("encode", watchdog)
    assert status == 503 and body["status"] == "stalled" and list(body["stalled_s"]) == ["loop"]
    watchdog.beat("loop")
    assert health("encode", watchdog)[0] == 200


def test_the_health_endpoint_answers_503_with_what_stalled():
    watchdog = Watchdog(0.2, exits=False)
    server = HealthServer("decode", "127.0.0.1", 0, watchdog, lambda: {"running": 0})
    try:
        time.sleep(0.5)
        try:
            urllib.request.urlopen(server.url, timeout=5)
            raise AssertionError("a stalled process answered 200")
        except urllib.error.HTTPError as e:
            assert e.code == 503
            body = json.loads(e.read())
        assert set(body["stalled_s"]) == {"loop", "wire"} and body["running"] == 0
    finally:
        server.close()


def test_a_process_stalled_for_twice_the_limit_exits_to_be_restarted():
    stalled = "from epd.process import Watchdog; import time; w = Watchdog(0.2); time.sleep(30)"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", stalled], capture_output=True, timeout=30)
    assert result.returncode == 70 and time.monotonic() - start < 10
    assert b"no progress" in result.stderr
