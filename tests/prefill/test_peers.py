"""Peers given by host name are services: resolved into one peer per address, and again later."""

from epd.prefill.peers import PeerSet, service_of


def test_literal_addresses_are_peers_as_they_are():
    peers = PeerSet("encode", ("tcp://10.0.0.1:7101", "ipc:///tmp/e", "tcp://[fd00::1]:7101"))
    assert peers.current == ("tcp://10.0.0.1:7101", "ipc:///tmp/e", "tcp://[fd00::1]:7101")
    assert peers.services == [] and service_of("tcp://10.0.0.1:7101") is None


def test_a_service_follows_its_dns_answers():
    answers = {"encode.epd.svc": ["10.1.0.5", "10.1.0.7"]}

    def resolve(host, port):
        if host not in answers:
            raise OSError("no such host")
        return answers[host]

    service = "tcp://encode.epd.svc:7101"
    peers = PeerSet("encode", (service, "tcp://10.9.9.9:7101"), resolve)
    assert peers.current == ("tcp://10.1.0.5:7101", "tcp://10.1.0.7:7101", "tcp://10.9.9.9:7101")
    answers["encode.epd.svc"] = ["10.1.0.7", "10.1.0.8", "fd00::2"]  # scaled: one out, two in
    added, removed = peers.resolve()
    assert added == {"tcp://10.1.0.8:7101", "tcp://[fd00::2]:7101"}
    assert removed == {"tcp://10.1.0.5:7101"}
    del answers["encode.epd.svc"]  # a DNS hiccup keeps the last answer
    assert peers.resolve() == (set(), set()) and len(peers.current) == 4


def test_an_unresolvable_service_starts_with_no_peers():
    def fail(host, port):
        raise OSError("no such host")

    peers = PeerSet("decode", ("tcp://decode.epd.svc:7103",), fail)
    assert peers.current == () and peers.services == ["tcp://decode.epd.svc:7103"]
