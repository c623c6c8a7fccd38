"""Load that others send does not reach the streams under way: hostile bodies are refused as
they arrive, and image work that cannot be encoded in time is refused at once, not timed out."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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


def flat_jpeg(seed: int, size: int = 896) -> str:
    """A JPEG of one colour: a few KB to send, yet as many patches to encode as any photo of
    its size (the largest an image becomes); each seed its own file, so none is cached."""
    colour = (seed % 256, seed // 256 % 256, 99)
    return data_url(Image.new("RGB", (size, size), colour), "JPEG")


def chat_of_images(urls: list[str]) -> bytes:
    parts = [text_part("Describe them."), *(image_part(u) for u in urls)]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    return json.dumps(body).encode()


def burst(url: str, first_seed: int, requests_: int) -> list[tuple[requests.Response, float]]:
    """`requests_` chats of 4 new images each, all at once: each reply and its time."""
    bodies = [
        chat_of_images([flat_jpeg(first_seed + 4 * i + j) for j in range(4)])
        for i in range(requests_)
    ]

    def timed(body: bytes) -> tuple[requests.Response, float]:
        start = time.perf_counter()
        return requests.post(url, data=body, timeout=60), time.perf_counter() - start

    with ThreadPoolExecutor(requests_) as pool:
        return list(pool.map(timed, bodies))


def backlog(base: int) -> int:
    health = requests.get(f"http://127.0.0.1:{base + 20}/health", timeout=5).json()
    return health["encode_backlog_patches"]


def test_an_image_burst_is_served_or_refused_at_once_from_the_first_request(tiny_checkpoint):
    """A fresh server does not know its encoders' pace; admitting on a guess let a burst in
    that then timed out (504 after encode_timeout_s). Every reply is a 200 or a 503, and a
    refusal at admission comes within 2 s, on a fresh server (which trusts its encoder with
    one request at the limits, 4 images, until it answers) and again once it is measured."""
    base = free_base()
    stack = serve(tiny_checkpoint, base, "--encode-timeout-s", "8", "--max-images", "4")
    try:
        url = f"http://127.0.0.1:{base + 20}/v1/chat/completions"
        for first_seed in (0, 1000):  # fresh, then on the pace the first burst measured
            deadline = time.monotonic() + 30
            while backlog(base) and time.monotonic() < deadline:  # images refused late
                time.sleep(0.2)
            answers = burst(url, first_seed, 16)
            statuses = [answer.status_code for answer, _ in answers]
            assert set(statuses) <= {200, 503}, statuses  # no timeouts: admitted means served
            assert 200 in statuses and 503 in statuses, statuses
            refused = [(a, s) for a, s in answers if a.status_code == 503]
            for answer, _ in refused:
                assert int(answer.headers["Retry-After"]) >= 1
                assert "encode_timeout_s" in answer.json()["error"]["message"]
            at_admission = [s for a, s in refused if "since" not in a.json()["error"]["message"]]
            assert at_admission and max(at_admission) < 2, at_admission
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
