"""Hostile bodies and image bursts against a running stack: what other clients feel.

    .venv/bin/python scripts/bench_overload.py bodies [--model DIR] [--repo DIR]
    .venv/bin/python scripts/bench_overload.py images [--model DIR] [--repo DIR]

Starts `epd serve` with default settings (from --repo's source, so an older commit checked
out in a worktree gives the baseline) on --model (default: the bundled demo checkpoint) and:
- bodies: streams --streams chat completions, and while they run posts --bodies bodies of
  `"junk": [[], [], ...]` (--body-mb each) at once; prints each body's status and time, the
  streams' longest gap between chunks, /health's slowest answer, and prefill's memory growth.
- images: posts --requests chats of --images random images of --size² pixels each at once;
  prints how many got each status and how long they took (--warm: after one request alone).
Not a test: it loads the machine on purpose.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import requests
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
USER = [{"role": "user", "content": "Tell me a long story."}]


def start(repo: Path, model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "epd.cli", "serve", "--model", model, "--port", str(port)]
    command += ["--internal-base-port", str(port - 900)]
    env = os.environ | {"PYTHONPATH": str(repo)}
    server = subprocess.Popen(command, cwd=repo, env=env, stdout=log.open("wb"), stderr=-2)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return server
        except requests.RequestException:
            pass
        time.sleep(0.5)
    server.kill()
    sys.exit(f"epd serve did not start: see {log}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prefill_pid(port: int) -> int:
    """The child that listens on the API port: the one whose command line says prefill."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"prefill" in argv and str(port).encode() in argv:
                return int(entry.name)
    raise SystemExit("no prefill process found")


def stream_gaps(url: str, gaps: list[float], stop: threading.Event) -> None:
    """One streaming chat after another until `stop`; the longest gap between chunks."""
    body = {"messages": USER, "stream": True, "max_tokens": 400, "ignore_eos": True}
    longest = 0.0
    while not stop.is_set():
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True) as response:
            response.raise_for_status()
            last = time.perf_counter()
            for _ in response.iter_lines():
                now = time.perf_counter()
                longest, last = max(longest, now - last), now
                if stop.is_set():
                    break
    gaps.append(longest)


def watch(url: str, pid: int, stop: threading.Event, seen: dict[str, float]) -> None:
    """Poll /health and prefill's memory until `stop`: the slowest answer, the most memory."""
    while not stop.is_set():
        start = time.perf_counter()
        with contextlib.suppress(requests.RequestException):
            requests.get(f"{url}/health", timeout=60)
        seen["health_s"] = max(seen.get("health_s", 0.0), time.perf_counter() - start)
        seen["rss_mb"] = max(seen.get("rss_mb", 0.0), rss_mb(pid))
        time.sleep(0.05)


def post(url: str, data: bytes, results: list[tuple[int, float]]) -> None:
    start = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    try:
        status = requests.post(f"{url}/v1/chat/completions", data=data, headers=headers).status_code
    except requests.RequestException:
        status = 0  # the connection was closed on a refused body
    results.append((status, time.perf_counter() - start))


def run_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def bodies(url: str, port: int, args: argparse.Namespace) -> None:
    pid = prefill_pid(port)
    before, stop, gaps, seen = rss_mb(pid), threading.Event(), list[float](), dict[str, float]()
    streams = [threading.Thread(target=stream_gaps, args=(url, gaps, stop)) for _ in range(4)]
    watcher = threading.Thread(target=watch, args=(url, pid, stop, seen))
    for thread in [*streams, watcher]:
        thread.start()
    time.sleep(3)  # the streams under way
    junk = b"[], " * (args.body_mb * 250_000)
    data = b'{"messages": %s, "junk": [%s[]]}' % (json.dumps(USER).encode(), junk)
    results: list[tuple[int, float]] = []
    run_all([threading.Thread(target=post, args=(url, data, results)) for _ in range(args.bodies)])
    time.sleep(2)
    stop.set()
    for thread in [*streams, watcher]:
        thread.join()
    print(
        f"{args.bodies} bodies of {len(data) / 1e6:.0f} MB: "
        + ", ".join(f"{status} in {seconds:.2f} s" for status, seconds in results)
    )
    print(f"streams' longest gap: {max(gaps):.2f} s; slowest /health: {seen['health_s']:.2f} s")
    print(f"prefill memory: {before:.0f} MB before, {seen['rss_mb'] - before:+.0f} MB at most")


def image(size: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def images(url: str, port: int, args: argparse.Namespace) -> None:
    bodies = []
    for request in range(args.requests):
        parts = [{"type": "text", "text": "Describe these."}]
        for which in range(args.images):
            url_ = image(args.size, request * args.images + which)
            parts.append({"type": "image_url", "image_url": {"url": url_}})
        message = [{"role": "user", "content": parts}]
        bodies.append(json.dumps({"messages": message, "max_tokens": 8}).encode())
    results: list[tuple[int, float]] = []
    if args.warm:  # one request first, as on a server that has been running
        post(url, bodies[-1], results)
        print(f"a first request alone: {results.pop()}")
    run_all([threading.Thread(target=post, args=(url, b, results)) for b in bodies])
    counts = Counter(status for status, _ in results)
    print(f"{args.requests} requests of {args.images} images {args.size}²: {dict(counts)}")
    for status in sorted(counts):
        times = sorted(seconds for s, seconds in results if s == status)
        print(f"  {status}: first in {times[0]:.1f} s, last in {times[-1]:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario", choices=["bodies", "images"])
    parser.add_argument("--model", default=str(ROOT / "checkpoints" / "kimi-vl-shapes"))
    parser.add_argument("--repo", type=Path, default=ROOT, help="the epd source to start")
    parser.add_argument("--port", type=int, default=8640)
    parser.add_argument("--bodies", type=int, default=3)
    parser.add_argument("--body-mb", type=int, default=88)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--size", type=int, default=1800)
    parser.add_argument("--warm", action="store_true", help="images: one request before")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = start(args.repo, args.model, args.port, Path(f"/tmp/bench_overload_{args.port}.log"))
    try:
        (bodies if args.scenario == "bodies" else images)(url, args.port, args)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
