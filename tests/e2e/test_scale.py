"""Several encoders and decoders behind one prefill: images split in parts, answers unchanged."""

from concurrent.futures import ThreadPoolExecutor

import openai
from PIL import Image

from .stack import Process, data_url, free_base, image_part, text_part

SIZES = [(840, 560), (560, 280), (300, 200)]
MESSAGES = [
    {
        "role": "user",
        "content": [
            *(
                image_part(data_url(Image.new("RGB", s, c)))
                for s, c in zip(SIZES, ["red", "blue", "green"], strict=True)
            ),
            text_part("Which is largest?"),
        ],
    }
]


def test_two_encoders_two_decoders(tiny_checkpoint, local):
    base = free_base()
    tcp = [f"tcp://127.0.0.1:{base + i}" for i in range(5)]  # encoders 0-1, decoders 2-3, prefill 4
    model = ["--model", str(tiny_checkpoint)]
    peer = [*model, "--prefills", tcp[4]]
    processes = [
        Process(
            "encode", *peer, "--bind", tcp[i], "--health-port", str(base + 10 + i), ready="ready"
        )
        for i in (0, 1)
    ] + [
        Process(
            "decode", *peer, "--bind", tcp[i], "--health-port", str(base + 10 + i), ready="ready"
        )
        for i in (2, 3)
    ]
    processes.append(
        Process(
            "prefill",
            *model,
            "--bind",
            tcp[4],
            "--port",
            str(base + 20),
            "--encoders",
            *tcp[:2],
            "--decoders",
            *tcp[2:4],
            "--served-model-name",
            "tiny",
            ready="ready",
        )
    )
    try:
        for process in processes:
            process.wait_ready()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-", max_retries=0
        )
        params = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        expected = local.chat(params)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: client.chat.completions.create(**params), range(4)))
        for reply in replies:
            assert reply.choices[0].message.content == expected.text
            assert reply.usage.prompt_tokens == expected.prompt_tokens
    finally:
        for process in processes:
            assert process.stop() == 0, process.output
