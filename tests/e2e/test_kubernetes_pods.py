"""The cpu-demo overlay's pods, run here: each rendered container's command and environment
started as a local process, each pod on a loopback address of its own (so the manifests'
ports stay as they are); answers through both prefill replicas equal the one-process path."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml
from PIL import Image

from tests.deploy.test_kubernetes import KUBECTL, config_text, pod_args, render, workloads

from .stack import Process, data_url, image_part, text_part

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed")
SUBNET = {"encode": "127.0.1", "decode": "127.0.2", "prefill": "127.0.3"}


def pod_ip(role: str, index: int) -> str:
    return f"{SUBNET[role]}.{index + 1}"


def pod_config(text: str, ip: str, replicas: dict[str, int], checkpoint: str) -> str:
    """The ConfigMap's file for one pod: its model path and bind hosts made local, and the
    Services' names (which a cluster's DNS resolves to every pod) replaced by those pods."""
    config = yaml.safe_load(text)
    config["model"] = checkpoint
    for role in ("encode", "prefill", "decode"):
        section = config[role]
        for key in ("bind", "host", "health_host"):
            if key in section:
                section[key] = section[key].replace("0.0.0.0", ip)
    for key, role, port in (("encoders", "encode", 7101), ("decoders", "decode", 7103)):
        assert config["prefill"][key] == [f"tcp://{role}:{port}"]
        config["prefill"][key] = [f"tcp://{pod_ip(role, i)}:{port}" for i in range(replicas[role])]
    return yaml.safe_dump(config)


def test_rendered_pods_answer_through_both_prefills(tiny_checkpoint, local, tmp_path):
    objects = render("cpu-demo")
    text = config_text(objects)
    pods = workloads(objects)
    replicas = {name: pod["spec"]["replicas"] for name, pod in pods.items()}
    assert replicas == {"encode": 2, "prefill": 2, "decode": 2}
    processes = []
    for role in ("encode", "decode", "prefill"):
        container = pods[role]["spec"]["template"]["spec"]["containers"][0]
        for index in range(replicas[role]):
            ip = pod_ip(role, index)
            config = tmp_path / f"{role}-{index}.yaml"
            config.write_text(pod_config(text, ip, replicas, str(tiny_checkpoint)))
            env = {e["name"]: e.get("value", "") for e in container["env"]} | {"POD_IP": ip}
            env["HF_HOME"] = str(tmp_path / "hf")
            args = pod_args(container, env, config)
            processes.append(Process(*args, ready=f"epd {role} ready", env=env))
    try:
        for process in processes:
            process.wait_ready()
        name = yaml.safe_load(text)["served_model_name"]
        clients = [
            openai.OpenAI(
                base_url=f"http://{pod_ip('prefill', i)}:8000/v1", api_key="-", max_retries=0
            )
            for i in range(2)
        ]
        picture = data_url(Image.new("RGB", (420, 280), "teal"))
        body = {
            "messages": [{"role": "user", "content": [image_part(picture), text_part("Colour?")]}],
            "max_tokens": 8,
            "temperature": 0,
        }
        expected = local.chat({"model": name, **body}).text
        with ThreadPoolExecutor(4) as pool:
            replies = list(
                pool.map(
                    lambda i: clients[i % 2].chat.completions.create(model=name, **body), range(6)
                )
            )
        assert [r.choices[0].message.content for r in replies] == [expected] * 6
    finally:
        for process in processes:
            assert process.stop() == 0, process.output
