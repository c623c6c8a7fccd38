"""Strict, role-aware loading of checkpoint tensors."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import epd.checkpoint.weights as weights
from epd.checkpoint import progress
from epd.checkpoint.config import CheckpointError
from epd.checkpoint.progress import size
from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model, tensor_files
from tests.kv.pooled import loaded, pool_for, step


def all_names(checkpoint: Path) -> set[str]:
    return set(tensor_files(checkpoint))


def test_roles_hold_only_their_part(tiny_checkpoint):
    names = all_names(tiny_checkpoint)
    encode = set(load_model(tiny_checkpoint, role="encode").state_dict())
    language = set(load_model(tiny_checkpoint, role="language").state_dict())
    assert encode == {n for n in names if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert language == {n for n in names if n.startswith("language_model.")}
    assert encode | language == names and not encode & language
    assert set(load_model(tiny_checkpoint, role="all").state_dict()) == names


def test_roles_read_only_their_tensors(tiny_checkpoint, monkeypatch):
    read: list[str] = []

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(weights, "safe_open", Spy)
    load_model(tiny_checkpoint, role="encode")
    assert read and all(not n.startswith("language_model.") for n in read)
    read.clear()
    load_model(tiny_checkpoint, role="language")
    assert read and all(n.startswith("language_model.") for n in read)


def test_names_are_the_real_kimi_vl_names(tiny_checkpoint, tiny_q_lora_checkpoint):
    names = all_names(tiny_checkpoint)
    for expected in [
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.0.wqkv.bias",
        "vision_tower.encoder.blocks.1.mlp.fc1.weight",
        "vision_tower.encoder.final_layernorm.weight",
        "multi_modal_projector.pre_norm.weight",
        "multi_modal_projector.linear_2.bias",
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.1.mlp.gate.e_score_correction_bias",
        "language_model.model.layers.1.mlp.experts.7.down_proj.weight",
        "language_model.model.layers.1.mlp.shared_experts.up_proj.weight",
        "language_model.model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
        "language_model.model.layers.2.self_attn.q_proj.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
    ]:
        assert expected in names
    q_lora = all_names(tiny_q_lora_checkpoint)
    assert "language_model.model.layers.0.self_attn.q_a_layernorm.weight" in q_lora
    assert not any(n.endswith("q_proj.weight") for n in q_lora)


def rewrite(checkpoint: Path, out: Path, edit) -> Path:
    """Copy a checkpoint and let `edit` change its tensors; new tensors join the first shard."""
    shutil.copytree(checkpoint, out)
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    state = {}
    for shard in shards:
        state |= load_file(out / shard)
    edit(state)
    placed = {name: index["weight_map"].get(name, shards[0]) for name in state}
    for shard in shards:
        save_file({n: t for n, t in state.items() if placed[n] == shard}, out / shard)
    index_file.write_text(json.dumps(index | {"weight_map": placed}))
    return out


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    ckpt = rewrite(
        tiny_checkpoint, tmp_path / "c", lambda s: s.pop("vision_tower.patch_embed.proj.bias")
    )
    with pytest.raises(CheckpointError, match="missing tensor vision_tower.patch_embed.proj.bias"):
        load_model(ckpt, role="encode")
    load_model(ckpt, role="language")  # the other role does not need it


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path):
    ckpt = rewrite(
        tiny_checkpoint, tmp_path / "c", lambda s: s.update({"vision_tower.extra": torch.ones(2)})
    )
    with pytest.raises(CheckpointError, match="unexpected tensor vision_tower.extra"):
        load_model(ckpt, role="encode")


def test_foreign_tensor_is_unexpected_in_every_role(tiny_checkpoint, tmp_path):
    ckpt = rewrite(
        tiny_checkpoint, tmp_path / "c", lambda s: s.update({"mystery.weight": torch.ones(2)})
    )
    for role in ("encode", "language"):
        with pytest.raises(CheckpointError, match="unexpected tensor mystery.weight"):
            load_model(ckpt, role=role)


def test_misshapen_tensor_is_named(tiny_checkpoint, tmp_path):
    name = "vision_tower.encoder.final_layernorm.weight"
    ckpt = rewrite(tiny_checkpoint, tmp_path / "c", lambda s: s.update({name: torch.ones(7)}))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(7,\), expected \(32,\)"):
        load_model(ckpt, role="encode")


def test_rotary_inv_freq_buffers_are_skipped(tiny_checkpoint, tmp_path):
    key = "language_model.model.layers.0.self_attn.rotary_emb.inv_freq"
    ckpt = rewrite(tiny_checkpoint, tmp_path / "c", lambda s: s.update({key: torch.ones(4)}))
    load_model(ckpt, role="language")


def test_single_file_checkpoint_loads(tiny_checkpoint, tmp_path):
    out = tmp_path / "single"
    shutil.copytree(tiny_checkpoint, out)
    state = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        state |= load_file(shard)
        shard.unlink()
    (out / "model.safetensors.index.json").unlink()
    save_file(state, out / "model.safetensors")
    model = load_model(out)
    torch.testing.assert_close(
        model.state_dict()["language_model.lm_head.weight"], state["language_model.lm_head.weight"]
    )


def test_dtype_is_an_option_and_routing_stays_float32(tiny_checkpoint):
    model = load_model(tiny_checkpoint, role="language", dtype=torch.bfloat16)
    params = dict(model.state_dict())
    assert params["language_model.model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert params["language_model.model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert (
        params["language_model.model.layers.1.mlp.gate.e_score_correction_bias"].dtype
        == torch.float32
    )
    with torch.inference_mode():
        lm = model.language_model
        _, rows = lm.prefill(lm.embed(torch.tensor([1, 2, 3])))
        pool = pool_for(lm)
        table = loaded(pool, rows)
        step(lm, pool, [table], torch.tensor([4]))
    assert pool.storage.dtype == torch.bfloat16 and table.length == 4


@pytest.mark.parametrize(
    ("device", "stored", "bf16_cpu", "expected"),
    [
        ("cpu", None, True, torch.float32),
        ("cpu", "float32", True, torch.float32),
        ("cpu", "bfloat16", True, torch.bfloat16),  # Kimi-VL's own, where oneDNN runs it
        ("cpu", "bfloat16", False, torch.float32),
        ("cpu", "float16", True, torch.float32),
        ("cuda", "float32", True, torch.bfloat16),
        ("cuda", "bfloat16", True, torch.bfloat16),
        ("cuda", "float16", True, torch.float16),
        ("meta", "bfloat16", True, torch.float32),
    ],
)
def test_auto_dtype_is_the_checkpoints_own_where_the_device_runs_it(
    monkeypatch, device, stored, bf16_cpu, expected
):
    monkeypatch.setattr(weights.cpu, "runs_bfloat16", lambda: bf16_cpu)
    assert weights.default_dtype(torch.device(device), stored) == expected


def test_auto_reads_the_dtype_config_json_names(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(weights.cpu, "runs_bfloat16", lambda: True)
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"  # as Kimi-VL's; the tensors stay float32 in the files
    (ckpt / "config.json").write_text(json.dumps(config))
    lm = load_model(ckpt, role="language").language_model
    assert lm.lm_head.weight.dtype == torch.bfloat16
    assert (
        load_model(ckpt, role="language", dtype=torch.float32).language_model.lm_head.weight.dtype
        == torch.float32
    )
    del config["torch_dtype"]
    config["dtype"] = "bfloat16"  # the key newer transformers write
    (ckpt / "config.json").write_text(json.dumps(config))
    assert load_model(ckpt, role="language").language_model.lm_head.weight.dtype == torch.bfloat16


def test_missing_index_file_is_named(tiny_checkpoint, tmp_path):
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "c")
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="model-00002-of-00002.safetensors is named by the index"
    ):
        load_model(ckpt)


@pytest.mark.parametrize("header", [b"\xff" * 16, (4).to_bytes(8, "little") + b"nope"])
def test_a_file_that_is_not_safetensors_is_named(tiny_checkpoint, tmp_path, header):
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "c")
    (ckpt / "model-00002-of-00002.safetensors").write_bytes(header)
    with pytest.raises(CheckpointError, match="00002.safetensors is not a safetensors file"):
        load_model(ckpt)


@pytest.fixture
def said(caplog):
    caplog.set_level(logging.INFO, logger=progress.__name__)
    return lambda: [r.getMessage() for r in caplog.records if r.name == progress.__name__]


def test_a_sharded_load_says_how_far_it_has_come_file_by_file(tmp_path, monkeypatch, said):
    ckpt = make_checkpoint(tmp_path, "tiny", seed=0, shards=3)
    monkeypatch.setattr(progress, "MIN_GAP_S", 0.0)  # a line after every tensor
    monkeypatch.setattr(progress, "MAX_GAP_S", 0.0)
    load_model(ckpt, role="all", copies=False)
    shards = sorted(ckpt.glob("model-*.safetensors"))
    total = size(sum(t.nbytes for shard in shards for t in load_file(shard).values()))
    first, *lines, last = said()
    assert first == f"loading 3 weight files ({total}) from {ckpt}"
    files = [int(line.split("file ")[1].split(" of 3")[0]) for line in lines]
    assert files == sorted(files) and set(files) == {1, 2, 3}
    assert last.startswith(f"loaded 3 files, {total} in ")


def test_a_load_for_a_cpu_says_it_reads_then_packs(tiny_checkpoint, said):
    load_model(tiny_checkpoint, role="language")
    assert [line.split(" ")[0] for line in said()] == ["loading", "loaded", "packing", "packed"]
    assert said()[2].startswith("packing weights for oneDNN")
    assert said()[3].startswith("packed the weights of ")
