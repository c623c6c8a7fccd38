"""A vLLM command line, with `vllm` replaced by `epd`, starts the stack and serves it."""

import json
import time
import urllib.request

import openai

from epd.checkpoint.tokenizer import load_tokenizer

from .stack import Process, free_base


def get(url: str) -> tuple[dict, dict[str, str]]:
    request = urllib.request.Request(url, headers={"Origin": "https://app.example"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read()), dict(response.headers)


def test_a_vllm_command_line_serves(tiny_checkpoint, tmp_path):
    template = load_tokenizer(tiny_checkpoint).chat_template + "{# --chat-template #}"
    (tmp_path / "kimi.jinja").write_text(template)
    base = free_base()
    vllm = [
        *(str(tiny_checkpoint), "--served-model-name", "kimi-vl", "--trust-remote-code"),
        *("--tensor-parallel-size", "1", "--max-num-batched-tokens", "1024"),
        *("--max-model-len", "512", "--limit-mm-per-prompt", '{"image": 2}'),
        *("--max-num-seqs", "4", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching"),
        *("--chat-template", str(tmp_path / "kimi.jinja"), "--uvicorn-log-level", "warning"),
        *("--disable-log-requests", "--allowed-origins", '["*"]'),
    ]
    stack = Process(
        "serve",
        *vllm,
        *("--port", str(base + 20), "--internal-base-port", str(base)),
        ready="epd serve ready",
    ).wait_ready()
    try:
        url = f"http://127.0.0.1:{base + 20}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        reply = client.chat.completions.create(
            model="kimi-vl", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens >= 1
        models, headers = get(f"{url}/v1/models")
        assert models["data"][0]["max_model_len"] == 512
        assert headers["access-control-allow-origin"] == "*"  # the origin *, not '["*"]'
        assert get(f"{url}/tokenizer_info")[0]["chat_template"] == template
        time.sleep(0.5)  # the request's line, had it been logged, has reached serve's output
        assert " request chatcmpl" not in stack.output
    finally:
        assert stack.stop() == 0, stack.output
