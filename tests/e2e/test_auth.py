"""An API key through `epd serve`: the official client with and without it, and the key kept out
of every child's command line."""

from pathlib import Path

import openai
import pytest

from .stack import free_base, serve


@pytest.fixture(scope="module")
def locked_stack(tiny_checkpoint, tmp_path_factory):
    config = tmp_path_factory.mktemp("auth") / "epd.yaml"
    config.write_text("prefill:\n  api_key: k-7f3a\n")
    base = free_base()
    stack = serve(tiny_checkpoint, base, "--config", str(config))
    yield stack, base
    assert stack.stop() == 0, stack.output


def test_the_client_needs_the_key(locked_stack):
    _, base = locked_stack
    url = f"http://127.0.0.1:{base + 20}/v1"
    keyed = openai.OpenAI(base_url=url, api_key="k-7f3a", max_retries=0)
    model = keyed.models.list().data[0].id
    reply = keyed.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=url, api_key="k-7f3b", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()


def test_the_key_is_in_no_command_line(locked_stack):
    stack, _ = locked_stack
    lines = [line for line in stack.output.splitlines() if "ready (pid" in line]
    pids = [int(line.split("(pid ")[1].split(")")[0]) for line in lines]
    assert len(pids) == 3
    for pid in [stack.popen.pid, *pids]:
        assert b"k-7f3a" not in Path(f"/proc/{pid}/cmdline").read_bytes()
