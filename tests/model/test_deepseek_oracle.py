"""The language model against transformers' DeepseekV3ForCausalLM on the same weights."""

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from epd.checkpoint.export import export_language_model
from epd.checkpoint.weights import load_model
from epd.model.config import TextConfig
from epd.model.latent_cache import LatentCache
from epd.model.mla import MLAttention


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
    hidden, cache = ours.prefill(ours.embed(PROMPT))
    expected = oracle(PROMPT[None]).logits[0]
    assert rel_err(ours.logits(hidden), expected) <= 1e-4
    layers, tokens, width = cache.tensor().shape
    config = ours.config
    assert (layers, tokens, width) == (config.num_hidden_layers, len(PROMPT), config.latent_dim)


@torch.inference_mode()
def test_decode_from_latent_cache_matches_transformers(pair):
    ours, oracle = pair
    _, cache = ours.prefill(ours.embed(PROMPT[:6]))
    ids = PROMPT[:6].tolist()
    for step, token in enumerate(PROMPT[6:].tolist()):
        if step == 3:  # ship the cache through bytes, as prefill → decode will
            raw = cache.tensor().contiguous().numpy().tobytes()
            shape = cache.tensor().shape
            restored = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(shape)
            cache = LatentCache.from_tensor(restored)
        ids.append(token)
        ours_logits = ours.logits(ours.decode(torch.tensor([token]), [cache]))[0]
        expected = oracle(torch.tensor([ids])).logits[0, -1]
        assert rel_err(ours_logits, expected) <= 1e-4, f"step {step}"
    assert cache.length == len(PROMPT)


@torch.inference_mode()
def test_batched_decode_equals_each_request_alone(pair):
    ours, _ = pair
    prompts = [PROMPT[:4], PROMPT[:9], PROMPT[2:11]]
    caches = [ours.prefill(ours.embed(p))[1] for p in prompts]
    alone = [ours.prefill(ours.embed(p))[1] for p in prompts]
    tokens = torch.tensor([8, 9, 10])
    together = ours.logits(ours.decode(tokens, caches))
    for i, cache in enumerate(alone):
        single = ours.logits(ours.decode(tokens[i : i + 1], [cache]))[0]
        torch.testing.assert_close(together[i], single, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[i].tensor(), cache.tensor())


@torch.inference_mode()
def test_packed_prompts_equal_each_prompt_alone(pair):
    ours, _ = pair
    prompts = [PROMPT[:5], PROMPT[3:12], PROMPT[:2]]
    lengths = [len(p) for p in prompts]
    hidden, cache = ours.prefill(ours.embed(torch.cat(prompts)), lengths)
    for piece, part, prompt in zip(
        hidden.split(lengths), cache.split(lengths), prompts, strict=True
    ):
        alone_hidden, alone_cache = ours.prefill(ours.embed(prompt))
        torch.testing.assert_close(piece, alone_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(part.tensor(), alone_cache.tensor(), rtol=1e-5, atol=1e-5)


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
    caches: list[LatentCache | None] = [None, None]
    hidden: list[list[torch.Tensor]] = [[], []]
    for step in range(4):
        taking = [i for i in range(2) if chunks[i][step] is not None]
        pieces = [prompts[i][slice(*chunks[i][step])] for i in taking]
        lengths = [len(piece) for piece in pieces]
        out, rows = ours.prefill(
            ours.embed(torch.cat(pieces)), lengths, [caches[i] for i in taking]
        )
        for i, h, part in zip(taking, out.split(lengths), rows.split(lengths), strict=True):
            hidden[i].append(h)
            if caches[i] is None:
                caches[i] = LatentCache.from_tensor(part.tensor().clone())
            else:
                caches[i].extend(part.tensor())
    for prompt, h, cache in zip(prompts, hidden, caches, strict=True):
        whole_hidden, whole_cache = ours.prefill(ours.embed(prompt))
        torch.testing.assert_close(torch.cat(h), whole_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.tensor(), whole_cache.tensor(), rtol=1e-5, atol=1e-5)
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
