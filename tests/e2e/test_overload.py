"""Load that others send does not reach the streams under way: hostile bodies are refused as
they arrive, and image work that cannot be encoded in time is refused at once, not timed out."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
from PIL import Image

from .stack import data_url, free_base, image_part, serve, text_part

JUNK = b'{"messages": [{"role": "user", "content": "hi"}], "junk": [%s[]]}' % (b"[], " * 5_000_000)


def post(url: str, data: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        response = requests.post(url, data=data, headers={"Content-Type": "application/json"})
    except requests.ConnectionError:  # refused before all of it was sent
        return 0, time.perf_counter() - start
    return response.status_code, time.perf_counter() - start


def longest_gap(client, model_name: str, started: threading.Event) -> tuple[float, str]:
    """A stream of 300 tokens: the longest wait between its chunks, and its finish reason."""
    chunks = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=300,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    longest, last, reason = 0.0, time.perf_counter(), ""
    for chunk in chunks:
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        started.set()
        reason = chunk.choices[0].finish_reason or reason if chunk.choices else reason
    return longest, reason


def test_bodies_of_millions_of_values_are_refused_while_streams_flow(stack, client, model_name):
    _, base = stack
    url = f"http://127.0.0.1:{base + 20}/v1/chat/completions"
    started = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        stream = pool.submit(longest_gap, client, model_name, started)
        assert started.wait(30)
        refused = list(pool.map(post, [url] * 3, [JUNK] * 3))  # 20 MB each, at once
        health = requests.get(f"http://127.0.0.1:{base + 20}/health", timeout=5)
        assert all(status in (413, 0) for status, _ in refused), refused
        assert max(seconds for _, seconds in refused) < 10
        assert health.status_code == 200
        gap, reason = stream.result(timeout=120)
    assert reason == "length"
    assert gap < 5  # the old parse held every stream for as long as it built the arrays


def noise_jpeg(seed: int, size: int = 1200) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return data_url(Image.fromarray(pixels), "JPEG")


def chat_of_images(urls: list[str]) -> bytes:
    parts = [text_part("Describe them."), *(image_part(u) for u in urls)]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    return json.dumps(body).encode()


def test_image_work_that_cannot_be_encoded_in_time_is_refused_at_once(tiny_checkpoint):
    base = free_base()
    stack = serve(tiny_checkpoint, base, "--encode-timeout-s", "3")
    try:
        url = f"http://127.0.0.1:{base + 20}/v1/chat/completions"
        images = [noise_jpeg(seed) for seed in range(49)]
        assert post(url, chat_of_images(images[:1]))[0] == 200  # the encoders' pace measured
        bodies = [chat_of_images(images[1 + 4 * i : 5 + 4 * i]) for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda body: requests.post(url, data=body), bodies))
        statuses = [a.status_code for a in answers]
        assert set(statuses) <= {200, 503}, statuses  # no timeouts: admitted means served
        assert 200 in statuses and 503 in statuses, statuses
        refused = next(a for a in answers if a.status_code == 503)
        assert int(refused.headers["Retry-After"]) >= 1
        assert "encode_timeout_s" in refused.json()["error"]["message"]
        health = requests.get(f"http://127.0.0.1:{base + 20}/health", timeout=5).json()
        assert health["encode_patches_per_s"] > 0
    finally:
        assert stack.stop() == 0, stack.output


def test_a_field_of_the_wrong_type_is_a_400_naming_it(stack):
    _, base = stack
    api = f"http://127.0.0.1:{base + 20}/v1"
    user = [{"role": "user", "content": "hi"}]
    for route, body, param in [
        ("responses", {"input": "hi", "include": [{}]}, "include.0"),
        ("chat/completions", {"messages": user, "modalities": 5}, "modalities"),
    ]:
        answer = requests.post(f"{api}/{route}", json=body, timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
