"""Over real processes: prefill and decode publish their KV caches' events in vLLM's format,
each on its own port, named in its ready line; a subscriber declared from vLLM's types reads
both, and the blocks decode keeps are the ones prefill handed it, by the same hashes."""

import json
import time

import openai
import zmq

from tests.kv.test_events import DECODER, BlockStored

from .stack import free_base, ports_free, serve

PROMPT = " ".join(f"shape{i} colour{i}" for i in range(30))  # several whole blocks


def free_pair() -> int:
    """A port N with N + 1 free too (prefill's events, then decode's)."""
    port = free_base() + 30
    while not ports_free(port, port + 1):
        port += 2
    return port


def stored_blocks(sub: zmq.Socket[bytes], deadline: float) -> dict[int, list[int]]:
    """Every block a role said it stored until the deadline: its hash → its token ids."""
    blocks: dict[int, list[int]] = {}
    while time.monotonic() < deadline:
        if not sub.poll(100):
            continue
        _topic, sequence, payload = sub.recv_multipart()
        assert len(sequence) == 8
        for event in DECODER.decode(payload).events:
            if isinstance(event, BlockStored):
                for i, digest in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                    blocks[int(digest)] = tokens
    return blocks


def test_prefill_and_decode_publish_the_blocks_they_keep(tiny_checkpoint):
    port = free_pair()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    context = zmq.Context()
    subs = []
    for role_port in (port, port + 1):  # connected first: a late subscriber misses batches
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{role_port}")
        subs.append(sub)
    base = free_base()
    process = serve(tiny_checkpoint, base, "--kv-events-config", config)
    try:
        assert f"kv_events tcp://*:{port}" in process.output  # prefill's ready line
        assert f"kv_events tcp://*:{port + 1}" in process.output  # decode's
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="x")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": PROMPT}]
        client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        prefill, decode = (stored_blocks(sub, time.monotonic() + 3) for sub in subs)
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()
        assert process.stop() == 0, process.output
    assert len(prefill) >= 4 and len(decode) >= 4
    assert decode.keys() <= prefill.keys()  # decode named them as prefill did, hashing alone
    assert all(decode[h] == prefill[h] for h in decode)
