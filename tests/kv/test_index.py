"""What the router believes each prefill holds: from its KV events, or from what it sent."""

from epd.kv.index import BlockIndex, external


def test_a_prefill_holds_what_it_stored_less_what_it_removed_or_cleared():
    index = BlockIndex()
    index.stored("a", [1, 2, 3, 4])
    assert index.matched("a", [1, 2, 3, 4, 5]) == 4
    index.removed("a", [3])
    assert index.matched("a", [1, 2, 3, 4]) == 2  # a prefix: what follows a gap does not count
    index.cleared("a")
    assert index.matched("a", [1, 2]) == 0
    assert index.matched("b", [1, 2]) == 0


def test_digests_and_ints_name_a_block_alike():
    digest = bytes(range(32))
    index = BlockIndex()
    index.stored("a", [digest])
    assert index.matched("a", [external(digest)]) == 1
    assert external(digest) == int.from_bytes(digest, "big") & (2**64 - 1)  # vLLM's int form


def test_requests_sent_count_only_for_a_prefill_without_events():
    index = BlockIndex(limit=3)
    index.sent("quiet", [1, 2, 3, 4])  # the oldest goes past the limit
    assert index.matched("quiet", [2, 3, 4]) == 3 and index.matched("quiet", [1]) == 0
    index.stored("loud", [7])
    index.sent("loud", [8])  # its events say what it holds: a request sent is no proof
    assert index.matched("loud", [7, 8]) == 1


def test_a_forgotten_prefill_holds_nothing():
    index = BlockIndex()
    index.stored("a", [1])
    index.forget("a")
    index.sent("a", [2])  # followed by requests again until its events come
    assert index.matched("a", [1]) == 0 and index.matched("a", [2]) == 1


def test_a_fed_prefill_keeps_at_most_the_limit_newest_first():
    index = BlockIndex(limit=2)
    index.stored("a", [1, 2, 3])
    assert index.held("a") == 2 and index.matched("a", [2, 3]) == 2
