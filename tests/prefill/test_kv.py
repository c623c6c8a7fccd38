"""What prefill believes each decoder holds: what it handed it, less what the decoder said it
lacks, within a bound, and nothing of a decoder that left."""

import os

from epd.config.settings import peer_endpoint
from epd.kv.events import KVEventsConfig, ZmqKVEvents
from epd.prefill.kv import DecoderBlocks
from tests.kv.test_listener import until
from tests.wire.zmtp import free_port

HASHES = [bytes([i]) * 32 for i in range(6)]


def test_a_decoder_holds_the_leading_blocks_prefill_handed_it():
    held = DecoderBlocks()
    assert held.blocks("a", HASHES) == 0
    held.sent("a", HASHES[:4])
    assert held.blocks("a", HASHES) == 4 and held.blocks("b", HASHES) == 0
    assert held.blocks("a", [HASHES[0], HASHES[5], HASHES[1]]) == 1  # a prefix, no more


def test_what_a_decoder_lacks_is_forgotten_and_one_that_keeps_nothing_is_never_believed():
    held = DecoderBlocks()
    held.sent("a", HASHES)
    held.missing("a", HASHES, held=2, keeps=True)
    assert held.blocks("a", HASHES) == 2
    held.missing("a", HASHES, held=0, keeps=False)  # its prefix cache is off
    held.sent("a", HASHES)
    assert held.blocks("a", HASHES) == 0


def test_each_decoder_is_remembered_within_a_bound_least_recently_used_out():
    held = DecoderBlocks(per_decoder=4)
    held.sent("a", HASHES[:4])
    assert held.blocks("a", HASHES[1:2]) == 1  # asked of: every candidate is, it stays old
    held.sent("a", HASHES[:1])  # the first block, handed again
    held.sent("a", HASHES[4:5])
    assert held.blocks("a", HASHES[:1]) == 1 and held.blocks("a", HASHES[1:2]) == 0


def test_decoders_that_left_are_forgotten():
    held = DecoderBlocks()
    held.sent("a", HASHES)
    held.sent("b", HASHES)
    held.missing("c", HASHES, held=0, keeps=False)
    held.keep_only(["b"])
    assert held.index.peers() == ["b"] and not held.keep_nothing


def test_a_decoder_lost_is_believed_to_hold_nothing():
    held = DecoderBlocks()
    held.sent("a", HASHES)
    held.lost("a")  # it may come back restarted
    assert held.blocks("a", HASHES) == 0


def test_a_decoders_events_tell_every_prefill_what_it_stored_and_evicted():
    """A decoder publishes on a socket of its own, found from its address by the template: a
    prefill learns of blocks another prefill handed it, and of those it evicted."""
    decoders = [f"tcp://127.0.0.1:{port}" for port in (free_port(), free_port())]
    template = f"ipc://@epd-test-kv-{os.getpid()}-{{port}}"
    endpoints = [peer_endpoint(template, d) or "" for d in decoders]
    publishers = [ZmqKVEvents(KVEventsConfig(True, endpoint=e)) for e in endpoints]
    held = DecoderBlocks(events=template)
    try:
        held.keep_only(decoders)

        def store() -> None:
            publishers[0].stored(HASHES[:3], None, list(range(48)), 16)
            publishers[0].flush()

        assert until(lambda: held.blocks(decoders[0], HASHES) == 3, store)
        assert held.blocks(decoders[1], HASHES) == 0  # the other's socket said nothing

        def evict() -> None:
            publishers[0].removed(HASHES[1:2])
            publishers[0].flush()

        assert until(lambda: held.blocks(decoders[0], HASHES) == 1, evict)
        held.sent(decoders[1], HASHES[:2])  # held at once, before its events come
        assert held.blocks(decoders[1], HASHES) == 2
        held.keep_only(decoders[1:])  # the first left: forgotten, its socket closed
        assert held.blocks(decoders[0], HASHES) == 0
        assert until(lambda: decoders[0] not in held.listener.followed, lambda: None)
    finally:
        for publisher in publishers:
            publisher.close()
        held.close()
