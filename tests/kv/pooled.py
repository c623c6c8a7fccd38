"""Decode steps over a `BlockPool` in tests, as decode's scheduler runs them."""

import torch

from epd.kv.pool import BlockPool, BlockTable
from epd.model.paged import BlockReader, GatherEachStep


def pool_for(lm, max_tokens: int = 4096, **options) -> BlockPool:
    """A pool for this model's rows, on its device and in its dtype."""
    config, weight = lm.config, lm.lm_head.weight
    return BlockPool(
        config.num_hidden_layers,
        config.latent_dim,
        weight.device,
        weight.dtype,
        max_tokens,
        **options,
    )


def loaded(pool: BlockPool, rows: torch.Tensor) -> BlockTable:
    """A table holding rows (layers, tokens, latent), with room for a step's row."""
    table = pool.table()
    pool.write(table, rows)
    pool.make_room(table)
    return table


def step(
    lm,
    pool: BlockPool,
    tables: list[BlockTable],
    tokens: torch.Tensor,
    reader: BlockReader | None = None,
) -> torch.Tensor:
    """One decode step of each table's request → logits (B, vocab); each table grows a row."""
    for table in tables:
        pool.make_room(table)
    batch = (reader or GatherEachStep()).batch(pool.storage, tables, pool.max_bytes)
    return lm.logits(lm.decode(tokens, batch))
