"""Hostile input and going-away clients do not hurt the running stack."""

import contextlib
import json
import os
import pickle
import time
import urllib.request

import requests
import zmq

from tests.wire.test_hostile_headers import PWNED

from .test_stack import CASES, ask


def decode_health(base):
    with urllib.request.urlopen(f"http://127.0.0.1:{base + 12}/health", timeout=5) as response:
        return json.loads(response.read())


class Exploit:
    def __reduce__(self):
        import os

        return os.system, (f"touch {PWNED}",)


def test_malicious_headers_are_refused_and_servers_keep_serving(
    stack, client, model_name, tmp_path
):
    process, base = stack
    context = zmq.Context()
    frames = [
        [pickle.dumps(Exploit())],
        [b"\x80\x05\x95garbage"],
        [pickle.dumps(__import__("numpy").zeros(4))],
    ]
    for port in (base, base + 1, base + 2):  # encode, prefill, decode
        sender = context.socket(zmq.PUSH)
        sender.setsockopt(zmq.LINGER, 1000)
        sender.connect(f"tcp://127.0.0.1:{port}")
        for message in frames:
            sender.send_multipart(message)
        sender.close()
    context.term()
    deadline = time.monotonic() + 10
    while process.output.count("refused a message") < 9 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.output.count("refused a message") == 9
    assert process.output.count("a pickle, protocol") == 9  # named for what it is, never loaded
    assert not os.path.exists(PWNED)
    # ignore_eos: an unseeded sample may draw eos early, which says nothing about the server.
    reply = ask(
        client, model_name, CASES["one image"], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 3


def long_request(model_name, **extra):
    """A request that would decode for a long time if nobody stopped it."""
    return {
        "model": model_name,
        "messages": CASES["text only"],
        "max_tokens": 4000,
        "temperature": 0,
        **extra,
    }


def test_client_that_disconnects_is_aborted_in_decode(stack, model_name):
    _, base = stack
    url = f"http://127.0.0.1:{base + 20}/v1/chat/completions"
    request = long_request(model_name, stream=True)
    with requests.post(url, json=request, stream=True, timeout=30) as response:
        events = (line for line in response.iter_lines() if line.startswith(b"data: "))
        for _ in range(3):  # the role chunk, then tokens: decode is generating
            next(events)
        assert decode_health(base)["running"] == 1
    deadline = time.monotonic() + 10
    while decode_health(base)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode_health(base)["running"] == 0  # freed long before 4000 tokens


def test_non_streaming_client_that_disconnects_is_aborted(stack, model_name):
    process, base = stack
    aborted = process.output.count("its client went away")
    url = f"http://127.0.0.1:{base + 20}/v1/chat/completions"
    request = long_request(model_name)
    with contextlib.suppress(requests.Timeout):
        requests.post(url, json=request, timeout=1.0)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if (
            process.output.count("its client went away") > aborted
            and not decode_health(base)["running"]
        ):
            break
        time.sleep(0.05)
    assert decode_health(base)["running"] == 0
    assert process.output.count("its client went away") == aborted + 1
