"""vLLM's side of `scripts/bench_forward.py`: its engine's prefill and decode times, in process.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_MLA_DISABLE=1 \
        /work/vllm/venv/bin/python scripts/vllm/forward.py COPY [--profile DIR]

Runs in vLLM's own virtual environment (imports nothing of epd's) on the copy of a checkpoint
that `setup.sh` makes. Prints one JSON object, in milliseconds: `prefill` per prompt length
(the best of 5 one-token generations, so it holds vLLM's step overhead as well as its forward)
and `decode` per batch size (one output token's time: a 65-token generation's time less a
1-token one's, over 64, the median of 3); `cached` the best of 5 one-token generations of
CACHED_NEW new tokens after a CACHED_PAST-token prefix that its prefix cache holds (the next
turn of a conversation; asserted from its output's cached token count). Prompts are random, so
no other prompt hits the cache. With --profile, torch's profiler records one 240-token prompt
and 64 decode steps and vLLM writes its op table into DIR.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

PROMPT_LENGTHS = (240, 1024)
BATCHES = (1, 16)
DECODE_PROMPT = 240
CACHED_PAST, CACHED_NEW = 2304, 176  # whole blocks of 16 and of 128 tokens: both sides hit all


def main() -> None:
    from vllm import LLM, SamplingParams  # vLLM's venv only

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--profile", help="a directory for vLLM's torch profile")
    args = parser.parse_args()
    extra: dict[str, Any] = {}
    if args.profile:
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": args.profile}
    llm = LLM(
        model=args.checkpoint,
        dtype="float32",
        trust_remote_code=True,
        max_model_len=4096,
        enable_prefix_caching=True,
        **extra,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)

    def prompts(count: int, length: int) -> list[Any]:
        return [
            {"prompt_token_ids": [rng.randrange(1, vocab - 16) for _ in range(length)]}
            for _ in range(count)
        ]

    def timed(batch: list[Any], tokens: int) -> tuple[float, list[Any]]:
        """The seconds to generate `tokens` for each prompt of the batch, and the outputs."""
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    def seconds(count: int, length: int, tokens: int) -> float:
        return timed(prompts(count, length), tokens)[0]

    def after_past(past: list[int]) -> float:
        """One token for a prompt that starts with `past`, which the prefix cache holds."""
        new = prompts(1, CACHED_NEW)[0]["prompt_token_ids"]
        took, (output,) = timed([{"prompt_token_ids": past + new}], 1)
        assert output.num_cached_tokens == CACHED_PAST, output.num_cached_tokens
        return took

    seconds(1, DECODE_PROMPT, 8)  # warm-up
    (past,) = prompts(1, CACHED_PAST)
    timed([past], 1)  # now in its prefix cache
    cached = min(after_past(past["prompt_token_ids"]) for _ in range(5))
    prefill = {n: min(seconds(1, n, 1) for _ in range(5)) for n in PROMPT_LENGTHS}
    decode = {
        b: statistics.median(
            (seconds(b, DECODE_PROMPT, 65) - seconds(b, DECODE_PROMPT, 1)) / 64 for _ in range(3)
        )
        for b in BATCHES
    }
    if args.profile:
        llm.start_profile()
        seconds(1, DECODE_PROMPT, 65)
        llm.stop_profile()
    print(
        json.dumps(
            {
                "prefill": {n: round(s * 1e3, 2) for n, s in prefill.items()},
                "decode": {b: round(s * 1e3, 2) for b, s in decode.items()},
                "cached": {CACHED_NEW: round(cached * 1e3, 2)},
            }
        )
    )


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
