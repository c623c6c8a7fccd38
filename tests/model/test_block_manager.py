import pytest

from epd.model.block_manager import (
    BLOCK_TOKENS,
    BlockManager,
    ImageSpan,
    PoolFull,
    block_hashes,
)

IDS = list(range(100, 100 + 3 * BLOCK_TOKENS + 5))  # three full blocks and a part


def test_hashes_cover_full_blocks_and_chain_over_what_came_before():
    hashes = block_hashes(IDS)
    assert len(hashes) == 3
    assert block_hashes(IDS[: 2 * BLOCK_TOKENS]) == hashes[:2]  # a prefix hashes the same
    changed = [0, *IDS[1:]]
    assert block_hashes(changed)[2] != hashes[2]  # an earlier token changes every later block
    assert block_hashes(IDS[:BLOCK_TOKENS] * 2)[1] != block_hashes(IDS[:BLOCK_TOKENS])[0]


def test_a_salt_changes_every_hash_of_the_chain_and_the_same_salt_hashes_alike():
    plain, tenant = block_hashes(IDS), block_hashes(IDS, salt="tenant-a")
    assert block_hashes(IDS, salt="tenant-a") == tenant
    for other in (plain, block_hashes(IDS, salt="tenant-b"), block_hashes(IDS, salt="tenant-a ")):
        assert not set(other) & set(tenant)  # no block of one matches any of the other's
    # a salt spelling a block's token bytes does not make its hashes another chain's later ones
    spelled = b"".join(t.to_bytes(4, "little") for t in IDS[:BLOCK_TOKENS])
    shifted = block_hashes(IDS[BLOCK_TOKENS:], salt=spelled.decode("latin-1"))
    assert not set(shifted) & set(plain)


def test_images_with_the_same_placeholders_hash_apart_by_digest():
    ids = [7] * (3 * BLOCK_TOKENS)  # one image's placeholders, all alike
    one = block_hashes(ids, [ImageSpan(4, 40, b"a" * 32)])
    other = block_hashes(ids, [ImageSpan(4, 40, b"b" * 32)])
    assert all(a != b for a, b in zip(one, other, strict=True))
    moved = block_hashes(ids, [ImageSpan(5, 40, b"a" * 32)])
    assert one[0] != moved[0]  # the same image at another offset is other rows
    after = block_hashes(ids, [ImageSpan(2 * BLOCK_TOKENS + 1, 8, b"a" * 32)])
    assert after[:2] == block_hashes(ids)[:2]  # blocks before the image do not see it


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
    first, second = blocks.allocate(2)
    assert blocks.publish(first, b"h1") and blocks.publish(second, b"h2")
    assert blocks.release([second, first]) == []  # cached, not free
    assert blocks.cached == 2 and blocks.available == 3
    assert blocks.match([b"h1", b"h2", b"h3"]) == [first, second]
    assert blocks.held == 2
    blocks.release([second, first])  # second is now the least recently used
    (third,) = blocks.allocate(1)  # the free block first
    assert third == 3 and blocks.cached == 2
    (evicted,) = blocks.allocate(1)
    assert evicted == second and blocks.match([b"h1", b"h2"]) == [first]


def test_the_same_content_is_published_once():
    blocks = BlockManager(4)
    a, b = blocks.allocate(2)
    assert blocks.publish(a, b"h") and not blocks.publish(b, b"h")
    assert blocks.release([a, b]) == [b]


def test_a_held_block_is_never_evicted():
    blocks = BlockManager(3)
    a, b = blocks.allocate(2)
    blocks.publish(a, b"h")
    blocks.release([b])
    assert blocks.allocate(1) == [b]
    with pytest.raises(PoolFull):
        blocks.allocate(1)  # a is cached but held
    blocks.grow(5)
    assert blocks.allocate(2) == [3, 4]
    blocks.reset()
    assert blocks.available == 4 and blocks.cached == 0
