"""GET /metrics: a role's series labelled by role, its peers' merged in, no `_created`."""

import contextlib
import http.server
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epd.runtime.metrics import RoleMetrics, metrics_router


class Prefill(RoleMetrics):
    role = "prefill"


class Decode(RoleMetrics):
    role = "decode"


@pytest.fixture
def peer():
    """A decoder's /metrics on a loopback port (and /slow, which never answers in time)."""
    decode = Decode("kimi")
    decode.gauge("kv_cache_usage_perc", "KV in use").set(0.25)
    decode.counter("steps", "steps").inc(3)
    text = generate_latest(decode.registry)
    hold, asked = threading.Event(), []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            if self.path == "/slow":
                hold.wait(5)
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(BrokenPipeError):  # /slow: the scrape gave up on it
                self.wfile.write(text)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    hold.set()
    server.shutdown()


def scraped(*peers: str, timeout_s: float = 1.0, times: int = 1) -> dict[str, list]:
    prefill = Prefill("kimi")
    prefill.gauge("kv_cache_usage_perc", "as decoders report it", ["decoder"]).labels("d").set(0.5)
    prefill.counter("requests", "requests").inc()
    app = FastAPI()
    app.include_router(metrics_router(prefill.registry, peers, timeout_s))
    client = TestClient(app)
    texts = {client.get("/metrics").text for _ in range(times)}
    (text,) = texts  # asked again at once: the same scrape
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families)  # each family once
    return {f.name: f.samples for f in families}


def test_every_series_carries_its_role_and_no_created_series_is_exposed():
    found = scraped()
    assert [s.labels for s in found["epd:requests"]] == [{"model_name": "kimi", "role": "prefill"}]
    assert not any(s.name.endswith("_created") for samples in found.values() for s in samples)


def test_a_peers_series_join_the_same_family_under_their_role(peer):
    url, asked = peer
    found = scraped(f"{url}/metrics", times=5)
    assert asked == ["/metrics"]  # a client asking in a loop costs the peers one scrape
    usage = {
        (s.labels["role"], s.labels.get("decoder")): s.value
        for s in found["epd:kv_cache_usage_perc"]
    }
    assert usage == {("prefill", "d"): 0.5, ("decode", None): 0.25}
    assert [(s.labels["role"], s.value) for s in found["epd:steps"]] == [("decode", 3.0)]


def test_a_peer_that_does_not_answer_in_time_is_left_out(peer):
    url, _ = peer
    found = scraped(f"{url}/slow", "http://127.0.0.1:9/metrics", timeout_s=0.3)
    assert "epd:steps" not in found and [s.value for s in found["epd:requests"]] == [1.0]


def test_the_roles_own_series_are_fresh_at_every_scrape_and_the_peers_fetched_once(peer):
    url, asked = peer
    prefill = Prefill("kimi")
    requests = prefill.counter("requests", "requests")
    app = FastAPI()
    app.include_router(metrics_router(prefill.registry, [f"{url}/metrics"]))
    client = TestClient(app)
    for count in range(3):
        found = {
            f.name: f.samples for f in text_string_to_metric_families(client.get("/metrics").text)
        }
        assert [s.value for s in found["epd:requests"]] == [count]
        assert [s.value for s in found["epd:steps"]] == [3.0]  # once, not once per scrape
        requests.inc()
    assert asked == ["/metrics"]
