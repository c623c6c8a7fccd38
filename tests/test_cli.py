"""The `epd` console script, run as a real process."""

import json
import subprocess
import sys

import pytest

from epd.checkpoint.weights import load_model


def epd(*args):
    return subprocess.run([sys.executable, "-m", "epd.cli", *args], capture_output=True, text=True)


def test_make_checkpoint_writes_the_hf_layout(tmp_path):
    out = tmp_path / "ckpt"
    result = epd("make-checkpoint", str(out), "--preset", "tiny", "--seed", "3")
    assert result.returncode == 0, result.stderr
    files = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "preprocessor_config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    } <= files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # sharded
    load_model(out)


def test_seed_makes_checkpoints_reproducible(tmp_path):
    for name in ("a", "b"):
        assert epd("make-checkpoint", str(tmp_path / name), "--seed", "7").returncode == 0
    a, b = load_model(tmp_path / "a").state_dict(), load_model(tmp_path / "b").state_dict()
    assert all((a[k] == b[k]).all() for k in a)


def test_bad_preset_is_refused(tmp_path):
    result = epd("make-checkpoint", str(tmp_path / "x"), "--preset", "huge")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_serve_names_a_taken_internal_port_in_one_line(tiny_checkpoint):
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        result = epd(
            "serve", "--model", str(tiny_checkpoint), "--internal-base-port", str(taken - 1)
        )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"internal port {taken} is in use" in result.stderr
    assert "--internal-base-port" in result.stderr.strip().splitlines()[-1]


def test_make_checkpoint_offers_every_layout_and_likeness():
    from epd.checkpoint.published import PUBLISHED
    from epd.checkpoint.synthetic_tokenizer import LAYOUTS
    from epd.cli import PUBLISHED_NAMES, TOKENIZER_LAYOUTS

    assert TOKENIZER_LAYOUTS == LAYOUTS and tuple(PUBLISHED) == PUBLISHED_NAMES


def test_make_checkpoint_writes_kimis_tiktoken_layout_in_one_file(tmp_path):
    out = tmp_path / "ckpt"
    flags = ("--tokenizer", "tiktoken", "--shards", "1", "--rope-buffers")
    assert epd("make-checkpoint", str(out), *flags).returncode == 0
    files = {p.name for p in out.iterdir()}
    assert {"tiktoken.model", "tokenization_moonshot.py", "model.safetensors"} <= files
    assert "tokenizer.json" not in files and "model.safetensors.index.json" not in files
    load_model(out)


def test_version_prints_the_version():
    import importlib.metadata

    result = epd("--version")
    assert result.returncode == 0 and result.stdout == f"epd {importlib.metadata.version('epd')}\n"


def test_serve_says_a_repository_name_is_no_checkpoint_directory():
    result = epd("serve", "moonshotai/Kimi-VL-A3B-Instruct")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "moonshotai/Kimi-VL-A3B-Instruct is not a directory" in result.stderr


@pytest.mark.parametrize("role", ["epd.encode.server", "epd.decode.server", "epd.api.server"])
def test_no_role_imports_torchs_compiler(role):
    """llguidance.torch and torch.nn.attention.bias each pulled it in: ~2 s of every start."""
    code = f"import sys, {role}\nassert 'torch._dynamo' not in sys.modules, 'the compiler came'\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_serve_plans_its_roles_without_torch(tiny_checkpoint):
    """`epd serve`'s own process parses, plans and supervises: importing torch there took two
    of the ~14 seconds before a stack was ready, before its children began their own."""
    code = (
        "import sys\n"
        "from epd import cli, serve\n"
        f"serve.plan(cli.parser().parse_args(['serve', '--model', {str(tiny_checkpoint)!r}]))\n"
        "assert 'torch' not in sys.modules, 'serve imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
