"""The language model against transformers' DeepseekV3ForCausalLM on the same weights."""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from epd.checkpoint.export import export_language_model
from epd.checkpoint.weights import load_model
from epd.model.config import TextConfig
from epd.model.mla import MLAttention
from tests.kv.pooled import loaded, pool_for, step


@pytest.fixture(scope="module", params=["tiny_checkpoint", "tiny_q_lora_checkpoint"])
def pair(request, tmp_path_factory):
    kimi = request.getfixturevalue(request.param)
    oracle_dir = export_language_model(kimi, tmp_path_factory.mktemp("ds") / "ckpt")
    oracle = DeepseekV3ForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32)
    oracle.config._attn_implementation = "eager"
    ours = load_model(kimi, role="language").language_model
    return ours, oracle.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


PROMPT = torch.tensor([5, 17, 42, 99, 7, 300, 12, 64, 128, 3, 250, 77, 31])


@torch.inference_mode()
def test_prefill_logits_match_transformers(pair):
    ours, oracle = pair
    hidden, rows = ours.prefill(ours.embed(PROMPT))
    expected = oracle(PROMPT[None]).logits[0]
    assert rel_err(ours.logits(hidden), expected) <= 1e-4
    layers, tokens, width = rows.shape
    config = ours.config
    assert (layers, tokens, width) == (config.num_hidden_layers, len(PROMPT), config.latent_dim)


@torch.inference_mode()
def test_decode_from_pooled_blocks_matches_transformers(pair):
    ours, oracle = pair
    pool = pool_for(ours)
    _, rows = ours.prefill(ours.embed(PROMPT[:6]))
    table = loaded(pool, rows)
    ids = PROMPT[:6].tolist()
    for index, token in enumerate(PROMPT[6:].tolist()):
        if index == 3:  # ship the rows through bytes, as prefill → decode does
            sent = table.rows().contiguous()
            restored = torch.frombuffer(bytearray(sent.numpy().tobytes()), dtype=torch.float32)
            pool.release(table)
            table = loaded(pool, restored.view(sent.shape))
        ids.append(token)
        ours_logits = step(ours, pool, [table], torch.tensor([token]))[0]
        expected = oracle(torch.tensor([ids])).logits[0, -1]
        assert rel_err(ours_logits, expected) <= 1e-4, f"step {index}"
    assert table.length == len(PROMPT)


@torch.inference_mode()
def test_batched_decode_equals_each_request_alone(pair):
    ours, _ = pair
    prompts = [PROMPT[:4], PROMPT[:9], PROMPT[2:11]]
    pool = pool_for(ours)
    tables = [loaded(pool, ours.prefill(ours.embed(p))[1]) for p in prompts]
    alone = [loaded(pool, ours.prefill(ours.embed(p))[1]) for p in prompts]
    tokens = torch.tensor([8, 9, 10])
    together = step(ours, pool, tables, tokens)
    for i, table in enumerate(alone):
        single = step(ours, pool, [table], tokens[i : i + 1])[0]
        torch.testing.assert_close(together[i], single, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tables[i].rows(), table.rows())


@torch.inference_mode()
def test_packed_prompts_equal_each_prompt_alone(pair):
    ours, _ = pair
    prompts = [PROMPT[:5], PROMPT[3:12], PROMPT[:2]]
    lengths = [len(p) for p in prompts]
    hidden, rows = ours.prefill(ours.embed(torch.cat(prompts)), lengths)
    for piece, part, prompt in zip(
        hidden.split(lengths), rows.split(lengths, dim=1), prompts, strict=True
    ):
        alone_hidden, alone_rows = ours.prefill(ours.embed(prompt))
        torch.testing.assert_close(piece, alone_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(part, alone_rows, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("absorbed", [True, False], ids=["through-latent", "expanded"])
@torch.inference_mode()
def test_prompts_prefilled_in_chunks_equal_them_prefilled_whole(pair, absorbed, monkeypatch):
    """Chunked prefill: each chunk starts where its prompt's cache ends and attends to it, packed
    with another prompt's chunk; the last chunk's logits match transformers on the whole prompt.
    Either way a chunk may attend to its past: through the latent or with it expanded."""
    monkeypatch.setattr(MLAttention, "absorbs", lambda self, new, total: absorbed)
    ours, oracle = pair
    prompts = [PROMPT, PROMPT[2:9]]
    # Each step's chunk per prompt; the second starts fresh beside the first's continuation.
    chunks = [[(0, 4), (4, 5), (5, 11), (11, 13)], [None, (0, 3), (3, 4), (4, 7)]]
    pool = pool_for(ours)
    tables = [pool.table(), pool.table()]
    hidden: list[list[torch.Tensor]] = [[], []]
    for turn in range(4):
        taking = [i for i in range(2) if chunks[i][turn] is not None]
        pieces = [prompts[i][slice(*chunks[i][turn])] for i in taking]
        lengths = [len(piece) for piece in pieces]
        out, rows = ours.prefill(
            ours.embed(torch.cat(pieces)), lengths, [tables[i] for i in taking]
        )
        split = zip(taking, out.split(lengths), rows.split(lengths, dim=1), strict=True)
        for i, h, part in split:
            hidden[i].append(h)
            pool.write(tables[i], part)  # the next chunk reads its past from the blocks
    for prompt, h, table in zip(prompts, hidden, tables, strict=True):
        whole_hidden, whole_rows = ours.prefill(ours.embed(prompt))
        torch.testing.assert_close(torch.cat(h), whole_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(table.rows(), whole_rows, rtol=1e-5, atol=1e-5)
    expected = oracle(PROMPT[None]).logits[0, -1]
    assert rel_err(ours.logits(hidden[0][-1][-1]), expected) <= 1e-4


def test_a_chunk_attends_through_the_latent_while_that_is_cheaper():
    """Kimi-VL-A3B's attention (rank 512, rope 64, nope 128, v 128): after a long past, chunks
    of up to 170 tokens take the latent (1088 multiply-adds per head, query and row, against
    320 and each row's 512 x 256 to expand it); after a short past, expanding it is cheaper."""
    config = TextConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )
    attention = MLAttention(config, layer=0)
    past = 100_000
    assert attention.absorbs(1, past + 1) and attention.absorbs(170, past + 170)
    assert not attention.absorbs(171, past + 171) and not attention.absorbs(4096, past + 4096)
    assert attention.absorbs(100, 1000 + 100) and not attention.absorbs(100, 5 + 100)
