"""The per-node launch scripts, started by hand on this machine, form a working stack."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import openai

from .stack import free_base

ROOT = Path(__file__).parents[2]


def launch(script: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [str(ROOT / "scripts" / script)],
        env=os.environ | env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(process: subprocess.Popen, role: str) -> str:
    lines = []

    def read():
        for line in process.stdout:
            lines.append(line)
            if f"epd {role} ready" in line:
                ready.set()

    ready = threading.Event()
    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(120), "".join(lines)
    return "".join(lines)


def test_three_scripts_form_a_stack(tiny_checkpoint):
    base = free_base()
    tcp = {
        role: f"tcp://127.0.0.1:{base + i}"
        for i, role in enumerate(["encode", "prefill", "decode"])
    }
    shared = {
        "EPD_CONFIG": str(ROOT / "configs" / "local.yaml"),
        "EPD_MODEL": str(tiny_checkpoint),
        "EPD_PYTHON": sys.executable,
        "EPD_GPU": "0",  # selects the GPU where there is one; harmless on a CPU machine
    }
    processes = {
        "encode": launch(
            "launch_encode.sh",
            shared
            | {
                "EPD_BIND": tcp["encode"],
                "EPD_PREFILLS": tcp["prefill"],
                "EPD_HEALTH_PORT": str(base + 10),
            },
        ),
        "decode": launch(
            "launch_decode.sh",
            shared
            | {
                "EPD_BIND": tcp["decode"],
                "EPD_PREFILLS": tcp["prefill"],
                "EPD_HEALTH_PORT": str(base + 12),
            },
        ),
        "prefill": launch(
            "launch_prefill.sh",
            shared
            | {
                "EPD_BIND": tcp["prefill"],
                "EPD_PORT": str(base + 20),
                "EPD_ENCODERS": tcp["encode"],
                "EPD_DECODERS": tcp["decode"],
                "EPD_SERVED_MODEL_NAME": "tiny",
            },
        ),
    }
    try:
        for role, process in processes.items():
            wait_ready(process, role)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-", max_retries=0
        )
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == 3
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            assert process.wait(30) == 0
