"""The Kubernetes manifests: rendered by the real kustomize, validated against the Kubernetes
schemas offline, checked against the CLI, and their pods' commands run here on loopback."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from epd.cli import parser
from epd.config.roles import ROLES
from epd.config.sources import read_config_file, resolve
from epd.serve import OPENMP_WAITING, openmp_env

ROOT = Path(__file__).parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
K8S_VERSION = "1.32.0"
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed")
ROLE_NAMES = ("encode", "prefill", "decode")


def render(overlay: str) -> list[dict]:
    return kustomize(KUSTOMIZE / "overlays" / overlay)


def kustomize(directory: Path) -> list[dict]:
    result = subprocess.run(
        [KUBECTL or "kubectl", "kustomize", str(directory)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


def find(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def workloads(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("StatefulSet", "Deployment")}


def config_text(objects: list[dict]) -> str:
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    return config["data"]["epd.yaml"]


def pod_args(container: dict, env: dict[str, str], config_file: Path) -> list[str]:
    """The container's arguments as the kubelet passes them ($(VAR)s expanded from `env`), with
    the ConfigMap's mount path replaced by a local file."""
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
    return [str(config_file) if a == "/etc/epd/epd.yaml" else a for a in argv]


def role_config(workload: dict, config_file: Path, env: dict[str, str]):
    """What the pod's command gives its role, read through the real CLI."""
    container = workload["spec"]["template"]["spec"]["containers"][0]
    args = parser().parse_args(pod_args(container, env, config_file))
    return args.command, resolve(ROLES[args.command], args.command, args)


@pytest.mark.parametrize("overlay", ["gpu", "cpu-demo"])
def test_overlays_render_and_validate_against_the_kubernetes_schemas(overlay):
    objects = render(overlay)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("StatefulSet") == 2 and kinds.count("Deployment") == 1
    assert kinds.count("PodDisruptionBudget") == 3
    # the gpu overlay takes the monitoring component; the demo runs on clusters without CRDs
    assert kinds.count("ServiceMonitor") == (1 if overlay == "gpu" else 0)
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked by hand below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any error
    namespace = "epd" if overlay == "gpu" else "epd-demo"
    namespaced = [o for o in objects if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {namespace}


def test_the_base_needs_no_crd():
    """A cluster without the Prometheus Operator applies the base as it is: every object is of
    a built-in kind, and the ServiceMonitor is a component that overlays opt into."""
    objects = kustomize(KUSTOMIZE / "base")
    assert "ServiceMonitor" not in {o["kind"] for o in objects}
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # only built-in kinds pass
    component = yaml.safe_load(
        (KUSTOMIZE / "components" / "monitoring" / "kustomization.yaml").read_text()
    )
    assert component["kind"] == "Component"


def test_the_cpu_demo_creates_its_namespace():
    """`kubectl apply -k overlays/cpu-demo` on a fresh cluster: the namespace comes first."""
    objects = render("cpu-demo")
    assert objects[0]["kind"] == "Namespace" and objects[0]["metadata"]["name"] == "epd-demo"
    assert [o["kind"] for o in objects].count("Namespace") == 1
    assert "ServiceMonitor" not in {o["kind"] for o in objects}


@pytest.mark.parametrize("overlay", ["gpu", "cpu-demo"])
def test_pods_agree_with_the_config_they_read(overlay, tmp_path, monkeypatch):
    for name in OPENMP_WAITING:  # what serve would set, whatever this environment says
        monkeypatch.delenv(name, raising=False)
    objects = render(overlay)
    config_file = tmp_path / "epd.yaml"
    config_file.write_text(config_text(objects))
    read_config_file(config_file)  # every key known, every value typed
    env = {"POD_IP": "10.42.0.7"}
    configs = {}
    for name, workload in workloads(objects).items():
        role, config = role_config(workload, config_file, env)
        assert role == name
        configs[name] = config
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        api_or_health = config.port if role == "prefill" else config.health_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert ports[container[probe]["httpGet"]["port"]] == api_or_health
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
        assert ports["zmq"] == int(config.bind.rsplit(":", 1)[1])
        # not root, read-only root file system, nothing to escalate
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] > 0
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
        assert security["capabilities"]["drop"] == ["ALL"]
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
        # the pods of a node share its cores on a CPU: as `epd serve` starts its children
        given = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert given.get("GOMP_SPINCOUNT") == openmp_env(config.device).get("GOMP_SPINCOUNT")
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (1 if overlay == "gpu" else None)
        # the Service in front selects these pods and names real ports
        service = find(objects, "Service", name)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert all(p["targetPort"] in ports for p in service["spec"]["ports"])
        if workload["kind"] == "StatefulSet":
            assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
            assert workload["spec"]["serviceName"] == name
    prefill = configs["prefill"]
    assert prefill.reply_address == "tcp://10.42.0.7:7102"  # its own pod: replies come back
    assert prefill.encoders == ("tcp://encode:7101",) and prefill.decoders == ("tcp://decode:7103",)
    assert configs["encode"].bind == "tcp://0.0.0.0:7101"  # what the Services point at
    assert configs["decode"].bind == "tcp://0.0.0.0:7103"
    for name in ("encode", "decode"):
        assert configs[name].prefills == ("tcp://0.0.0.0/0:7102",)
    for name in ("prefill", "decode"):  # the grace period covers preStop and the drain
        pod = workloads(objects)[name]["spec"]["template"]["spec"]
        pre_stop = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + configs[name].drain_timeout_s
    pod = workloads(objects)["prefill"]["spec"]["template"]["spec"]
    if overlay == "gpu":
        assert configs["prefill"].model.startswith("/models/") and configs["prefill"].zmq_curve_keys
        claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims[0]["persistentVolumeClaim"]["claimName"] == "epd-models"
        find(objects, "PersistentVolumeClaim", "epd-models")
    else:  # the checkpoint the Dockerfile copies into the image
        assert configs["prefill"].model == "/app/checkpoints/kimi-vl-shapes"
        assert (
            "COPY checkpoints/kimi-vl-shapes ./checkpoints/kimi-vl-shapes"
            in (ROOT / "Dockerfile").read_text()
        )


def test_disruption_budgets_and_the_service_monitor_cover_every_role():
    """The gpu overlay, with the monitoring component: its ServiceMonitor scrapes every role's
    Service, in the overlay's namespace."""
    objects = render("gpu")
    pods = {n: w["spec"]["template"]["metadata"]["labels"] for n, w in workloads(objects).items()}
    for name in ROLE_NAMES:
        budget = find(objects, "PodDisruptionBudget", name)
        assert budget["spec"]["selector"]["matchLabels"].items() <= pods[name].items()
    monitor = find(objects, "ServiceMonitor", "epd")
    assert monitor["metadata"]["namespace"] == "epd"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    for name in ROLE_NAMES:
        service = find(objects, "Service", name)
        assert wanted.items() <= service["metadata"]["labels"].items()
        assert scraped & {p["name"] for p in service["spec"]["ports"]}
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}


def test_the_fleet_overlay_puts_the_router_in_front_of_the_prefills(tmp_path):
    """cpu-fleet: the API's Service reaches the router, which finds every prefill pod through a
    headless Service; each prefill publishes its KV events to the router under its pod address."""
    objects = render("cpu-fleet")
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    config_file = tmp_path / "epd.yaml"
    config_file.write_text(config_text(objects))
    env = {"POD_IP": "10.42.0.7"}
    pods = workloads(objects)
    role, router = role_config(pods["router"], config_file, env)
    assert role == "route" and router.port == 8000 and router.host == "0.0.0.0"
    _, prefill = role_config(pods["prefill"], config_file, env)
    assert router.model == prefill.model  # the same tokenizer and chat template
    events = json.loads(prefill.kv_events_config)
    assert events["enable_kv_cache_events"] and events["topic"] == "kv@10.42.0.7"
    host, port = events["endpoint"].removeprefix("tcp://").split(":")  # connected: no *
    assert router.kv_events_bind == f"tcp://*:{port}"
    labels = {n: w["spec"]["template"]["metadata"]["labels"] for n, w in pods.items()}
    container = pods["router"]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    events_service = find(objects, "Service", host)
    assert events_service["spec"]["selector"].items() <= labels["router"].items()
    assert ports[events_service["spec"]["ports"][0]["targetPort"]] == int(port)
    api = find(objects, "Service", "prefill")  # what clients and port-forwards reach
    assert api["spec"]["selector"].items() <= labels["router"].items()
    assert ports[api["spec"]["ports"][0]["targetPort"]] == router.port
    (url,) = router.prefill_urls
    pods_service = find(objects, "Service", url.split("//")[1].split(":")[0])
    assert pods_service["spec"]["clusterIP"] == "None"  # a DNS answer per prefill pod
    assert pods_service["spec"]["selector"].items() <= labels["prefill"].items()
    assert int(url.rsplit(":", 1)[1]) == prefill.port
    for probe in ("readinessProbe", "livenessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == router.port
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_the_inference_pool_component_selects_the_prefill_pods(tmp_path):
    """components/inference-pool, taken by an overlay of the demo: its InferencePool (a CRD, its
    fields checked here) covers the prefill pods on their API port, and the prefills publish
    their KV events to the endpoint picker."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(KUSTOMIZE / 'overlays' / 'cpu-demo', overlay)}]\n"
        f"components: [{os.path.relpath(KUSTOMIZE / 'components' / 'inference-pool', overlay)}]\n"
    )
    result = subprocess.run(
        [
            KUBECTL or "kubectl",
            "kustomize",
            "--load-restrictor",
            "LoadRestrictionsNone",
            str(overlay),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    pool = find(objects, "InferencePool", "epd-prefills")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    prefill = workloads(objects)["prefill"]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= prefill["metadata"]["labels"].items()
    (container,) = prefill["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] > 0
    config = json.loads(container["args"][container["args"].index("--kv-events-config") + 1])
    assert config["endpoint"] == f"tcp://{pool['spec']['endpointPickerRef']['name']}:5557"
    assert config["topic"].startswith("kv@$(POD_IP)")
