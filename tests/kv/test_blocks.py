"""Block hashes name a block's rows by everything that determines them, and the block manager
hands blocks out, keeps published ones cached for later prompts and tells what it caches."""

import pytest

from epd.kv.blocks import BlockManager, PoolFull
from epd.kv.hashing import (
    BLOCK_TOKENS,
    ImageSpan,
    block_hashes,
    chain_seed,
    image_spans,
    model_key,
    salt_digest,
)

IDS = list(range(100, 100 + 3 * BLOCK_TOKENS + 5))  # three full blocks and a part
HASHES = block_hashes(IDS)


def seeded(salt: str | None) -> bytes:
    return chain_seed(b"model", salt_digest(salt))


def tokens_of(block: int) -> list[int]:
    return IDS[block * BLOCK_TOKENS : (block + 1) * BLOCK_TOKENS]


class Heard:
    """A `BlockEvents` sink that keeps what it was told, in order."""

    def __init__(self) -> None:
        self.told: list[tuple] = []

    def stored(
        self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int
    ) -> None:
        self.told.append(("stored", block_hashes, parent, token_ids, block_size))

    def removed(self, block_hashes: list[bytes]) -> None:
        self.told.append(("removed", block_hashes))

    def cleared(self) -> None:
        self.told.append(("cleared",))


def published(blocks: BlockManager, count: int) -> list[int]:
    """`count` blocks allocated and published as IDS's first `count` blocks, still held."""
    taken = blocks.allocate(count)
    for index, block in enumerate(taken):
        parent = HASHES[index - 1] if index else None
        assert blocks.publish(block, HASHES[index], parent, tokens_of(index))
    return taken


def test_hashes_cover_full_blocks_and_chain_over_what_came_before():
    assert len(HASHES) == 3
    assert block_hashes(IDS[: 2 * BLOCK_TOKENS]) == HASHES[:2]  # a prefix hashes the same
    changed = [0, *IDS[1:]]
    assert block_hashes(changed)[2] != HASHES[2]  # an earlier token changes every later block
    assert block_hashes(IDS[:BLOCK_TOKENS] * 2)[1] != block_hashes(IDS[:BLOCK_TOKENS])[0]
    assert block_hashes(IDS[BLOCK_TOKENS:], seed=HASHES[0]) == HASHES[1:]  # the chain's link


def test_a_salt_changes_every_hash_of_the_chain_and_the_same_salt_hashes_alike():
    plain, tenant = block_hashes(IDS, seed=seeded(None)), block_hashes(IDS, seed=seeded("tenant-a"))
    assert salt_digest(None) == b"" and seeded(None) == chain_seed(b"model")
    assert block_hashes(IDS, seed=seeded("tenant-a")) == tenant
    for salt in (None, "tenant-b", "tenant-a "):
        other = block_hashes(IDS, seed=seeded(salt))
        assert not set(other) & set(tenant)  # no block of one matches any of the other's
    # a salt spelling a block's token bytes does not make its hashes another chain's later ones
    spelled = b"".join(t.to_bytes(4, "little") for t in tokens_of(0))
    shifted = block_hashes(IDS[BLOCK_TOKENS:], seed=seeded(spelled.decode("latin-1")))
    assert not set(shifted) & set(plain)


def test_another_checkpoint_or_dtype_changes_every_hash():
    key = model_key(b"\x01" * 32, "bfloat16")
    ours = block_hashes(IDS, seed=chain_seed(key))
    assert block_hashes(IDS, seed=chain_seed(model_key(b"\x01" * 32, "bfloat16"))) == ours
    for other in (model_key(b"\x02" * 32, "bfloat16"), model_key(b"\x01" * 32, "float32")):
        assert other != key
        assert not set(block_hashes(IDS, seed=chain_seed(other))) & set(ours)
        tenant = salt_digest("tenant-a")
        salted = block_hashes(IDS, seed=chain_seed(other, tenant))
        assert not set(salted) & set(block_hashes(IDS, seed=chain_seed(key, tenant)))


def test_images_with_the_same_placeholders_hash_apart_by_digest():
    ids = [7] * (3 * BLOCK_TOKENS)  # one image's placeholders, all alike
    one = block_hashes(ids, [ImageSpan(4, 40, b"a" * 32)])
    other = block_hashes(ids, [ImageSpan(4, 40, b"b" * 32)])
    assert all(a != b for a, b in zip(one, other, strict=True))
    moved = block_hashes(ids, [ImageSpan(5, 40, b"a" * 32)])
    assert one[0] != moved[0]  # the same image at another offset is other rows
    after = block_hashes(ids, [ImageSpan(2 * BLOCK_TOKENS + 1, 8, b"a" * 32)])
    assert after[:2] == block_hashes(ids)[:2]  # blocks before the image do not see it
    assert after[2] != block_hashes(ids)[2]


def test_image_spans_are_each_images_placeholder_run_or_none():
    p = 9
    ids = [1, p, p, p, 2, p, p, 3]
    spans = image_spans(ids, p, [3, 2], ["aa", "bb"])
    assert spans == (ImageSpan(1, 3, b"\xaa"), ImageSpan(5, 2, b"\xbb"))
    assert image_spans(ids, p, [2, 3], ["aa", "bb"]) is None  # the first run is not 2 long
    assert image_spans(ids, p, [5], ["aa"]) is None  # one image's slots are not one run
    assert image_spans(ids, p, [3, 2], ["aa"]) is None  # a digest missing
    assert image_spans(ids, p, [3], ["aa"]) is None  # slots no image accounts for


def test_blocks_are_handed_out_lowest_first_and_never_block_zero():
    blocks = BlockManager(5)
    assert blocks.allocate(2) == [1, 2]
    assert blocks.allocate(2) == [3, 4]
    with pytest.raises(PoolFull):
        blocks.allocate(1)
    assert blocks.release([2]) == [2]
    assert blocks.allocate(1) == [2]


def test_a_published_block_outlives_its_holders_until_its_room_is_needed():
    blocks = BlockManager(4)
    first, second = published(blocks, 2)
    assert blocks.release([first, second]) == []  # cached, not free
    assert blocks.cached == 2 and blocks.available == 3 and blocks.held == 0
    assert blocks.match(HASHES) == [first, second]  # the longest cached prefix
    assert blocks.held == 2 and blocks.available == 1
    blocks.release([first, second])  # released together: the later block goes first
    (third,) = blocks.allocate(1)  # the free block first
    assert third == 3 and blocks.cached == 2
    (evicted,) = blocks.allocate(1)
    assert evicted == second and blocks.match(HASHES[:2]) == [first]


def test_a_match_stops_at_the_first_block_not_cached():
    blocks = BlockManager(5)
    first, second = published(blocks, 2)
    blocks.release([first, second])
    assert blocks.match([HASHES[0], b"elsewhere", HASHES[1]]) == [first]
    assert blocks.match([b"elsewhere", *HASHES]) == []
    assert blocks.refs == {first: 1}


def test_the_same_content_is_published_once():
    blocks = BlockManager(4, Heard())
    a, b = blocks.allocate(2)
    assert blocks.publish(a, b"h", None, tokens_of(0))
    assert not blocks.publish(b, b"h", None, tokens_of(0))  # the same rows, elsewhere
    assert not blocks.publish(a, b"other", None, tokens_of(0))  # a block keeps its first name
    assert blocks.events.told == [("stored", [b"h"], None, tokens_of(0), BLOCK_TOKENS)]
    assert blocks.release([a, b]) == [b]


def test_a_held_block_is_never_evicted():
    blocks = BlockManager(3)
    a, b = blocks.allocate(2)
    blocks.publish(a, b"h", None, tokens_of(0))
    blocks.release([b])
    assert blocks.allocate(1) == [b]
    with pytest.raises(PoolFull):
        blocks.allocate(1)  # a is cached but held
    blocks.grow(5)
    assert blocks.allocate(2) == [3, 4]
    blocks.reset()
    assert blocks.available == 4 and blocks.cached == 0


def test_a_shared_block_is_cached_only_when_its_last_holder_lets_go():
    blocks = BlockManager(3)
    (a,) = published(blocks, 1)
    blocks.hold([a])
    blocks.release([a])
    assert blocks.refs == {a: 1} and blocks.available == 1
    blocks.release([a])
    assert blocks.refs == {} and blocks.available == 2 and blocks.cached == 1


def test_publishing_tells_stored_with_the_parent_hash_and_the_blocks_tokens():
    heard = Heard()
    blocks = BlockManager(5, heard)
    published(blocks, 3)
    assert heard.told == [
        ("stored", [HASHES[0]], None, tokens_of(0), BLOCK_TOKENS),
        ("stored", [HASHES[1]], HASHES[0], tokens_of(1), BLOCK_TOKENS),
        ("stored", [HASHES[2]], HASHES[1], tokens_of(2), BLOCK_TOKENS),
    ]


def test_release_puts_a_prompts_later_blocks_ahead_of_its_earlier_ones_for_eviction():
    heard = Heard()
    blocks = BlockManager(5, heard)
    first, second, third = published(blocks, 3)
    blocks.release([first, second, third])
    heard.told.clear()
    assert blocks.allocate(1) == [4]  # a free block before any cached one
    assert blocks.allocate(1) == [third] and blocks.allocate(1) == [second]
    assert heard.told == [("removed", [HASHES[2]]), ("removed", [HASHES[1]])]
    assert blocks.match(HASHES) == [first]  # the prefix outlived its own later blocks


def test_eviction_at_allocate_tells_removed_of_every_block_it_took():
    heard = Heard()
    blocks = BlockManager(4, heard)
    taken = published(blocks, 3)
    blocks.release(taken)
    heard.told.clear()
    assert blocks.allocate(2) == [taken[2], taken[1]]
    assert heard.told == [("removed", [HASHES[2], HASHES[1]])]  # one event for the allocation
    assert blocks.cached == 1 and blocks.available == 1


def test_max_cached_trims_the_least_recently_used_and_tells_removed():
    heard = Heard()
    blocks = BlockManager(6, heard, max_cached=1)
    taken = published(blocks, 3)
    heard.told.clear()
    assert blocks.release(taken) == [taken[2], taken[1]]  # free now, not cached
    assert heard.told == [("removed", [HASHES[2], HASHES[1]])]
    assert blocks.cached == 1 and blocks.match(HASHES) == [taken[0]]
    assert blocks.allocate(2) == [taken[1], taken[2]]  # free again, lowest first


def test_held_blocks_do_not_count_against_max_cached():
    blocks = BlockManager(6, max_cached=1)
    taken = published(blocks, 3)
    assert blocks.release([]) == [] and blocks.cached == 3  # held: nothing to trim
    blocks.release(taken[:1])
    assert blocks.cached == 3 and blocks.match(HASHES) == taken


def test_drop_cached_frees_every_cached_block_nobody_holds():
    heard = Heard()
    blocks = BlockManager(5, heard)
    first, second, third = published(blocks, 3)
    blocks.release([second, third])
    heard.told.clear()
    assert sorted(blocks.drop_cached()) == [second, third]
    assert heard.told == [("removed", [HASHES[2], HASHES[1]])]
    assert blocks.cached == 1 and blocks.refs == {first: 1}
    assert blocks.allocate(3) == [second, third, 4]


def test_reset_tells_cleared_only_when_something_was_cached():
    heard = Heard()
    blocks = BlockManager(5, heard)
    blocks.allocate(2)
    blocks.reset()
    assert heard.told == []  # nothing was cached: nothing to tell
    published(blocks, 1)
    heard.told.clear()
    blocks.reset(8)
    assert heard.told == [("cleared",)]
    assert blocks.available == 7 and blocks.held == 0 and blocks.match(HASHES) == []


def test_a_block_matched_again_is_evicted_after_those_left_alone():
    blocks = BlockManager(3)
    a, b = blocks.allocate(2)
    blocks.publish(a, b"a", None, tokens_of(0))
    blocks.publish(b, b"b", None, tokens_of(0))
    blocks.release([a])
    blocks.release([b])  # a is the least recently used
    blocks.release(blocks.match([b"a"]))  # and now b
    assert blocks.allocate(1) == [b] and blocks.match([b"a"]) == [a]
