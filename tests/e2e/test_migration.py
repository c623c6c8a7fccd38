"""A decoder killed or stopped under load: its streams move to the other decoder and go on token
for token (request migration), with the prefix cache on or off. With no decoder left they end
with an error event at once: tests/e2e/test_failures.py."""

import itertools
import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .stack import free_fleet_base, health, serve, timed_stream

TOKENS = 128


def ask(index: int) -> dict:
    """Eight requests: greedy ones, and seeded sampled ones (their generator moves with them)."""
    sampled = index % 4 == 3
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Tell me story number {index}."}],
        "max_tokens": TOKENS,
        "temperature": 0.9 if sampled else 0.0,
        "seed": 1000 + index if sampled else None,
        "extra_body": {"ignore_eos": True},
    }


def migrated(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    found = re.search(r'^epd:migrations_total\{[^}]*outcome="resumed"[^}]*\} (\S+)', text, re.M)
    return float(found[1]) if found else 0.0


# Drafts from a single token on: a random-weight reply still meets some.
SPECULATIVE = (
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
)


@pytest.mark.parametrize(
    ("how", "caching", "more"),
    [
        (signal.SIGKILL, "--enable-prefix-caching", ()),
        (signal.SIGKILL, "--no-enable-prefix-caching", SPECULATIVE),
        (signal.SIGSTOP, "--enable-prefix-caching", ()),
    ],
    ids=["killed", "killed-no-cache-speculating", "stopped"],
)
def test_streams_of_a_lost_decoder_go_on_on_the_other_token_for_token(
    tiny_checkpoint, how, caching, more
):
    """A decoder killed, or stopped (it answers no heartbeat: lost after the heartbeat
    timeout) and woken once its streams have moved: what it sends then is for requests it no
    longer holds, and changes no stream. Without a prefix cache the reply so far is prefilled
    with its whole prompt again. Where the decoders verify n-gram drafts, a greedy stream
    moved mid-reply is still its undisturbed self; a seeded sampled one is not compared, as
    its draws depend on where drafts were (README, speculative decoding)."""
    base = free_fleet_base()
    flags = ("--decoders", "2", "--served-model-name", "tiny", caching, *more)
    stack = serve(tiny_checkpoint, base, *flags)
    pid = 0
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-")
        undisturbed = [
            api.chat.completions.create(**ask(i)).choices[0].message.content for i in range(8)
        ]
        going = threading.Semaphore(0)
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(timed_stream, api, ask(i), going, 10) for i in range(8)]
            for _ in streams:
                assert going.acquire(timeout=60), "a stream did not get under way"
            _, decoder = health(base + 12)
            pid, lost_at = decoder["pid"], time.monotonic()
            os.kill(pid, how)
            if how == signal.SIGSTOP:
                deadline = time.monotonic() + 30
                while not migrated(base + 20):
                    assert time.monotonic() < deadline, "no stream left the stopped decoder"
                    time.sleep(0.05)
                os.kill(pid, signal.SIGCONT)  # while the moved streams run on the other
            results = [s.result(timeout=120) for s in streams]
        for i, text in enumerate(r.text for r in results):
            if not (more and ask(i)["temperature"]):
                assert text == undisturbed[i], f"stream {i} differs from its undisturbed run"
        if more:  # the decoder left verified drafts, the moved streams' too
            assert health(base + 112)[1]["speculative"]["accepted_tokens"] > 0
        moved = migrated(base + 20)
        assert moved >= 1, "no stream was on the lost decoder"
        gaps = [b - a for r in results for a, b in itertools.pairwise(r.times) if b > lost_at]
        print(f"{moved:.0f} of 8 streams moved; longest gap after the loss: {max(gaps):.2f} s")
        assert max(gaps) < (10.0 if how == signal.SIGKILL else 15.0)
    finally:
        if pid and how == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
        assert stack.stop() == 0, stack.output
