"""`epd serve`: the three processes on this machine, started, watched and stopped together.

Each child is a real OS process (`python -m epd.cli <role> ...`). `serve` waits for every
child's ready line; a child that dies before it is ready ends `serve` with that child's error. A
child that dies later (its watchdog ends a child that stalls) is restarted with exponential
backoff while the others keep running. Children end when `serve` does, even if it is killed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from epd.checkpoint.hub import on_disk
from epd.config.roles import ROLES, DecodeConfig, EncodeConfig, PrefillConfig, ServeConfig
from epd.config.settings import peer_endpoint
from epd.config.sources import (
    SHARED,
    build,
    child_settings,
    flag_values,
    read_config_file,
    role_values,
    secret_env,
    to_flags,
)
from epd.kv.events import KVEventsConfig, with_port_offset
from epd.runtime.process import (
    SUPERVISOR_ENV,
    available_cores,
    skip_collection_at_exit,
    stop_event,
    torch_threads,
)

CHILDREN = ("encode", "decode", "prefill", "route")
# What holds clients' requests: stopped first, given the drain. The router stops with encode and
# decode after it, so that the streams it relays finish (new requests get the prefills' 503s).
FRONT = ("prefill",)
HEALTHY_AFTER_S = 60.0  # a child that lived this long restarts without accumulated backoff
CORES = available_cores()
# Turns libgomp's threads spin after an op before they sleep, on a CPU (`openmp_env`).
BRIEF_SPIN = 10_000
OPENMP_WAITING = {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"}  # set by the user: left as they are
STOP_TIMEOUT_S = 10.0  # children still running this long after SIGTERM are killed (< STOP_GRACE_S)
HURRY_S = 3.0  # after a second stop signal, children still running this long are killed


@dataclass
class Child:
    role: str
    argv: list[str]
    secrets: dict[str, str] = field(default_factory=dict)  # environment, not argv
    env: dict[str, str] = field(default_factory=dict)  # more of its environment (`openmp_env`)
    name: str = ""  # in serve's output: the role, or prefill-1, ... (default: the role)
    process: subprocess.Popen[str] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    started_at: float = 0.0
    delay: float = 1.0
    restart_at: float | None = None

    def start(self) -> None:
        self.ready.clear()
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            # Its own session: a terminal's Ctrl-C reaches serve alone, which stops the
            # children in order (prefill drains first).
            start_new_session=True,
            # It ends when serve does; secrets go in its environment, which only it can read.
            env=os.environ | self.env | self.secrets | {SUPERVISOR_ENV: str(os.getpid())},
        )
        self.started_at, self.restart_at = time.monotonic(), None
        threading.Thread(target=self.relay, args=(self.process,), daemon=True).start()

    def relay(self, process: subprocess.Popen[str]) -> None:
        """Echo the child's output with its role, and notice its ready line."""
        assert process.stdout is not None
        for line in process.stdout:
            self.tail.append(line)
            print(f"[{self.name or self.role}] {line}", end="", flush=True)
            if line.startswith(f"epd {self.role} ready"):
                self.ready.set()

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def wait(self, deadline: float) -> None:
        """Wait for the child to end until `deadline` (monotonic), then kill it."""
        if self.process is None:
            return
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def stop_all(children: list[Child], timeout: float = STOP_TIMEOUT_S) -> None:
    """Ask every child to stop at once, then wait for all of them under one deadline."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        child.wait(deadline)


def stop_in_order(children: list[Child], drain_s: float) -> None:
    """Prefill first, given `drain_s` to let its requests in flight finish (it refuses new ones
    meanwhile); then encode, decode and the router in front of several prefills, which those
    requests needed until the end."""
    first = [c for c in children if c.role in FRONT]
    stop_all(first, drain_s + STOP_TIMEOUT_S)
    stop_all([c for c in children if c.role not in FRONT])


def kill_all(children: list[Child]) -> None:
    for child in children:
        child.kill()


def stop_at_once_when_asked_again(children: list[Child], stop: threading.Event) -> None:
    """A stop signal once `stop` is set (a second Ctrl-C, while the children start or stop)
    cuts the stop short: prefill, asked again, ends the requests it holds at once, each with
    an error (a stream's last event, then [DONE]) rather than a cut connection, and exits; any
    child still running HURRY_S later is killed. The first signal goes to the handler found
    (`stop_event`'s), which sets `stop`."""
    first = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def asked(sig: int, frame: FrameType | None) -> None:
        if not stop.is_set():
            handler = first[signal.Signals(sig)]
            assert callable(handler), "stop_event's handler is installed first"
            handler(sig, frame)
            return
        for child in children:
            if child.role in FRONT:
                child.terminate()
        killer = threading.Timer(HURRY_S, kill_all, args=(children,))
        killer.daemon = True
        killer.start()

    for sig in first:
        signal.signal(sig, asked)


def start_all(children: list[Child], stop: threading.Event) -> None:
    """Start every child and wait for all ready lines; exit with the first child's failure."""
    for child in children:
        child.start()
    while not all(c.ready.is_set() for c in children):
        failed = next(
            (c for c in children if c.exit_code() is not None and not c.ready.is_set()), None
        )
        if failed is not None or stop.is_set():
            stop_all(children)
            if failed is None:
                sys.exit(0)
            time.sleep(0.2)  # let the relay thread print the last lines
            sys.exit(
                f"epd serve: {failed.name or failed.role} failed to start "
                f"(exit code {failed.exit_code()}):\n" + "".join(failed.tail)
            )
        time.sleep(0.1)


def supervise(child: Child, max_delay: float) -> None:
    """Restart a child that died, later each time it dies young."""
    code, now = child.exit_code(), time.monotonic()
    if code is None:
        return
    if child.restart_at is None:
        if now - child.started_at > HEALTHY_AFTER_S:
            child.delay = 1.0
        child.restart_at = now + child.delay
        print(
            f"epd serve: {child.name or child.role} exited with code {code}; restarting in "
            f"{child.delay:.0f}s",
            flush=True,
        )
        child.delay = min(child.delay * 2, max_delay)
    elif now >= child.restart_at:
        child.start()


def plan(args: argparse.Namespace) -> tuple[ServeConfig, dict[str, Any]]:
    """`serve`'s own config and each child's, from one config file and serve's flags.

    A child gets its role's settings from the file, then the shared settings (model, device,
    dtype, ...) given to `serve` itself, then serve's flags for its role's settings (e.g.
    `--max-batch-size` for decode, `--max-image-bytes` for encode and prefill), then the
    loopback addresses `serve` owns, and, unless its threads are set, its share of this
    machine's cores (`core_shares`); on a CPU, prefill's `busy_threads`, and encode's and
    decode's `alone_threads` (every core: for a lone request's encode, and for decode's steps
    while the others leave their cores idle) unless set.
    """
    raw = read_config_file(args.config) if args.config else {}
    flags = flag_values(args, ServeConfig)
    config = build(ServeConfig, role_values(raw, "serve") | flags)
    # The file's top-level keys reach each child through role_values, under its own section;
    # what serve's section or flags say wins over both.
    shared = {k: v for k, v in (raw.get("serve", {}) | flags).items() if k in SHARED}
    settings = child_settings()  # serve's flags for its children's settings → their roles
    children: dict[str, Any] = {}
    for role in CHILDREN:
        given = flag_values(args, ROLES[role])
        passed = {k: v for k, v in given.items() if role in settings.get(k, ())}
        count = config.count(role)
        for i in range(count):
            values = role_values(raw, role) | shared | passed | config.addresses(role, i)
            child = build(ROLES[role], values)
            if role != "route":  # the router runs no model: its threads are not torch's
                share = max(1, core_shares(CORES)[role] // count)
                child = dataclasses.replace(
                    child, threads=torch_threads(child.threads, child.device, share)
                )
            children[child_name(role, i)] = child
    decode = children["decode"]
    for name, child in children.items():
        if isinstance(child, PrefillConfig) and child.device == "cpu" and not child.busy_threads:
            busy = busy_threads(child.threads, decode.threads, CORES)
            children[name] = dataclasses.replace(child, busy_threads=busy)
    publishing = sorted(  # prefill on the ports given, decode on the next; then prefill-1, ...
        (n for n, c in children.items() if isinstance(c, PrefillConfig | DecodeConfig)),
        key=lambda n: (int(n.rpartition("-")[2] or 0) if "-" in n else 0, n.startswith("decode")),
    )
    # In a fleet every prefill follows every decoder's KV events, unless either side is set.
    prefills = [c for c in children.values() if isinstance(c, PrefillConfig)]
    fleet = config.decoders > 1 or config.prefills > 1
    fleet = fleet and not decode.kv_events_config and not prefills[0].decoder_kv_events
    for name, child in children.items():
        if fleet and isinstance(child, PrefillConfig):
            children[name] = dataclasses.replace(child, decoder_kv_events=DECODER_EVENTS)
    for offset, name in enumerate(publishing):  # each its own ports, as vLLM's DP ranks
        child = children[name]
        events = offset_kv_events(child.kv_events_config, offset)
        if config.count("route") and isinstance(child, PrefillConfig) and not events:
            events = router_kv_events(config, name)  # the router follows its blocks
        if fleet and isinstance(child, DecodeConfig) and not events:
            events = json.dumps({"enable_kv_cache_events": True, "endpoint": decoder_events(child)})
        children[name] = dataclasses.replace(child, kv_events_config=events)
        if config.count("route") and isinstance(child, PrefillConfig):
            # Every request comes from the router's address: one client's bound would be all.
            arriving = children[name].max_arriving_bodies
            children[name] = dataclasses.replace(
                children[name], max_arriving_bodies_per_client=arriving
            )
    for name, child in children.items():  # a lone request's encode; decode while alone
        alone = isinstance(child, EncodeConfig | DecodeConfig) and not child.alone_threads
        if alone and child.device == "cpu":
            children[name] = dataclasses.replace(child, alone_threads=CORES)
    return config, children


def child_name(role: str, i: int) -> str:
    """A child's name in serve's output: its role, then `prefill-1`, `prefill-2`, ..."""
    return f"{role}-{i}" if i else role


# A decoder's KV events in a fleet on one machine: a socket named by the decoder's port, which
# prefill finds by the same template, in a directory `run` makes for this serve alone (mode 0700:
# the events carry prompts' token ids; no other user may read them, or take the name first).
PRIVATE = "ipc://@epd-serve-private/"  # plan's stand-in for that directory
DECODER_EVENTS = PRIVATE + "kv-events-{port}"


def in_private_dir(children: dict[str, Any], directory: str) -> dict[str, Any]:
    """The children's configs with `PRIVATE` in their KV events' addresses made `directory`."""
    here = f"ipc://{directory}/"
    moved = {}
    for name, child in children.items():
        changes = {
            key: getattr(child, key).replace(PRIVATE, here)
            for key in ("kv_events_config", "decoder_kv_events")
            if PRIVATE in getattr(child, key, "")
        }
        moved[name] = dataclasses.replace(child, **changes) if changes else child
    return moved


def decoder_events(decode: DecodeConfig) -> str:
    endpoint = peer_endpoint(DECODER_EVENTS, decode.bind)
    assert endpoint is not None, "serve binds its decoders on tcp://127.0.0.1"
    return endpoint


def router_kv_events(config: ServeConfig, name: str) -> str:
    """A prefill's KV events, to the router's socket under the prefill's name as topic."""
    endpoint = f"tcp://127.0.0.1:{config.kv_events_port}"
    return json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint, "topic": name})


def offset_kv_events(text: str, offset: int) -> str:
    """A `--kv-events-config` whose endpoints' ports are `offset` higher: each role publishes on
    its own (prefill on the ports given, decode on the next), as vLLM offsets its data-parallel
    ranks'."""
    if not text or not offset:
        return text
    config = KVEventsConfig.from_json(text)
    if not config.publishes:
        return text
    fields = json.loads(text) | {"endpoint": with_port_offset(config.endpoint, offset)}
    if config.replay_endpoint:
        fields["replay_endpoint"] = with_port_offset(config.replay_endpoint, offset)
    return json.dumps(fields)


def busy_threads(prefill: int, decode: int, cores: int) -> int:
    """Prefill's threads while anything else runs, on a CPU: what decode's leave of the cores.

    On 2 cores prefill gets both and decode one (`core_shares`): three threads on two cores
    while both work, and a forward's threads wait for one another at every op whenever one of
    them is descheduled. So prefill runs on all its threads only while nothing else runs (a
    lone request's time to first token), and on what decode leaves while anything else does
    (docs/benchmarks.md, "Prefill's threads").
    """
    return max(1, min(prefill, cores - decode))


def openmp_env(device: str) -> dict[str, str]:
    """What a child's OpenMP runtime reads from its environment at start: on a CPU, its threads
    wait only briefly for more work after each op (`BRIEF_SPIN` turns of libgomp's spin, ~0.2
    ms, where its default, 300,000, lasts milliseconds), unless this environment already says
    how they wait.

    The roles share the machine's cores, and a thread that spins keeps one from the others: after
    a forward, prefill's spun while decode ran the first step of the request just handed to it
    (15-20 ms against 10); and decode's, when a burst of new prompts took prefill and the API
    from idle to busy, spun at every op waiting for a descheduled thread of the same step (steps
    of 100-600 ms, every stream stalled; with the brief spin at most ~100 ms). docs/benchmarks.md,
    "OpenMP's threads between roles".
    """
    if device != "cpu" or OPENMP_WAITING & os.environ.keys():
        return {}
    return {"GOMP_SPINCOUNT": str(BRIEF_SPIN)}


def core_shares(cores: int) -> dict[str, int]:
    """Threads per role on a CPU: decode and encode a third of the cores each (at least one),
    prefill the cores that decode's third (rounded down) leaves, so both on 2 cores.

    Decode works without pause while anything is generating; prefill works in bursts that set
    each request's time to first token, and a request's encode comes before its prefill rather
    than beside it. On 2 cores prefill on both, beside decode's one, beat one thread each at
    every load, and encode on both too lost under image load (docs/benchmarks.md, "Prefill's
    threads"); `alone_threads` gives encode and decode the idle cores when they are alone.
    """
    third = cores // 3
    return {"encode": max(1, third), "decode": max(1, third), "prefill": max(1, cores - third)}


def announce(config: ServeConfig, model_name: str) -> None:
    api = f"http://{config.host}:{config.port}/v1"
    body = (
        f'{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32}'
    )
    print(
        f"epd serve ready: OpenAI API at {api} (model {model_name!r}); Ctrl-C stops it", flush=True
    )
    print(
        f"  try: curl {api}/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        flush=True,
    )


def taken_port(config: ServeConfig) -> str | None:
    """Why serve cannot start on its ports, if one is already in use."""
    n = config.internal_base_port
    for port, kind in config.ports().items():
        host = config.host if kind == "API" else "127.0.0.1"
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            # As the children will bind: a port left in TIME_WAIT is free, a listener is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                if kind == "API":
                    return f"the API port {port} is in use: pass another --port"
                return (
                    f"internal port {port} is in use (epd serve uses --internal-base-port {n} "
                    f"and the ports after it: {n}-{n + 2}, {n + 10}, {n + 12}, and 100 higher "
                    "for each second, third... process of a role): pass another "
                    "--internal-base-port"
                )
    return None


def run(config: ServeConfig, child_configs: dict[str, Any]) -> None:
    if problem := taken_port(config):
        sys.exit(f"epd serve: {problem}")
    # Each child's model as a directory, looked up (or downloaded) once, after the ports: a
    # download may take long.
    child_configs = {role: on_disk(c) for role, c in child_configs.items()}
    private = tempfile.mkdtemp(prefix="epd-serve-")  # 0700, this user's alone
    try:
        supervise_all(config, in_private_dir(child_configs, private))
    finally:
        shutil.rmtree(private, ignore_errors=True)


def supervise_all(config: ServeConfig, child_configs: dict[str, Any]) -> None:
    """Start every child, restart those that die, and stop them all in order when asked."""
    drain_s = child_configs["prefill"].drain_timeout_s
    stop = stop_event(grace_s=drain_s + 3 * STOP_TIMEOUT_S)  # the stop below, and a margin
    base = [sys.executable, "-m", "epd.cli"]
    children = []
    for name, c in child_configs.items():
        role = name.partition("-")[0]
        argv = [*base, role, *to_flags(c)]
        children.append(Child(role, argv, secret_env(c), openmp_env(c.device), name=name))
    stop_at_once_when_asked_again(children, stop)  # from the start: children load for minutes
    start_all(children, stop)
    announce(config, child_configs["prefill"].model_name)
    try:
        while not stop.is_set():
            for child in children:
                supervise(child, config.max_restart_delay_s)
            stop.wait(0.2)
    finally:
        stop_in_order(children, drain_s)
        skip_collection_at_exit()
        print("epd serve: stopped", flush=True)
