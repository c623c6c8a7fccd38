"""docker-compose files, parsed by the real docker-compose, checked against the CLI and configs."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from epd.cli import parser
from epd.config.roles import ROLES
from epd.config.sources import resolve
from epd.serve import OPENMP_WAITING, openmp_env

ROOT = Path(__file__).parents[2]
COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(
    COMPOSE is None and not os.environ.get("CI"),
    reason="docker-compose is not installed (.ci/run installs it; apt-get install docker-compose)",
)


def parsed(file: str, model_dir: str | None = "/models/x") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EPD_MODEL_DIR"}
    result = subprocess.run(
        [COMPOSE or "docker-compose", "-f", str(ROOT / file), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env | ({"EPD_MODEL_DIR": model_dir} if model_dir else {}),
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def role_config(service: dict):
    """The config a service's command gives its role, read through the real CLI."""
    argv = [a.replace("/app/configs/", f"{ROOT}/configs/") for a in service["command"]]
    args = parser().parse_args(argv)
    return args.command, resolve(ROLES[args.command], args.command, args)


def health_port(service: dict) -> int:
    return int(re.search(r"127\.0\.0\.1:(\d+)/health", " ".join(service["healthcheck"]["test"]))[1])


@pytest.mark.parametrize("file,gpus", [("docker-compose.yml", 1), ("docker-compose.cpu.yml", 0)])
def test_compose_file(file, gpus, monkeypatch):
    for name in OPENMP_WAITING:  # what serve would set, whatever this environment says
        monkeypatch.delenv(name, raising=False)
    services = parsed(file)["services"]
    assert set(services) == {"keys", "encode", "prefill", "decode"}
    keys = services.pop("keys")
    assert keys["command"] == ["keys", "/keys", "--if-missing"]
    # it starts first: built as the others are, not pulled from a registry that has no epd
    assert (
        keys["build"] == services["prefill"]["build"]
        and keys["image"] == services["prefill"]["image"]
    )
    configs = {}
    for name, service in services.items():
        role, config = role_config(service)
        assert role == name
        configs[name] = config
        assert config.model == "/model" and "/models/x:/model:ro" in service["volumes"]
        assert config.zmq_curve_keys == "/keys" and "epd-keys:/keys:ro" in service["volumes"]
        assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully"
        assert config.device == ("cuda:0" if gpus else "cpu")
        assert service["restart"] == "unless-stopped"
        devices = (
            service.get("deploy", {})
            .get("resources", {})
            .get("reservations", {})
            .get("devices", [])
        )
        assert sum(d["count"] for d in devices) == gpus
        expected = config.port if name == "prefill" else config.health_port
        assert health_port(service) == expected
        # the containers share the host's cores on a CPU: as `epd serve` starts its children
        assert service["environment"].get("GOMP_SPINCOUNT") == (
            openmp_env(config.device).get("GOMP_SPINCOUNT")
        )
        assert service["environment"]["EPD_LOG_LEVEL"] == "INFO"
    prefill = configs["prefill"]
    # the checkpoint's name, not its mount point, in every role (metrics are labelled by it)
    assert {c.model_name for c in configs.values()} == {"kimi-vl-shapes"}
    assert prefill.peer_metrics == tuple(
        f"http://{name}:{configs[name].health_port}/metrics" for name in ("encode", "decode")
    )
    published = services["prefill"]["ports"][0]
    assert (
        int(str(published["target"] if isinstance(published, dict) else published.split(":")[-1]))
        == prefill.port
    )
    assert prefill.encoders == (f"tcp://encode:{configs['encode'].bind.rsplit(':', 1)[1]}",)
    assert prefill.decoders == (f"tcp://decode:{configs['decode'].bind.rsplit(':', 1)[1]}",)
    assert prefill.advertise == f"tcp://prefill:{prefill.bind.rsplit(':', 1)[1]}"
    assert configs["encode"].prefills == configs["decode"].prefills == (prefill.advertise,)
    for name in ("encode", "decode"):
        assert services["prefill"]["depends_on"][name]["condition"] == "service_healthy"
        assert configs[name].bind.startswith("tcp://0.0.0.0:")
    grace = services["prefill"]["stop_grace_period"]  # the drain fits in it
    assert int(grace.rstrip("s")) > prefill.drain_timeout_s


@pytest.mark.parametrize("file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_without_a_model_dir_the_cluster_serves_the_bundled_checkpoint(file):
    services = parsed(file, model_dir=None)["services"]
    for name in ("encode", "prefill", "decode"):
        volume, _keys = services[name]["volumes"]
        source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
        assert Path(source).resolve() == (ROOT / "checkpoints" / "kimi-vl-shapes").resolve()
        assert (Path(source) / "config.json").is_file()


def test_image_runs_the_epd_console_script():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["epd"]' in dockerfile and "COPY configs ./configs" in dockerfile


def test_image_is_pinned_layered_and_not_root():
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, re.M)[1]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base)  # a patch release, pinned
    assert "ARG DEVICE=cuda" in dockerfile and "whl/cpu" in dockerfile
    assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+", dockerfile)
    # dependencies in a layer before the source
    assert dockerfile.index("-r /tmp/requirements.txt") < dockerfile.index("COPY epd ./epd")
    user = re.search(r"^USER (\S+)", dockerfile, re.M)[1]
    assert user not in ("root", "0") and "HEALTHCHECK" in dockerfile
    assert dockerfile.index("USER") > dockerfile.index("RUN pip install --no-cache-dir --no-deps .")


def test_the_fleet_file_puts_the_router_in_front_of_two_prefills():
    """docker-compose.fleet.yml: the router publishes the API and names both prefills; each
    prefill advertises its own address, which encode and decode reply to, and publishes its KV
    events to the router under its own topic; every prefill uses both decoders."""
    services = parsed("docker-compose.fleet.yml")["services"]
    assert set(services) == {
        "keys",
        "encode",
        "decode-a",
        "decode-b",
        "prefill-a",
        "prefill-b",
        "router",
    }
    configs = {name: role_config(s) for name, s in services.items() if name != "keys"}
    assert {name: role for name, (role, _) in configs.items()} == {
        "encode": "encode",
        "decode-a": "decode",
        "decode-b": "decode",
        "prefill-a": "prefill",
        "prefill-b": "prefill",
        "router": "route",
    }
    router = configs["router"][1]
    prefills = {name: configs[name][1] for name in ("prefill-a", "prefill-b")}
    assert router.prefill_urls == tuple(f"http://{n}:{c.port}" for n, c in prefills.items())
    published = [
        str(p["target"] if isinstance(p, dict) else p) for p in services["router"]["ports"]
    ]
    assert [int(p.split(":")[-1]) for p in published] == [router.port]
    assert all("ports" not in services[name] for name in prefills)  # reached through the router
    events_port = router.kv_events_bind.rsplit(":", 1)[1]
    for name, config in prefills.items():
        assert config.reply_address == f"tcp://{name}:{config.bind.rsplit(':', 1)[1]}"
        events = json.loads(config.kv_events_config)
        assert events["endpoint"] == f"tcp://router:{events_port}" and events["topic"] == name
        assert config.decoders == ("tcp://decode-a:7103", "tcp://decode-b:7103")
        assert config.max_arriving_bodies_per_client == config.max_arriving_bodies
        assert health_port(services[name]) == config.port
    advertised = tuple(c.reply_address for c in prefills.values())
    for name in ("encode", "decode-a", "decode-b"):
        assert configs[name][1].prefills == advertised
        assert health_port(services[name]) == configs[name][1].health_port
    assert health_port(services["router"]) == router.port
    assert len({c.model_name for _, c in configs.values()}) == 1  # one name everywhere
