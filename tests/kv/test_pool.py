"""Decode steps over a pool's block tables give what the model's own prefill over the whole
sequence gives, through joins, leaves, growth, evictions and shared prefixes, read either way
(gathered every step, or kept gathered as on a CPU), and the pool never holds more blocks than
its budget: cached blocks are free space, shared, never copied."""

import random

import pytest
import torch

from epd.checkpoint.weights import load_model
from epd.kv.hashing import BLOCK_TOKENS, block_hashes
from epd.kv.pool import BlockPool, PoolFull
from epd.model.cpu_gathered import HEADROOM_BLOCKS, Gathered, KeepGathered, KeptBatch
from epd.model.paged import GatherEachStep, by_length
from tests.kv.pooled import loaded, pool_for, step
from tests.kv.test_blocks import Heard

PROMPTS = [[5, 17, 42, 99], [7, 300, 12, 64, 128, 3, 250], [31, 77], [9] * 20]
IDS = [(7 * i) % 400 + 5 for i in range(2 * BLOCK_TOKENS + 8)]  # two full blocks and a part
HASHES = block_hashes(IDS)


class Reference:
    """The model's own prefill of whole sequences, each attending only to itself: what steps
    over a pool must give. Position t of a sequence's prefill is causal, so its logits are the
    next token's after ids[: t + 1], and its rows those of the tokens so far. Sequences are
    prefilled together (`lengths`) and remembered: a call's fixed cost dwarfs the tiny model's
    work."""

    def __init__(self, lm) -> None:
        self.lm = lm
        self.done: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def prefill(self, *sequences: list[int]) -> None:
        todo = list(dict.fromkeys(tuple(ids) for ids in sequences if tuple(ids) not in self.done))
        if not todo:
            return
        lengths = [len(ids) for ids in todo]
        embeds = self.lm.embed(torch.tensor([t for ids in todo for t in ids]))
        hidden, rows = self.lm.prefill(embeds, lengths)
        parts = zip(todo, hidden.split(lengths), rows.split(lengths, dim=1), strict=True)
        for ids, own_hidden, own_rows in parts:
            self.done[ids] = own_hidden, own_rows

    def hidden(self, ids: list[int]) -> torch.Tensor:
        """(tokens, hidden)"""
        self.prefill(ids)
        return self.done[tuple(ids)][0]

    def rows(self, ids: list[int]) -> torch.Tensor:
        """(layers, tokens, latent)"""
        self.prefill(ids)
        return self.done[tuple(ids)][1]

    def logits(self, ids: list[int]) -> torch.Tensor:
        """(tokens, vocab)"""
        return self.lm.logits(self.hidden(ids))

    def next_logits(self, *sequences: list[int]) -> torch.Tensor:
        """Each sequence's last position's logits, (B, vocab)."""
        self.prefill(*sequences)
        return torch.stack([self.logits(ids)[-1] for ids in sequences])


class Request:
    """A table, the tokens of its prompt and those fed since, and each step's logits."""

    def __init__(self, pool: BlockPool, reference: Reference, prompt: list[int]) -> None:
        self.table = loaded(pool, reference.rows(prompt))
        self.ids, self.prompt = list(prompt), len(prompt)
        self.logits: list[torch.Tensor] = []

    def check(self, reference: Reference) -> None:
        """Every step's logits and the table's rows equal the whole sequence's prefill."""
        expected = reference.logits(self.ids)[self.prompt :]
        assert_close(torch.stack(self.logits), expected)
        if self.table.blocks:  # still in the pool
            assert_close(self.table.rows(), reference.rows(self.ids))


def decode(lm, pool: BlockPool, running: list[Request], token: int, reader=None) -> None:
    """One step of every running request, each fed `token`."""
    tables = [request.table for request in running]
    logits = step(lm, pool, tables, torch.tensor([token] * len(running)), reader)
    for request, row in zip(running, logits, strict=True):
        request.ids.append(token)
        request.logits.append(row)


@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    return load_model(tiny_checkpoint, role="language").language_model


@pytest.fixture(scope="module")
def reference(lm) -> Reference:
    made = Reference(lm)
    made.prefill(*PROMPTS, IDS, *([9] * n for n in (BLOCK_TOKENS - 1, 16, 20, 40, 63)))
    return made


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def assert_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("reader", [GatherEachStep, KeepGathered])
@torch.inference_mode()
def test_steps_over_blocks_equal_prefill_over_the_whole_sequence(lm, reference, reader):
    reader = reader()
    pool = pool_for(lm)
    running = [Request(pool, reference, p) for p in PROMPTS[:3]]
    requests = list(running)
    for n in range(20):  # past the first block, so tables take blocks under way
        if n == 5:  # the middle one leaves; its block is free
            pool.release(running.pop(1).table)
        if n == 8:  # a long one joins, into the freed block and new ones
            running.append(Request(pool, reference, PROMPTS[3]))
            requests.append(running[-1])
        decode(lm, pool, running, 3 + n, reader)
    reference.prefill(*(request.ids for request in requests))
    for request in requests:
        request.check(reference)
    # 4 + 20 rows, 2 + 20 and 20 + 12: two blocks each, no more
    assert [len(r.table.blocks) for r in running] == [2, 2, 2] and pool.used_blocks == 6


@torch.inference_mode()
def test_any_subset_in_any_order_reads_its_own_blocks(lm, reference):
    pool = pool_for(lm)
    prompts = [*PROMPTS, [8] * 12]
    order, tokens = [3, 4, 0], [9, 4, 7]  # 20 tokens (+ the step's: 2 blocks), 12, 4 (1 each)
    reference.prefill(*prompts, *([*prompts[i], t] for i, t in zip(order, tokens, strict=True)))
    tables = [loaded(pool, reference.rows(p)) for p in prompts]
    batch = GatherEachStep().batch(pool.storage, [tables[i] for i in order], pool.max_bytes)
    (long, long_blocks, long_seen), (short, short_blocks, short_seen) = batch.tables
    assert long.tolist() == [0, 1] and short.tolist() == [2]  # 21 and 13 rows; 5 apart
    assert long_blocks.tolist() == [*tables[3].blocks, *tables[4].blocks, 0]  # the zero block
    assert short_blocks.tolist() == tables[0].blocks
    # Whole blocks, the rows past each length masked: the products meet a new shape only as a
    # table takes a block (oneDNN builds a kernel for each, in bfloat16 on a CPU).
    assert long_seen.sum(1).tolist() == [21, 13] and long_seen.shape[1] == 2 * BLOCK_TOKENS
    assert short_seen.sum(1).tolist() == [5] and short_seen.shape[1] == BLOCK_TOKENS
    rows = torch.zeros(3, lm.config.latent_dim)  # this step's, overwritten by the step below
    assert [p.cache.shape[1] for p in batch.append_and_gather(0, rows)] == [32, 16]
    hidden = lm.decode(torch.tensor(tokens), batch)
    for row, i, token in zip(hidden, order, tokens, strict=True):
        assert_close(row, reference.hidden([*prompts[i], token])[-1])
    assert tables[1].length == len(PROMPTS[1])  # not in the step: untouched


def test_tables_are_grouped_so_none_is_padded_past_twice_its_length():
    assert by_length([5, 21, 12, 11]) == [[1, 2, 3], [0]]
    assert by_length([300, 310, 155, 7000]) == [[3], [1, 0], [2]]
    assert by_length([310, 300, 305]) == [[0, 1, 2]]  # one group keeps the batch's order


@torch.inference_mode()
def test_blocks_full_of_nan_are_zeros_when_taken_by_the_next_table(lm, reference):
    """Rows past a table's length are read, masked, by every step: they must be zeros, or a
    departed request's NaN would reach its successor through 0 × NaN."""
    pool = pool_for(lm)
    kept = loaded(pool, reference.rows(PROMPTS[3]))
    bad = loaded(pool, reference.rows(PROMPTS[3]))
    poisoned = list(bad.blocks)
    pool.storage[:, poisoned] = float("nan")  # e.g. a request whose step overflowed
    pool.release(bad)
    assert pool.storage[:, poisoned].isnan().all()  # freed as they were: zeroed when taken
    # 16 rows fill the first block; the second is taken for its next row, and read masked
    newcomer = loaded(pool, reference.rows([9] * 16))
    assert sorted(newcomer.blocks) == sorted(poisoned)
    logits = step(lm, pool, [kept, newcomer], torch.tensor([4, 5]))
    assert logits.isfinite().all()
    assert_close(logits, reference.next_logits([*PROMPTS[3], 4], [*[9] * 16, 5]))


@torch.inference_mode()
def test_the_budget_bounds_the_blocks_and_evicted_rows_come_back_whole(lm, reference):
    pool = pool_for(lm, max_tokens=4 * BLOCK_TOKENS)  # 4 blocks
    long = loaded(pool, reference.rows([9] * 40))  # 41 rows with its next: 3 blocks
    assert pool.free_blocks == 1 and pool.can_admit(len(PROMPTS[0]))
    assert not pool.can_admit(len(PROMPTS[0]), running=1)  # 1 + a spare for long's next
    table = pool.table()
    with pytest.raises(PoolFull, match="2 blocks of 16 rows asked for, 1 free of 4"):
        pool.write(table, reference.rows([9] * 20))
    assert table.blocks == [] and table.length == 0 and pool.free_blocks == 1
    pool.release(table)
    assert pool.storage.shape[1] <= 1 + 4  # never past the budget (+ the zero block)
    before = long.rows().clone()
    kept = pool.evict(long)
    assert kept.device.type == "cpu" and long.blocks == []
    assert_equal(kept, before)
    assert len(pool) == 0 and pool.storage.shape[1] == 1  # the last one out gives memory back
    assert_equal(loaded(pool, kept).rows(), before)


@torch.inference_mode()
def test_a_full_block_takes_a_new_one_only_when_the_next_row_needs_it(lm, reference):
    pool = pool_for(lm, max_tokens=2 * BLOCK_TOKENS)
    table = loaded(pool, reference.rows([9] * (BLOCK_TOKENS - 1)))  # its next row ends block 1
    assert len(table.blocks) == 1
    pool.make_room(table)
    assert len(table.blocks) == 1
    table.length += 1  # a step wrote it
    pool.make_room(table)
    assert len(table.blocks) == 2 and pool.free_blocks == 0
    table.length += BLOCK_TOKENS
    with pytest.raises(PoolFull):
        pool.make_room(table)


class Unreadable:
    """Rows whose copy into the storage fails (e.g. out of memory on the way to the device)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def to(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError("out of memory")


@torch.inference_mode()
def test_a_table_whose_write_fails_leaves_its_blocks_free_once_released(lm, reference):
    pool = pool_for(lm, max_tokens=4 * BLOCK_TOKENS)
    kept = loaded(pool, reference.rows(PROMPTS[0]))
    table = pool.table()
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.write(table, Unreadable(reference.rows([9] * 40).shape))
    assert table.length == 0
    pool.release(table)  # as its caller does
    assert pool.free_blocks == 3 and len(pool) == 1
    assert len(loaded(pool, reference.rows([9] * 40)).blocks) == 3  # the blocks it had taken
    assert (pool.storage[:, 0] == 0).all() and kept.length == len(PROMPTS[0])
    assert_equal(kept.rows(), reference.rows(PROMPTS[0]))


@torch.inference_mode()
def test_a_preallocated_pool_never_grows_and_keeps_its_memory(lm, reference, monkeypatch):
    """As on a GPU: growing by doubling would need 1.5x the budget at once."""
    pool = pool_for(lm, 64, preallocate=True)
    monkeypatch.setattr(pool, "grow", None)  # calling it would fail the test
    storage = pool.storage
    assert storage.shape[1] == 5 and pool.free_blocks == 4
    assert loaded(pool, reference.rows(PROMPTS[0])).blocks == [1]  # lowest first
    tables = [loaded(pool, reference.rows([9] * 20)), loaded(pool, reference.rows(PROMPTS[2]))]
    logits = step(lm, pool, tables, torch.tensor([4, 5]))
    assert_close(logits, reference.next_logits([*[9] * 20, 4], [*PROMPTS[2], 5]))
    storage[:, tables[0].blocks] = float("nan")
    pool.clear()  # as decode's drain does after a failed step, with the tables still held
    assert pool.storage is storage and len(pool) == 0 and pool.free_blocks == 4
    assert (storage == 0).all() and tables[0].blocks == []
    again = loaded(pool, reference.rows(PROMPTS[1]))
    assert_equal(again.rows(), reference.rows(PROMPTS[1]))
    pool.release(again)
    assert pool.storage is storage  # kept, though nothing is held


@torch.inference_mode()
def test_a_kept_copy_serves_until_the_batch_changes_or_outgrows_it(lm, reference):
    reader = KeepGathered()
    pool = pool_for(lm)
    running = [Request(pool, reference, p) for p in PROMPTS[:3]]
    requests = list(running)
    copies = []
    for n in range(60):  # past a copy's room at least once
        if n == 5:  # one leaves
            pool.release(running.pop(1).table)
        if n == 9:  # one joins
            running.append(Request(pool, reference, PROMPTS[3]))
            requests.append(running[-1])
        decode(lm, pool, running, 3 + n, reader)
        copies.append(reader.kept)
    reference.prefill(*(request.ids for request in requests))
    for request in requests:
        request.check(reference)
    made = [i for i, kept in enumerate(copies) if i == 0 or kept is not copies[i - 1]]
    # made at the start, when one left, when one joined, and when the longest outgrew its room:
    # it joined with 20 rows, into a copy of blocks_for(21) + HEADROOM_BLOCKS blocks
    room = (2 + HEADROOM_BLOCKS) * BLOCK_TOKENS
    assert made == [0, 5, 9, 9 + room - 20], made
    assert all(kept is not None for kept in copies)
    kept, tables = reader.kept, [request.table for request in running]
    assert kept.serves(tables, [1] * len(tables))  # it took the last step's rows, as the blocks did
    assert not kept.serves(tables[1:], [1] * 2) and not kept.serves(tables[::-1], [1] * 3)
    tables[0].length -= 1  # another length than the copy's
    assert not kept.serves(tables, [1] * len(tables))
    reader.forget()
    assert reader.kept is None


@torch.inference_mode()
def test_no_copy_is_kept_that_would_take_more_than_the_budget(lm, reference):
    pool = pool_for(lm, max_tokens=8 * BLOCK_TOKENS)
    tables = [loaded(pool, reference.rows(p)) for p in PROMPTS]
    # 5 blocks in use of 8; a copy needs 2 + HEADROOM_BLOCKS for the longest, 1 + HEADROOM_BLOCKS
    # for each of the others (one part)
    assert Gathered.nbytes_for(tables, pool.storage, [1] * len(tables)) > pool.max_bytes
    reader = KeepGathered()
    batch = reader.batch(pool.storage, tables, pool.max_bytes)
    assert not isinstance(batch, KeptBatch) and reader.kept is None  # step by step
    logits = lm.logits(lm.decode(torch.tensor([4] * len(tables)), batch))
    assert_close(logits, reference.next_logits(*([*p, 4] for p in PROMPTS)))
    assert isinstance(reader.batch(pool.storage, tables, 2 * pool.max_bytes), KeptBatch)


@torch.inference_mode()
def test_a_match_shares_the_cached_blocks_and_copies_nothing(lm, reference):
    pool = pool_for(lm, max_tokens=4 * BLOCK_TOKENS)
    first = loaded(pool, reference.rows(IDS))  # 40 rows and its next: 3 blocks
    pool.publish(first, HASHES, IDS)
    storage = pool.storage
    assert not pool.can_admit(len(IDS))  # 3 blocks, 1 free
    second = pool.match(HASHES)
    shared = 2 * BLOCK_TOKENS
    assert second.blocks == first.blocks[:2] and second.length == shared
    assert [pool.blocks.refs[b] for b in first.blocks] == [2, 2, 1]
    assert pool.storage is storage and pool.used_blocks == 3  # no block taken, nothing copied
    assert pool.can_admit(len(IDS), shared=shared)  # its last block and next row: 1 block
    assert not pool.can_admit(len(IDS), shared=shared, running=1)
    # the rest of its prompt prefilled after the shared rows (a chunk), then a step each
    rest = lm.prefill(lm.embed(torch.tensor(IDS[shared:])), pasts=[second])[1]
    pool.write(second, rest)
    assert pool.used_blocks == 4 and second.blocks[2] != first.blocks[2]
    logits = step(lm, pool, [first, second], torch.tensor([4, 5]))
    assert_close(logits, reference.next_logits([*IDS, 4], [*IDS, 5]))
    pool.release(first)
    assert [pool.blocks.refs[b] for b in second.blocks] == [1, 1, 1]


@torch.inference_mode()
def test_shared_tables_hold_the_same_blocks_and_grow_apart(lm, reference):
    pool = pool_for(lm)
    prompt = IDS[: 2 * BLOCK_TOKENS]
    reference.prefill(prompt, [*prompt, 4], [*prompt, 5])
    table = pool.table()
    pool.write(table, reference.rows(prompt))
    other = pool.share(table)
    assert other.blocks == table.blocks and other.blocks is not table.blocks
    assert other.length == table.length and len(pool) == 2 and pool.used_blocks == 2
    assert all(pool.blocks.refs[b] == 2 for b in table.blocks)
    logits = step(lm, pool, [table, other], torch.tensor([4, 5]))
    assert table.blocks[:2] == other.blocks[:2] and table.blocks[2] != other.blocks[2]
    assert_close(logits, reference.next_logits([*prompt, 4], [*prompt, 5]))
    pool.release(table)
    pool.release(table)  # again (a drain after a leave): its holds are let go once
    assert [pool.blocks.refs[b] for b in other.blocks] == [1, 1, 1]
    assert_close(other.rows(), reference.rows([*prompt, 5]))
    with pytest.raises(AssertionError, match="whole blocks"):
        pool.share(other)  # 33 rows


@torch.inference_mode()
def test_published_blocks_stay_cached_after_release_for_a_later_match(lm, reference):
    heard = Heard()
    pool = pool_for(lm, events=heard)
    table = loaded(pool, reference.rows(IDS))
    pool.publish(table, HASHES, IDS)
    pool.publish(table, HASHES, IDS)  # again: nothing new to tell
    assert heard.told == [
        ("stored", [HASHES[0]], None, IDS[:BLOCK_TOKENS], BLOCK_TOKENS),
        ("stored", [HASHES[1]], HASHES[0], IDS[BLOCK_TOKENS : 2 * BLOCK_TOKENS], BLOCK_TOKENS),
    ]
    blocks, before = list(table.blocks), table.rows()
    pool.release(table)
    assert len(pool) == 0 and pool.blocks.cached == 2 and pool.used_blocks == 0
    again = pool.match([*HASHES, b"not cached"])
    shared = 2 * BLOCK_TOKENS
    assert again.blocks == blocks[:2] and again.length == shared
    assert_equal(again.rows(), before[:, :shared])
    logits = step(lm, pool, [again], torch.tensor([IDS[shared]]))
    assert_close(logits, reference.logits(IDS)[shared : shared + 1])


@torch.inference_mode()
def test_a_publish_covers_only_the_full_blocks_it_has_hashes_for(lm, reference):
    pool = pool_for(lm)
    table = loaded(pool, reference.rows(IDS)[:, :20])  # one full block, one part
    pool.publish(table, HASHES, IDS)
    assert table.published == 1 and pool.blocks.cached == 1
    pool.write(table, reference.rows(IDS)[:, 20:])
    pool.publish(table, HASHES[:1], IDS)  # only the first's hash known
    assert table.published == 1
    pool.publish(table, HASHES, IDS)
    assert table.published == 2 and pool.blocks.cached == 2


@torch.inference_mode()
def test_cached_blocks_are_free_space_and_make_no_request_wait(lm, reference):
    heard = Heard()
    pool = pool_for(lm, max_tokens=4 * BLOCK_TOKENS, events=heard)
    table = loaded(pool, reference.rows(IDS))  # 3 blocks
    pool.publish(table, HASHES, IDS)
    assert pool.free_blocks == 1 and pool.used_blocks == 3
    pool.release(table)
    assert pool.blocks.cached == 2 and pool.free_blocks == 4 and pool.used_blocks == 0
    other = [9] * (4 * BLOCK_TOKENS - 1)
    assert pool.can_admit(len(other))  # every block, the cached ones too
    newcomer = loaded(pool, reference.rows(other))  # 63 rows and its next: all 4 blocks
    assert len(newcomer.blocks) == 4 and pool.free_blocks == 0
    assert pool.blocks.cached == 0
    assert heard.told[-1] == ("removed", [HASHES[1], HASHES[0]])  # the later block first
    assert_equal(newcomer.rows(), reference.rows(other))
    assert pool.match(HASHES).blocks == []


@torch.inference_mode()
def test_max_cached_tokens_bounds_what_stays_cached_and_zero_publishes_nothing(lm, reference):
    heard = Heard()
    pool = pool_for(lm, events=heard, max_cached_tokens=0)
    table = loaded(pool, reference.rows(IDS))
    pool.publish(table, HASHES, IDS)
    assert heard.told == [] and pool.blocks.cached == 0 and table.published == 0
    pool.release(table)
    assert pool.storage.shape[1] == 1  # nothing cached: the memory goes back
    assert pool.match(HASHES).length == 0
    one = pool_for(lm, events=heard, max_cached_tokens=BLOCK_TOKENS)
    table = loaded(one, reference.rows(IDS))
    one.publish(table, HASHES, IDS)
    one.release(table)
    assert one.blocks.cached == 1 and heard.told[-1] == ("removed", [HASHES[1]])
    assert one.match(HASHES).length == BLOCK_TOKENS  # the prefix outlives its later block


@torch.inference_mode()
def test_drop_cached_gives_back_the_storage_past_the_last_held_block(lm, reference):
    heard = Heard()
    pool = pool_for(lm, events=heard)
    table = loaded(pool, reference.rows(IDS))  # blocks 1-3
    held = loaded(pool, reference.rows(PROMPTS[0]))  # block 4, in a storage grown to 8
    pool.publish(table, HASHES, IDS)
    pool.release(table)
    assert held.blocks == [4] and pool.storage.shape[1] == 8 and pool.blocks.cached == 2
    before = held.rows()
    assert pool.drop_cached() == 3 * pool.bytes_per_block  # blocks 5-7
    assert pool.storage.shape[1] == 5 and pool.blocks.cached == 0
    assert heard.told[-1] == ("removed", [HASHES[1], HASHES[0]])
    assert pool.free_blocks == pool.max_blocks - 2 and pool.used_blocks == 1
    assert_equal(held.rows(), before)
    assert loaded(pool, reference.rows(IDS)).blocks == [1, 2, 3]  # the free ones below it
    assert pool.storage.shape[1] == 5
    logits = step(lm, pool, [held], torch.tensor([IDS[0]]))
    assert_close(logits, reference.next_logits([*PROMPTS[0], IDS[0]]))


@torch.inference_mode()
def test_rows_from_a_start_and_one_layers_rows_are_the_tables_rows(lm, reference):
    expected = reference.rows(IDS)
    table = loaded(pool_for(lm), expected)
    for start in (0, 5, BLOCK_TOKENS, 20, 2 * BLOCK_TOKENS, len(IDS)):
        assert_equal(table.rows(start), expected[:, start:])
    for index in range(lm.config.num_hidden_layers):
        assert_equal(table.layer(index), expected[index])


@torch.inference_mode()
def test_a_write_appends_into_the_partly_filled_last_block_first(lm, reference):
    pool = pool_for(lm)
    whole = reference.rows(IDS)
    table = pool.table()
    pool.write(table, whole[:, :10])
    (first,) = table.blocks
    # the next chunk, prefilled after the rows written: a chunked prefill
    rows = lm.prefill(lm.embed(torch.tensor(IDS[10:20])), pasts=[table])[1]
    assert_close(rows, whole[:, 10:20])
    pool.write(table, rows)
    assert table.blocks[0] == first and len(table.blocks) == 2 and table.length == 20
    pool.write(table, whole[:, 20 : 2 * BLOCK_TOKENS])  # fills the second block exactly
    assert len(table.blocks) == 2 and table.length == 2 * BLOCK_TOKENS
    assert_close(table.rows(), whole[:, : 2 * BLOCK_TOKENS])
    pool.make_room(table)
    assert len(table.blocks) == 3


@torch.inference_mode()
def test_writing_no_rows_into_an_empty_table_changes_nothing(lm):
    pool = pool_for(lm)
    table = pool.table()
    pool.write(table, torch.zeros(lm.config.num_hidden_layers, 0, lm.config.latent_dim))
    assert table.blocks == [] and table.length == 0


@pytest.mark.parametrize("reader", [GatherEachStep, KeepGathered])
@torch.inference_mode()
def test_steps_of_several_rows_equal_prefill_and_roll_back_what_is_refused(lm, reference, reader):
    """Speculative decoding's steps: each request feeds 1-4 rows at once (its last token and
    drafts), each row's logits are the whole sequence's at its place, and the rows refused
    after the step leave the pool: the table ends where its accepted tokens do, its blocks
    with it, and the refused rows left in its last block are zeros."""
    reader = reader()
    pool = pool_for(lm)
    running = [Request(pool, reference, p) for p in (PROMPTS[0], PROMPTS[2], [9] * 40)]
    rng = random.Random(0)
    copies = []
    for n in range(14):
        counts = [rng.randint(1, 4) for _ in running]
        fed = [[(11 * n + 3 * i + j) % 400 + 5 for j in range(c)] for i, c in enumerate(counts)]
        tables = [request.table for request in running]
        for table, count in zip(tables, counts, strict=True):
            pool.make_room(table, count)
        batch = reader.batch(pool.storage, tables, pool.max_bytes, counts)
        logits = lm.logits(lm.decode(torch.tensor([t for own in fed for t in own]), batch))
        kept = [rng.randint(1, c) for c in counts]
        batch.keep(kept)
        copies.append(getattr(reader, "kept", None))
        for request, own, rows, keep in zip(running, fed, logits.split(counts), kept, strict=True):
            assert_close(rows, reference.logits(request.ids + own)[len(request.ids) :])
            request.ids += own[:keep]
    for request in running:
        table, length = request.table, len(request.ids)
        assert table.length == length and len(table.blocks) == -(-length // BLOCK_TOKENS)
        assert_close(table.rows(), reference.rows(request.ids))
        if length % BLOCK_TOKENS:
            assert not pool.storage[:, table.blocks[-1], length % BLOCK_TOKENS :].any()
    if isinstance(reader, KeepGathered):  # the copy took the steps' rows and roll-backs
        assert len({id(kept) for kept in copies}) < len(copies) / 2


def test_a_step_of_several_rows_per_request_sees_each_rows_own_past(lm):
    """The query rows of a step of 2 and 1 rows (padded to 2: the scratch row R = 3) see
    their caches' rows up to their own place, a padding row its cache's last."""
    pool = pool_for(lm)
    tables = [
        loaded(pool, torch.zeros(lm.config.num_hidden_layers, n, lm.config.latent_dim))
        for n in (3, 5)
    ]
    for table in tables:
        pool.make_room(table, 2)
    batch = GatherEachStep().batch(pool.storage, tables, pool.max_bytes, [2, 1])
    assert batch.positions.tolist() == [3, 4, 5]
    ((rows, _, visible),) = batch.tables
    assert rows.tolist() == [[0, 1], [2, 3]]
    assert visible.sum(-1).tolist() == [[4, 5], [6, 6]]
