"""The README's commands, run as written (only the port changed), against `make serve`."""

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from epd.config.reference import reference

from .e2e.stack import Process, free_base

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def block(name: str) -> str:
    """The fenced block that follows `<!-- readme-test: name -->`."""
    match = re.search(rf"<!-- readme-test: {name} -->\n```\w+\n(.*?)```", README, re.S)
    assert match, f"README has no block {name}"
    return match[1]


def test_configuration_reference_is_generated_from_the_code():
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    assert README[README.index(start) + len(start) : README.index(end)] == reference()


def dry_run(target: str, *settings: str, venv: Path) -> str:
    """What `make TARGET` would run on a machine without the virtual environment."""
    argv = ["make", "-n", target, f"VENV={venv}", *settings]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_make_serve_installs_serving_alone_and_make_test_the_dev_extras_too(tmp_path):
    serving = dry_run("serve", venv=tmp_path / "v")
    assert "pip install -q -e .\n" in serving and "[dev]" not in serving
    assert "pip install -q -e '.[dev]'" in dry_run("test", venv=tmp_path / "v")
    cpu = "TORCH_INDEX=https://download.pytorch.org/whl/cpu"
    assert cpu in README  # as the README says: the CPU build from PyTorch's index
    wanted = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert wanted in dry_run("serve", cpu, venv=tmp_path / "v")


@pytest.fixture(scope="module")
def make_serve():
    """`make serve`, as the README says, on free ports."""
    base = free_base()
    port = base + 20
    process = subprocess.Popen(
        [
            "make",
            "serve",
            f"PORT={port}",
            f"SERVE_FLAGS=--internal-base-port {base}",
            f"PYTHON={sys.executable}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("epd serve ready"):
            break
    assert process.poll() is None, "".join(lines)
    assert "'kimi-vl-shapes'" in lines[-1] and "Ctrl-C" in lines[-1]
    yield port
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches make and everything under it
    rest = process.communicate(timeout=60)[0]
    assert "epd serve: stopped" in rest  # make itself dies of the SIGINT, as make does


def with_port(text: str, port: int) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


@pytest.mark.parametrize("name", ["curl-text", "curl-image"])
def test_curl_examples(make_serve, name):
    result = subprocess.run(
        ["bash", "-c", with_port(block(name), make_serve)], capture_output=True, text=True
    )
    reply = json.loads(result.stdout)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1
    if name == "curl-image":  # the README says what the answer is
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": "red"}
        assert '`{"role": "assistant", "content": "red"}`' in README


def run_example(name: str, port: int) -> subprocess.CompletedProcess[str]:
    """Run a README Python block against the served demo; it must exit cleanly."""
    result = subprocess.run(
        [sys.executable, "-c", with_port(block(name), port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_python_streaming_example(make_serve):
    result = run_example("python-stream", make_serve)
    assert result.stdout.startswith("triangle") and "prints `triangle`" in README


def test_local_launch_commands(make_serve):
    """Each README line, run as written with the ports moved off the defaults."""
    base = free_base()
    ports = {
        "launch_encode": {
            "EPD_BIND": f"tcp://127.0.0.1:{base}",
            "EPD_PREFILLS": f"tcp://127.0.0.1:{base + 1}",
            "EPD_HEALTH_PORT": str(base + 10),
        },
        "launch_decode": {
            "EPD_BIND": f"tcp://127.0.0.1:{base + 2}",
            "EPD_PREFILLS": f"tcp://127.0.0.1:{base + 1}",
            "EPD_HEALTH_PORT": str(base + 12),
        },
        "launch_prefill": {
            "EPD_BIND": f"tcp://127.0.0.1:{base + 1}",
            "EPD_PORT": str(base + 20),
            "EPD_ENCODERS": f"tcp://127.0.0.1:{base}",
            "EPD_DECODERS": f"tcp://127.0.0.1:{base + 2}",
        },
    }
    processes = []
    try:
        for line in block("launch-local").strip().splitlines():
            script = re.search(r"scripts/(launch_\w+)\.sh", line)[1]
            env = ports[script] | {"EPD_PYTHON": sys.executable}
            launched = Process(ready=" ready ", env=env, command=["bash", "-c", line], cwd=ROOT)
            processes.append(launched)  # before waiting, so that `finally` stops it either way
            launched.wait_ready()
        result = subprocess.run(
            ["bash", "-c", with_port(block("curl-text"), base + 20)], capture_output=True, text=True
        )
        assert result.returncode == 0 and result.stdout, explain(result, processes)
        assert json.loads(result.stdout)["usage"]["completion_tokens"] >= 1
    finally:
        for process in processes:
            process.stop()


def explain(result: subprocess.CompletedProcess[str], processes: list[Process]) -> str:
    """Why a command got no answer: its own error, and what each process printed last."""
    tails = (
        f"--- {p.popen.args[-1]} ({'running' if p.popen.poll() is None else p.popen.returncode})"
        f"\n{''.join(list(p.lines)[-30:])}"
        for p in processes
    )
    return "\n".join([f"exit {result.returncode}: {result.stderr}", *tails])


def test_python_structured_output_example(make_serve):
    result = run_example("python-structured", make_serve)
    reply = ast.literal_eval(result.stdout)
    assert reply["shape"] in ("circle", "square", "triangle") and len(reply["colour"]) <= 10
    assert f"prints `{result.stdout.strip()}`" in README


def test_python_tool_call_example(make_serve):
    result = run_example("python-tools", make_serve)
    finish, name, arguments = result.stdout.split(" ", 2)
    assert (finish, name) == ("stop", "count_shapes")
    assert json.loads(arguments)["shape"] in ("circle", "square", "triangle")
    assert f"prints `{result.stdout.strip()}`" in README
