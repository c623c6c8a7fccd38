"""Reply addresses: exact prefills, or TCP networks and ports of literal IP addresses only."""

import pytest

from epd.wire.addresses import Prefills

PREFILLS = Prefills.parse(
    ("tcp://prefill:7102", "ipc:///run/epd/prefill", "tcp://10.0.0.0/8:7102", "tcp://[::1]:*")
)


@pytest.mark.parametrize(
    "address,allowed",
    [
        ("tcp://prefill:7102", True),
        ("ipc:///run/epd/prefill", True),
        ("tcp://10.0.3.7:7102", True),
        ("tcp://[::1]:40000", True),
        ("tcp://10.0.3.7:9999", False),
        ("tcp://11.0.0.1:7102", False),
        ("tcp://prefill:7103", False),
        ("tcp://10.evil.example:7102", False),  # a name is never matched by a network
        ("tcp://10.0.0.5;attacker.example:7102", False),  # libzmq's source;destination form
        ("tcp://10.0.0.5: 7102", False),
        ("tcp://10.0.0.5:+7102", False),
        ("ipc:///tmp/x", False),
        ("inproc://prefill", False),
    ],
)
def test_reply_addresses_must_be_a_configured_prefill(address, allowed):
    assert PREFILLS.allows(address) is allowed


@pytest.mark.parametrize("pattern", ["tcp://10.0.0.0/99:7102", "tcp://prefill/8:7102"])
def test_a_pattern_that_is_not_a_network_is_a_config_error(pattern):
    with pytest.raises(ValueError, match="is not an address, nor tcp://NETWORK:PORT"):
        Prefills.parse((pattern,))
