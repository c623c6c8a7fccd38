"""A peer's endpoint from a template of its address (prefill's `decoder_kv_events`)."""

import pytest

from epd.config.settings import peer_endpoint, peer_endpoint_problem


def test_a_template_names_each_peers_own_endpoint_from_its_address():
    assert peer_endpoint("tcp://{host}:5557", "tcp://10.0.0.5:7103") == "tcp://10.0.0.5:5557"
    assert peer_endpoint("tcp://{host}:{port+30}", "tcp://[::1]:7103") == "tcp://[::1]:7133"
    assert peer_endpoint("ipc:///run/kv-{port}", "tcp://127.0.0.1:7103") == "ipc:///run/kv-7103"
    assert peer_endpoint("tcp://{host}:5557", "ipc:///run/decode") is None  # no host to name
    assert peer_endpoint("tcp://{host}:{port+99999}", "tcp://10.0.0.5:7103") is None  # no port


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("http://{host}:5557", "ZeroMQ address"),
        ("tcp://{hots}:5557", "may hold only"),
        ("tcp://10.0.0.9:5557", "each peer's own"),  # every decoder credited with all blocks
        ("tcp://*:{port}", "not a wildcard"),
    ],
)
def test_a_template_that_cannot_name_each_peer_is_refused(template, problem):
    assert problem in (peer_endpoint_problem(template) or "")
    assert peer_endpoint_problem("tcp://{host}:5557") is None
