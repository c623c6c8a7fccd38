"""Image embeddings by content: least recently used out first, under a byte budget."""

import torch

from epd.kv.hashing import image_digests as digests
from epd.prefill.image_cache import ImageCache


def rows(n):
    return torch.zeros(n, 4)  # n rows of 16 bytes


def test_hits_and_misses_are_counted_and_the_least_recent_goes_first():
    cache = ImageCache(max_bytes=3 * 16)
    a, b, c, d = digests([b"a", b"b", b"c", b"d"])
    for key in (a, b, c):
        cache.put(key, rows(1))
    assert cache.get(a) is not None  # a is now the most recent
    cache.put(d, rows(1))  # over budget: b, the least recent, goes
    assert cache.get(b) is None and cache.get(c) is not None and cache.get(d) is not None
    assert cache.status() == {"image_cache": {"hits": 3, "misses": 1, "bytes": 48}}


def test_too_large_for_the_budget_is_not_kept_and_a_kept_copy_is_its_own():
    cache = ImageCache(max_bytes=16)
    (key,) = digests([b"x"])
    cache.put(key, rows(2))
    assert cache.get(key) is None and cache.bytes == 0
    frame = rows(1)
    cache.put(key, frame)
    frame += 1  # the received frame's memory is not the cache's
    assert torch.equal(cache.get(key), rows(1))


class Unclonable(torch.Tensor):
    def clone(self, *args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")


def test_a_copy_that_cannot_be_made_is_not_kept_and_nothing_fails(caplog):
    cache = ImageCache(max_bytes=3 * 16)
    (key,) = digests([b"x"])
    cache.put(key, rows(1).as_subclass(Unclonable))
    assert cache.get(key) is None and cache.bytes == 0 and "not kept" in caplog.text


def test_a_salted_key_is_its_own_and_the_same_salt_finds_it():
    plain, one, two = (digests([b"img"], salt)[0] for salt in (None, "t-1", "t-2"))
    assert len({plain, one, two}) == 3 and digests([b"img"], "t-1") == [one]
    cache = ImageCache(max_bytes=3 * 16)
    cache.put(one, rows(1))
    assert cache.get(plain) is None and cache.get(two) is None and cache.get(one) is not None


def test_a_size_kept_under_one_salt_says_nothing_of_another_salts_files():
    cache = ImageCache(max_bytes=2 * 16)
    cache.put(digests([b"a"], "t-1")[0], rows(1), file_bytes=100, salt="t-1")
    assert cache.may_hold(100, "t-1")
    assert not cache.may_hold(100, "t-2") and not cache.may_hold(100)


def test_a_file_of_a_size_no_kept_image_has_is_known_missing_before_hashing():
    cache = ImageCache(max_bytes=2 * 16)
    a, b, c = digests([b"a", b"bb", b"ccc"])
    cache.put(a, rows(1), file_bytes=100)
    cache.put(b, rows(1), file_bytes=200)
    assert cache.may_hold(100) and cache.may_hold(200) and not cache.may_hold(300)
    cache.put(c, rows(1), file_bytes=300)  # a, the least recent, goes, and its size with it
    assert not cache.may_hold(100) and cache.may_hold(300)
    assert len(cache.sizes) == 2  # the sizes stay as many as the images kept
    cache.put(digests([b"d"])[0], rows(1))  # size not given: any file may be it
    assert cache.may_hold(12345)
