"""Settings from defaults, a config file and flags: one definition, flags win, errors name keys."""

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from epd.bench.config import BenchConfig
from epd.cli import parser
from epd.config.roles import ROLES, DecodeConfig, EncodeConfig, PrefillConfig
from epd.config.settings import peer_endpoint
from epd.config.sources import (
    build,
    flag_values,
    read_config_file,
    resolve,
    role_values,
    secret_env,
    to_flags,
)
from epd.runtime.process import available_cores
from epd.serve import (
    BRIEF_SPIN,
    OPENMP_WAITING,
    busy_threads,
    core_shares,
    in_private_dir,
    openmp_env,
    plan,
)

CONFIGS = Path(__file__).parents[2] / "configs"


def args(*argv: str) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_flag_wins_over_file_wins_over_default(tmp_path):
    path = write(
        tmp_path, "model: /m\ndevice: cuda:1\nprefill:\n  port: 9000\n  token_timeout_s: 5\n"
    )
    config = resolve(PrefillConfig, "prefill", args("prefill", "--config", path, "--port", "9100"))
    assert (config.model, config.device, config.port) == ("/m", "cuda:1", 9100)
    assert config.token_timeout_s == 5.0 and config.encode_timeout_s == 60.0


def test_role_section_overrides_shared_keys(tmp_path):
    path = write(tmp_path, "model: /m\ndevice: cuda:0\nencode:\n  device: cpu\n")
    assert resolve(EncodeConfig, "encode", args("encode", "--config", path)).device == "cpu"
    assert resolve(DecodeConfig, "decode", args("decode", "--config", path)).device == "cuda:0"


@pytest.mark.parametrize("role,config_class", list(ROLES.items()))
def test_every_field_is_a_flag_and_round_trips(role, config_class):
    defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
    config = config_class(**(defaults | {"model": "/m"}))
    assert resolve(config_class, role, args(role, *to_flags(config))) == config


@pytest.mark.parametrize(
    "text,message",
    [
        ("modle: /m\n", "unknown setting 'modle'"),
        ("prefill:\n  prot: 1\n", "prefill.prot is not a setting"),
        ("encode:\n  encoders: [tcp://x:1]\n", "encode.encoders is not a setting"),
        ("prefill:\n  port: eighty\n", "prefill.port must be int"),
        ("decode:\n  max_batch_size: 2.5\n", "decode.max_batch_size must be int"),
        ("trust_remote_code: yes-please\n", "trust_remote_code must be bool"),
        ("prefill: 3\n", "prefill must be a mapping"),
        ("- a\n- b\n", "must hold a mapping"),
        ("prefill: [\n", "not valid YAML"),
    ],
)
def test_bad_files_name_the_key(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        read_config_file(write(tmp_path, text))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--port", "0"], "port=0: must be a port number"),
        (["--dtype", "fp8"], "dtype='fp8': must be one of"),
        (["--token-timeout-s", "-1"], "token_timeout_s=-1.0: must be a positive"),
        (["--encoders", "127.0.0.1:7101"], "encoders=.*must be ZeroMQ addresses"),
        (["--max-images", "0"], "max_images=0: must be at least 1"),
        (["--min-chunk-tokens", "-1"], "min_chunk_tokens=-1: must be 0 .off. or a positive"),
        (["--busy-threads", "-1"], "busy_threads=-1: must be 0 .as threads. or a positive"),
        (["--encode-timeout-s", "nan"], "encode_timeout_s=nan: must be a finite number"),
        (["--token-timeout-s", "inf"], "token_timeout_s=inf: must be a finite number"),
    ],
)
def test_bad_values_name_the_setting(extra, message):
    with pytest.raises(ValueError, match=message):
        resolve(PrefillConfig, "prefill", args("prefill", "--model", "/m", *extra))


def test_missing_model_is_named():
    with pytest.raises(ValueError, match="model is required"):
        resolve(EncodeConfig, "encode", args("encode"))


def test_cli_reports_config_errors_and_exits(tmp_path):
    path = write(tmp_path, "encode:\n  bnd: tcp://127.0.0.1:1\n")
    result = subprocess.run(
        [sys.executable, "-m", "epd.cli", "encode", "--config", path],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "encode.bnd is not a setting" in result.stderr


@pytest.mark.parametrize("name", ["local.yaml", "multi-node.yaml", "compose.yaml"])
def test_shipped_configs_are_valid_for_every_role(name):
    raw = read_config_file(CONFIGS / name)
    for role, config_class in ROLES.items():
        config_class(**({"model": "/m"} | role_values(raw, role)))


def test_multi_node_addresses_connect():
    raw = read_config_file(CONFIGS / "multi-node.yaml")
    prefill = PrefillConfig(**role_values(raw, "prefill"))
    encode, decode = (
        EncodeConfig(**role_values(raw, "encode")),
        DecodeConfig(**role_values(raw, "decode")),
    )
    hosts = {a.rsplit(":", 1)[0] for a in (*prefill.encoders, *prefill.decoders, prefill.advertise)}
    assert len(hosts) == 3  # three nodes
    assert prefill.encoders[0].rsplit(":", 1)[1] == encode.bind.rsplit(":", 1)[1]
    assert prefill.decoders[0].rsplit(":", 1)[1] == decode.bind.rsplit(":", 1)[1]
    assert prefill.advertise.rsplit(":", 1)[1] == prefill.bind.rsplit(":", 1)[1]
    assert {prefill.device, encode.device, decode.device} == {"cuda:0"}


def test_serve_gives_children_the_file_settings_and_its_own_addresses(tmp_path):
    path = write(
        tmp_path,
        "model: /m\nprefill:\n  token_timeout_s: 7\n  port: 1234\ndecode:\n  max_batch_size: 3\n",
    )
    config, children = plan(
        args(
            "serve",
            "--config",
            path,
            "--port",
            "8123",
            "--internal-base-port",
            "9100",
            "--dtype",
            "float32",
        )
    )
    assert children["prefill"].token_timeout_s == 7 and children["prefill"].port == 8123
    assert (
        children["decode"].max_batch_size == 3 and children["decode"].bind == "tcp://127.0.0.1:9102"
    )
    assert children["prefill"].encoders == ("tcp://127.0.0.1:9100",)
    assert {c.dtype for c in children.values()} == {"float32"} and config.port == 8123


def test_serve_gives_each_child_a_share_of_the_cores_unless_set(tmp_path):
    path = write(tmp_path, "model: /m\ndecode:\n  threads: 5\n")
    _, children = plan(args("serve", "--config", path))
    shares = core_shares(available_cores())
    assert children["decode"].threads == 5
    assert children["encode"].threads == shares["encode"]
    assert children["prefill"].threads == shares["prefill"]


@pytest.mark.parametrize(
    ("prefill", "decode", "cores", "busy"),
    [(2, 1, 2, 1), (2, 1, 1, 1), (11, 5, 16, 11), (4, 8, 8, 1)],
)
def test_prefill_runs_beside_decode_on_what_decode_leaves(prefill, decode, cores, busy):
    assert busy_threads(prefill, decode, cores) == busy


def test_serve_sets_prefills_busy_threads_on_a_cpu_unless_given(tmp_path):
    path = write(tmp_path, "model: /m\nprefill:\n  threads: 3\ndecode:\n  threads: 2\n")
    _, children = plan(args("serve", "--config", path))
    assert children["prefill"].busy_threads == busy_threads(3, 2, available_cores())
    _, given = plan(args("serve", "--config", path, "--busy-threads", "2"))
    assert given["prefill"].busy_threads == 2
    _, gpu = plan(args("serve", "--config", path, "--device", "cuda:0"))
    assert gpu["prefill"].busy_threads == 0  # a forward on the GPU: its threads only feed it


def test_serve_lets_encode_and_decode_take_the_idle_cores_on_a_cpu(tmp_path):
    path = write(tmp_path, "model: /m\n")
    _, children = plan(args("serve", "--config", path))
    assert children["encode"].alone_threads == available_cores()
    assert children["encode"].threads == core_shares(available_cores())["encode"]
    assert children["decode"].alone_threads == available_cores()
    _, given = plan(args("serve", "--config", path, "--alone-threads", "1"))
    assert given["encode"].alone_threads == given["decode"].alone_threads == 1
    _, gpu = plan(args("serve", "--config", path, "--device", "cuda:0"))
    assert gpu["encode"].alone_threads == gpu["decode"].alone_threads == 0


@pytest.mark.parametrize(
    ("cores", "encode", "decode", "prefill"),
    [(1, 1, 1, 1), (2, 1, 1, 2), (3, 1, 1, 2), (16, 5, 5, 11)],
)
def test_prefill_gets_the_cores_decode_leaves(cores, encode, decode, prefill):
    assert core_shares(cores) == {"encode": encode, "decode": decode, "prefill": prefill}


def test_a_role_section_wins_over_the_top_level_for_serve_children(tmp_path):
    path = write(tmp_path, "model: /m\ndevice: cpu\nencode:\n  device: cuda:1\n")
    _, children = plan(args("serve", "--config", path))
    assert children["encode"].device == "cuda:1" and children["decode"].device == "cpu"
    _, flagged = plan(args("serve", "--config", path, "--device", "cuda:0"))
    assert {c.device for c in flagged.values()} == {"cuda:0"}  # serve's own flags win


def test_wildcard_bind_needs_an_advertised_address():
    with pytest.raises(ValueError, match="advertise is required"):
        resolve(
            PrefillConfig, "prefill", args("prefill", "--model", "/m", "--bind", "tcp://*:7102")
        )
    config = resolve(
        PrefillConfig,
        "prefill",
        args(
            "prefill",
            "--model",
            "/m",
            "--bind",
            "tcp://0.0.0.0:7102",
            "--advertise",
            "tcp://node2:7102",
        ),
    )
    assert config.reply_address == "tcp://node2:7102"


def test_secrets_travel_in_the_environment_not_on_the_command_line(tmp_path):
    path = write(tmp_path, "model: /m\nprefill:\n  api_key: hush\n")
    _, children = plan(args("serve", "--config", path))
    assert "hush" not in " ".join(to_flags(children["prefill"]))
    assert secret_env(children["prefill"]) == {"EPD_API_KEY": "hush"}
    assert secret_env(children["decode"]) == {}


def test_serve_passes_each_child_setting_to_the_roles_that_have_it(tmp_path):
    path = write(tmp_path, "model: /m\ndecode:\n  max_batch_size: 3\n")
    flags = ("--served-model-name", "kimi", "--max-batch-size", "8", "--max-image-bytes", "99")
    _, children = plan(args("serve", "--config", path, *flags))
    assert children["prefill"].model_name == "kimi"
    assert children["decode"].max_batch_size == 8  # the flag wins over the file
    assert children["encode"].max_image_bytes == children["prefill"].max_image_bytes == 99
    extra = ("--allowed-media-domains", "a.example", "b.example")
    _, children = plan(args("serve", "--config", path, *extra))
    assert children["prefill"].allowed_media_domains == ("a.example", "b.example")
    with pytest.raises(SystemExit):  # serve owns the addresses that join its children
        plan(args("serve", "--config", path, "--decoders", "tcp://10.0.0.1:1"))


def test_a_negative_kv_budget_is_refused():
    with pytest.raises(ValueError, match="max_kv_tokens=-1: must be 0 .automatic. or a positive"):
        resolve(DecodeConfig, "decode", args("decode", "--model", "/m", "--max-kv-tokens", "-1"))


def test_bench_refuses_a_rate_that_is_not_a_number():
    with pytest.raises(ValueError, match="rate=nan: must be a finite number"):
        build(BenchConfig, flag_values(args("bench", "--rate", "nan"), BenchConfig))


def test_a_help_that_names_its_default_is_not_given_a_second(capsys):
    with pytest.raises(SystemExit):
        args("bench", "--help")
    text = " ".join(capsys.readouterr().out.split())
    model = text[text.index("--model MODEL model") : text.index("--api-key API_KEY sent")]
    assert model.count("default") == 1 and "(default: the server's first)" in model


def test_openmp_threads_spin_briefly_on_a_cpu_unless_the_environment_says(monkeypatch):
    for name in OPENMP_WAITING:
        monkeypatch.delenv(name, raising=False)
    assert openmp_env("cpu") == {"GOMP_SPINCOUNT": str(BRIEF_SPIN)}
    assert openmp_env("cuda:0") == {}  # a role of its own GPU: its threads only feed it
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the user's say wins
    assert openmp_env("cpu") == {}


def test_serve_puts_several_prefills_behind_a_router_on_the_api_port():
    config, children = plan(
        args(
            *("serve", "--model", "/m", "--port", "8123", "--internal-base-port", "9100"),
            *("--prefills", "2", "--decoders", "2", "--routing", "least-loaded"),
        )
    )
    assert set(children) == {"encode", "decode", "decode-1", "prefill", "prefill-1", "route"}
    route = children["route"]
    assert route.port == 8123 and route.routing == "least-loaded"
    assert route.prefill_urls == ("http://127.0.0.1:9121", "http://127.0.0.1:9221")
    assert [children[p].port for p in ("prefill", "prefill-1")] == [9121, 9221]
    assert {children[p].host for p in ("prefill", "prefill-1")} == {"127.0.0.1"}
    decoders = ("tcp://127.0.0.1:9102", "tcp://127.0.0.1:9202")
    assert children["prefill-1"].decoders == decoders and children["prefill"].decoders == decoders
    assert children["decode-1"].prefills == ("tcp://127.0.0.1:9101", "tcp://127.0.0.1:9201")
    for name in ("prefill", "prefill-1"):  # each publishes to the router under its own name
        events = json.loads(children[name].kv_events_config)
        assert events["endpoint"] == route.kv_events_bind == "tcp://127.0.0.1:9130"
        assert events["topic"] == name
        assert children[name].max_arriving_bodies_per_client == children[name].max_arriving_bodies
    assert config.count("route") == 1
    # Every prefill follows every decoder's KV events, each decoder's socket its own.
    for name, address in (("decode", decoders[0]), ("decode-1", decoders[1])):
        events = json.loads(children[name].kv_events_config)
        template = children["prefill-1"].decoder_kv_events
        assert events["endpoint"] == peer_endpoint(template, address)
    assert len({children[d].kv_events_config for d in ("decode", "decode-1")}) == 2
    private = in_private_dir(children, "/run/epd-x")  # where `run` puts them: its own directory
    assert json.loads(private["decode"].kv_events_config)["endpoint"].startswith(
        "ipc:///run/epd-x/"
    )
    assert private["prefill"].decoder_kv_events.startswith("ipc:///run/epd-x/")
    assert private["route"] == children["route"]


def test_decoders_events_set_by_the_user_are_not_followed_by_a_guess():
    _, children = plan(
        args(
            *("serve", "--model", "/m", "--decoders", "2"),
            *("--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'),
        )
    )
    assert children["prefill"].decoder_kv_events == ""
    ports = [json.loads(children[d].kv_events_config)["endpoint"] for d in ("decode", "decode-1")]
    assert len(set(ports)) == 2  # offset, as before


def test_one_prefill_needs_no_router():
    _, children = plan(args("serve", "--model", "/m", "--decoders", "3"))
    assert "route" not in children and len(children["prefill"].decoders) == 3
    assert children["prefill"].kv_events_config == ""  # off, as asked
    assert children["prefill"].decoder_kv_events  # but it follows its three decoders'
