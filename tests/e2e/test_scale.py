"""Several prefills, encoders and decoders: images split in parts, answers unchanged, and a
conversation kept on the decoder that holds it."""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
from PIL import Image

from .stack import Process, data_url, free_base, image_part, text_part

SIZES = [(840, 560), (560, 280), (300, 200)]
IMAGES = [
    image_part(data_url(Image.new("RGB", s, c)))
    for s, c in zip(SIZES, ["red", "blue", "green"], strict=True)
]
# Four prompts that differ from their first block on: a decoder is chosen by the blocks it holds
# (the same prompt again goes where it went), so it takes different prompts to give both work.
MESSAGES = [
    [{"role": "user", "content": [text_part(f"Picture set {i}."), *IMAGES, text_part("Largest?")]}]
    for i in range(4)
]


def test_two_prefills_two_encoders_two_decoders(tiny_checkpoint, local):
    """Every prefill uses every encoder and decoder; replies reach the prefill that asked. One
    encoder and one decoder are given by host name (a service, resolved by prefill); encoders
    batch the requests that wait."""
    base = free_base()
    tcp = [f"tcp://127.0.0.1:{base + i}" for i in range(6)]  # encode 0-1, decode 2-3, prefill 4-5
    model = ["--model", str(tiny_checkpoint)]
    peer = [*model, "--prefills", *tcp[4:6]]
    batched = {"encode": ("--batch-patches", "100000"), "decode": ()}  # requests share forwards
    processes = [
        Process(
            role,
            *peer,
            *("--bind", tcp[i], "--health-port", str(base + 10 + i), *batched[role]),
            ready="ready",
        )
        for role, i in (("encode", 0), ("encode", 1), ("decode", 2), ("decode", 3))
    ]
    by_name = [f"tcp://localhost:{base}", tcp[1]], [f"tcp://localhost:{base + 2}", tcp[3]]
    processes += [
        Process(
            "prefill",
            *model,
            *("--bind", tcp[i], "--port", str(base + 16 + i)),
            *("--encoders", *by_name[0], "--decoders", *by_name[1]),
            *("--served-model-name", "tiny", "--threads", "1"),
            ready="ready",
        )
        for i in (4, 5)
    ]
    try:
        for process in processes:
            process.wait_ready()
        clients = [
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{base + 16 + i}/v1", api_key="-", max_retries=0
            )
            for i in (4, 5)
        ]
        params = [
            {"model": "tiny", "messages": m, "max_tokens": 12, "temperature": 0} for m in MESSAGES
        ]
        expected = [local.chat(p) for p in params]

        def ask(i):
            return clients[i % 2].chat.completions.create(**params[i % 4])

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, range(8)))
        for i, reply in enumerate(replies):
            assert reply.choices[0].message.content == expected[i % 4].text
            assert reply.usage.prompt_tokens == expected[i % 4].prompt_tokens
        for port in range(base + 10, base + 14):  # every encoder and decoder had work
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            done = re.search(
                r"^epd:(encode_images_total|decode_batch_size_count)\{[^}]*\} (\S+)", metrics, re.M
            )
            assert done and float(done[2]) > 0, port
    finally:
        for process in processes:
            assert process.stop() == 0, process.output


def test_a_conversation_stays_on_the_decoder_that_holds_it(tiny_checkpoint, local):
    """Two decoders: every turn of a conversation goes to the one that holds its blocks (the
    other gets nothing), and its hand-offs after the first carry only the rows it lacks."""
    base = free_base()
    tcp = [f"tcp://127.0.0.1:{base + i}" for i in range(4)]  # encode 0, prefill 1, decode 2-3
    model = ["--model", str(tiny_checkpoint)]
    peer = [*model, "--prefills", tcp[1], "--threads", "1"]
    processes = [
        Process(role, *peer, "--bind", tcp[i], "--health-port", str(base + 10 + i), ready="ready")
        for role, i in (("encode", 0), ("decode", 2), ("decode", 3))
    ]
    processes.append(
        Process(
            "prefill",
            *model,
            *("--bind", tcp[1], "--port", str(base + 20), "--encoders", tcp[0]),
            *("--decoders", tcp[2], tcp[3], "--served-model-name", "tiny", "--threads", "1"),
            ready="ready",
        )
    )
    try:
        for process in processes:
            process.wait_ready()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-")
        messages = [{"role": "system", "content": "You answer briefly. " * 20}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}?"})
            params = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
            reply = client.chat.completions.create(**params, extra_body={"ignore_eos": True})
            expected = local.chat(params | {"ignore_eos": True})
            assert reply.choices[0].message.content == expected.text
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        steps, hits = {}, {}
        for port in (base + 12, base + 13):
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
            step = re.search(r"^epd:decode_batch_size_count\{[^}]*\} (\S+)", text, re.M)
            hit = re.search(r"^epd:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M)
            steps[port], hits[port] = float(step[1]) if step else 0.0, float(hit[1]) if hit else 0.0
        held = max(steps, key=steps.__getitem__)
        assert sorted(steps.values())[0] == 0  # the other decoder never had a step
        assert hits[held] >= 2 * 16  # turns 2 and 3 found the system prompt's blocks there
    finally:
        for process in processes:
            assert process.stop() == 0, process.output
