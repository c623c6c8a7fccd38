"""Real epd processes on loopback for end-to-end tests."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import openai
from PIL import Image

from epd.config.roles import ServeConfig

READY_TIMEOUT_S = 120


def ports_free(*ports: int) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def ephemeral_start() -> int:
    """The lowest port the kernel hands to client sockets that connect without a bind."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_base() -> int:
    """N such that N..N+2, N+10, N+12 and the API port N+20 are all free.

    N lies below the kernel's ephemeral range where it can: a port in that range may be taken by
    any connecting socket (ZeroMQ's reconnects among them, or a socket connected to itself)
    between this check and the server's bind.
    """
    top = ephemeral_start() - 50
    while True:
        base = random.randrange(20000, top if top > 25000 else 60000, 50)
        if ports_free(base, base + 1, base + 2, base + 10, base + 12, base + 20):
            return base


def free_fleet_base() -> int:
    """A base as `free_base`'s whose ports `epd serve` with two of each role takes are free too:
    the second of each role 100 higher, the prefills' APIs on N+21 and N+121, the router's KV
    events on N+30 (`ServeConfig.ports`)."""
    while True:
        base = free_base()
        two = {"encoders": 2, "prefills": 2, "decoders": 2}
        fleet = ServeConfig(model="-", port=base + 20, internal_base_port=base, **two)
        if ports_free(*fleet.ports()):
            return base


class Process:
    """A running `python -m epd.cli ARGS` (or `command`), its output collected, stopped with
    SIGTERM."""

    def __init__(
        self,
        *args: str,
        ready: str,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.lines: deque[str] = deque(maxlen=2000)
        self.ready = threading.Event()
        self.popen = subprocess.Popen(
            command or [sys.executable, "-m", "epd.cli", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=os.environ | (env or {}),
        )
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()

    def _read(self, ready: str) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line)
            if ready in line:
                self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def role_pids(self) -> dict[str, int]:
        """Each role's pid, from its ready line (`epd ROLE ready (pid N): ...`)."""
        pids = {}
        for line in self.output.splitlines():
            if "ready (pid" in line:
                role = line.split("epd ")[1].split(" ")[0]
                pids[role] = int(line.split("(pid ")[1].split(")")[0])
        return pids

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> Process:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.1):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"process did not get ready:\n{self.output}")
        return self

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def role(
    name: str,
    checkpoint: Path,
    base: int,
    prefills: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> Process:
    """One role started by hand: encode on base, prefill on base+1 (API base+20), decode base+2.

    Encode and decode reply only to `prefills` (default: that prefill); `extra` flags go last.
    """
    replies = ["--prefills", *(prefills or [f"tcp://127.0.0.1:{base + 1}"])]
    flags = {
        "encode": ["--bind", f"tcp://127.0.0.1:{base}", "--health-port", str(base + 10), *replies],
        "decode": [
            *("--bind", f"tcp://127.0.0.1:{base + 2}", "--health-port", str(base + 12)),
            *replies,
        ],
        "prefill": [
            *("--bind", f"tcp://127.0.0.1:{base + 1}", "--port", str(base + 20)),
            *("--encoders", f"tcp://127.0.0.1:{base}", "--decoders", f"tcp://127.0.0.1:{base + 2}"),
            *("--served-model-name", "tiny"),
        ],
    }[name]
    share = ["--threads", "1"]  # three roles on this machine's cores, as epd serve shares them
    return Process(
        name,
        *("--model", str(checkpoint), *flags, *share, *extra),
        ready=f"epd {name} ready",
        env=env,
    )


@contextlib.contextmanager
def cluster(
    checkpoint: Path,
    prefills: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    role_flags: dict[str, tuple[str, ...]] | None = None,
    flags: tuple[str, ...] = (),
    one_by_one: bool = False,
) -> Iterator[tuple[dict[str, Process], openai.OpenAI, int]]:
    """The three roles started by hand (see `role`), their openai client, and their base port;
    `flags` go to every role, `role_flags[name]` to that one; `one_by_one` starts each once
    the one before is ready (a large model's loads do not overlap in memory)."""
    base = free_base()
    processes: dict[str, Process] = {}
    try:
        for name in ("encode", "decode", "prefill"):
            extra = (*flags, *(role_flags or {}).get(name, ()))
            processes[name] = role(name, checkpoint, base, prefills, env, extra)
            if one_by_one:
                processes[name].wait_ready()
        for process in processes.values():
            process.wait_ready()
        url = f"http://127.0.0.1:{base + 20}/v1"
        yield processes, openai.OpenAI(base_url=url, api_key="-", max_retries=0), base
    finally:
        codes = {name: process.stop() for name, process in processes.items()}
    for name, code in codes.items():
        assert code == 0, f"{name} did not stop cleanly:\n{processes[name].output}"


def usage(pid: int) -> tuple[int, int]:
    """A process's resident memory in bytes and its open file descriptors."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    return rss_kib * 1024, len(os.listdir(f"/proc/{pid}/fd"))


def serve(
    checkpoint: Path | str, base: int, *flags: str, env: dict[str, str] | None = None
) -> Process:
    """`epd serve` on a checkpoint directory (or a Hugging Face repository name)."""
    return Process(
        "serve",
        *flags,
        "--model",
        str(checkpoint),
        "--port",
        str(base + 20),
        "--internal-base-port",
        str(base),
        ready="epd serve ready",
        env=env,
    ).wait_ready()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def health(port: int) -> tuple[int, dict]:
    """GET /health on a local port: its status and body, 503s included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


LONG = 3000  # tokens: long enough that a stop request or a kill lands while the streams run
# Tokens of streams a test waits to see finish: a stop still lands while they run (~11 s of
# decode steps for 3 streams on 2 cores), in a third of LONG's time.
DRAINED = 1000


def long_stream(
    client: openai.OpenAI, started: threading.Semaphore, tokens: int = LONG
) -> tuple[int, str | None]:
    """A stream of `tokens` tokens: its token count and finish reason; `started` is released
    once decode holds it: at its second piece of text (the first token's comes from prefill,
    before decode has taken the request)."""
    chunks = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    reason, usage, texts = None, 0, 0
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            texts += 1
            if texts == 2:
                started.release()
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return usage, reason


def streams_under_way(
    pool: ThreadPoolExecutor, client: openai.OpenAI, count: int, tokens: int = LONG
) -> list[Future[tuple[int, str | None]]]:
    """`count` long streams (`long_stream`) run in `pool`, returned once decode holds each."""
    started = threading.Semaphore(0)
    streams = [pool.submit(long_stream, client, started, tokens) for _ in range(count)]
    for _ in streams:
        assert started.acquire(timeout=30), "a stream did not get under way"
    return streams


class Streamed(NamedTuple):
    text: str
    times: list[float]  # when each piece came (monotonic)
    error: str  # what ended it short ("" if nothing)
    ended: float  # when it ended (monotonic)


def timed_stream(
    client: openai.OpenAI, request: dict, going: threading.Semaphore, after: int
) -> Streamed:
    """A streamed chat `request`, piece by piece; `going` released at its `after`-th piece. An
    error that ends it (an error event) is its `error`, not raised."""
    text, times, error = [], [], ""
    try:
        for chunk in client.chat.completions.create(**request, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                times.append(time.monotonic())
                if len(times) == after:
                    going.release()
    except openai.APIError as e:
        error = str(e)
    return Streamed("".join(text), times, error, time.monotonic())
