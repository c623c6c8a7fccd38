"""Per-request token sampling: greedy, temperature, top-k, top-p, seeded.

Each request owns a CPU `torch.Generator`; its state travels from prefill to decode with the
KV hand-off, so a seeded request draws the same tokens whichever process samples them.
"""

from __future__ import annotations

import secrets

import torch
from transformers import PreTrainedTokenizerBase

from epd.checkpoint.tokenizer import decode_text
from epd.generation.params import MIN_LOGPROB, SamplingParams, TokenLogprob, TopLogprob

# Below this temperature sampling is greedy: dividing by a tinier one can overflow float32
# logits to inf, whose softmax is NaN (vLLM draws the same line).
GREEDY_BELOW = 1e-5


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def restore_generator(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state.clone())
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from a float32 logits row (vocab,)."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    logits = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        probs = ordered.softmax(-1)
        # Drop a token once the tokens ranked above it already cover top_p.
        outside = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order, ordered.masked_fill(outside, float("-inf")))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def token_logprob(
    logits: torch.Tensor, token: int, top: int, tokenizer: PreTrainedTokenizerBase
) -> TokenLogprob:
    """The model's log-probability of `token` and of its `top` likeliest alternatives.

    Values are kept within [MIN_LOGPROB, 0], so they stay finite JSON numbers.
    """
    logprobs = logits.float().log_softmax(-1).cpu().clamp(MIN_LOGPROB, 0.0)
    alternatives = []
    if top:
        best = logprobs.topk(top)
        for value, index in zip(best.values.tolist(), best.indices.tolist(), strict=True):
            piece = decode_text(tokenizer, [index])
            alternatives.append(TopLogprob(piece, value, tuple(piece.encode())))
    piece = decode_text(tokenizer, [token])
    return TokenLogprob(piece, float(logprobs[token]), tuple(piece.encode()), tuple(alternatives))
