"""`epd serve --prefills 2`: the router in front, as real processes. Each conversation's turns
go to the prefill that holds its blocks (its KV events say so), every prefill knows what every
decoder holds (the decoders' KV events say so), the router imports no torch, and
a prefill killed mid-stream costs only its own streams, each ended by an error event at once."""

import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from .stack import DRAINED, free_fleet_base, health, serve, timed_stream

# A long greedy stream (still under way when its prefill is killed).
LONG = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "count"}],
    "max_tokens": DRAINED,
    "extra_body": {"ignore_eos": True},
}
FLEET = ("--prefills", "2", "--decoders", "2", "--encoders", "2", "--served-model-name", "tiny")


def client(base: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-", max_retries=0)


def prefill_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)


def reused(port: int) -> float:
    """Prompt tokens a prefill's hand-offs left out as held by their decoder (its /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    found = re.search(r"^epd:kv_handoff_reused_tokens_total\{[^}]*\} (\S+)", text, re.M)
    return float(found[1]) if found else 0.0


def routed(base: int) -> dict[tuple[str, str], float]:
    """The router's requests by (prefill, reason), from its /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{base + 20}/metrics").read().decode()
    pattern = r'^epd:router_requests_total\{[^}]*prefill="([^"]+)",reason="([^"]+)"[^}]*\} (\S+)'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.M)}


def test_a_fleet_keeps_conversations_where_their_blocks_are_and_outlives_a_prefill(
    tiny_checkpoint,
):
    """One fleet, in order: each conversation's turns go to the prefill that holds its blocks
    (its KV events say so) and the router holds no torch; then a prefill killed under four
    streams ends its own streams at once, and no request after it fails."""
    base = free_fleet_base()
    stack = serve(tiny_checkpoint, base, *FLEET)
    try:
        deadline = time.monotonic() + 30  # a prefill is chosen once its /health says ok
        while not all(p["up"] for p in health(base + 20)[1].get("prefills", {}).values()):
            assert time.monotonic() < deadline, "the router never saw both prefills up"
            time.sleep(0.2)
        api = client(base)
        conversations = [
            # Different from the first block on: nothing of one is cached for another.
            [{"role": "system", "content": f"{i} {i} {i} {i} You are assistant {i}. " * 20}]
            for i in range(4)
        ]
        cached: list[tuple[int, int]] = []  # (the turn before's prompt tokens, cached now)
        before = [0] * len(conversations)
        for turn in range(3):
            for i, messages in enumerate(conversations):
                messages.append({"role": "user", "content": f"Question {turn}?"})
                reply = api.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=4, temperature=0
                )
                usage = reply.usage
                if turn:
                    cached.append((before[i], usage.prompt_tokens_details.cached_tokens))
                before[i] = usage.prompt_tokens
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        # Every later turn found its conversation's blocks: all of the turn before's full
        # blocks, less at most the last (its final tokens are in no full block).
        assert all(hit >= prompt - 2 * 16 for prompt, hit in cached), cached
        by_prefill: dict[str, float] = {}
        for (prefill, reason), count in routed(base).items():
            by_prefill[prefill] = by_prefill.get(prefill, 0) + count
            assert reason in ("cache_hit", "load")
        assert len(by_prefill) == 2 and sum(by_prefill.values()) == 12  # both had work
        status, body = health(base + 20)
        assert status == 200
        assert {p["followed"] for p in body["prefills"].values()} == {"events"}
        # A prompt handed to a decoder by one prefill is known to the other from that decoder's
        # KV events: its hand-off of a longer prompt carries only the rows after it.
        shared = [{"role": "user", "content": "Shared words for both prefills. " * 30}]
        prefills = [prefill_client(base + 21), prefill_client(base + 121)]
        kept = {"model": "tiny", "max_tokens": 2, "extra_body": {"ignore_eos": True}}  # handed off
        prefills[0].chat.completions.create(messages=shared, **kept)
        before = reused(base + 121)
        time.sleep(1.0)  # the events come within a decode step and a poll (0.2 s)
        longer = [{"role": "user", "content": shared[0]["content"] + "And more."}]
        prefills[1].chat.completions.create(messages=longer, **kept)
        assert reused(base + 121) - before >= 8 * 16  # its blocks of the shared words, at least
        route = stack.role_pids()["route"]
        maps = Path(f"/proc/{route}/maps").read_text()
        assert "libtorch" not in maps, "the router loaded torch"
        started = threading.Semaphore(0)
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(timed_stream, api, LONG, started, 2) for _ in range(4)]
            for _ in streams:
                assert started.acquire(timeout=60), "a stream did not get under way"
            _, prefill = health(base + 21)
            killed_at = time.monotonic()
            os.kill(prefill["pid"], signal.SIGKILL)
            ended = [s.result(timeout=120) for s in streams]
        cut = [(s.error, s.ended - killed_at) for s in ended if s.error]
        assert cut, "no stream was on the killed prefill (4 streams, two prefills, by load)"
        assert all(seconds < 2.0 for _, seconds in cut), cut
        strange = [how for how, _ in cut if "prefill serving this stream failed" not in how]
        assert not strange, strange
        assert len(cut) < len(ended), "the other prefill's streams should have finished"
        replies = [
            api.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=2,
                extra_body={"ignore_eos": True},  # each its 2 tokens: none ends at its first
            )
            for i in range(20)
        ]
        assert all(r.choices[0].finish_reason == "length" for r in replies)
    finally:
        assert stack.stop() == 0, stack.output
