"""The language model exported as a DeepSeek-V3 checkpoint: the same model, or an error.

transformers' DeepseekV3 hard-codes sigmoid scoring and noaux_tc top-k, and its defaults for the
routing sizes are not ours: the logits agree on the tiny checkpoint, which writes every key, and
say nothing of what an export leaves out. So the exported config is checked field by field (as
transformers and vLLM read it), and the logits on checkpoints that leave keys out, group their
experts, and whose correction bias decides the routing.
"""

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from epd.checkpoint.config import load_model_config
from epd.checkpoint.export import ExportError, export_language_model
from epd.checkpoint.synthetic import (
    PRESETS,
    make_config,
    write_side_files,
    write_weights,
)
from epd.checkpoint.synthetic_tokenizer import write_tokenizer
from epd.checkpoint.weights import load_model
from epd.model.moe import Router

PROMPT = torch.tensor([5, 17, 42, 99, 7, 300, 12, 64, 128, 3, 250, 77, 31])
BIAS_SCALE = 5.0  # the correction bias N(0, 0.1): it, not the scores alone, picks the experts


def kimi_checkpoint(
    out: Path, text: dict[str, Any], omit: tuple[str, ...] = (), seed: int = 0
) -> Path:
    """A tiny Kimi-VL checkpoint (one safetensors file, with the RoPE buffers some hold) whose
    text config has `text` changed and `omit` left out of its config.json, and whose
    e_score_correction_bias is BIAS_SCALE times the usual."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, "appended", 512, 8192)
    config = make_config(PRESETS["tiny"], vocab.size, vocab.ids["<|media_pad|>"], None)
    config = replace(config, text=replace(config.text, **text))
    write_weights(out, config, seed, shards=1, inv_freq=True)
    write_side_files(out, config, vocab)
    state = load_file(out / "model.safetensors")
    for name in state:
        if name.endswith("e_score_correction_bias"):
            state[name] = state[name] * BIAS_SCALE
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    for key in omit:
        del raw["text_config"][key]
    (out / "config.json").write_text(json.dumps(raw))
    return out


# Kimi-VL-A3B's routing (sigmoid, noaux_tc, one group, scaling 2.446, first layer dense).
LIKE_KIMI_VL: dict[str, Any] = {}
# Experts in groups, unnormalised weights, every other layer MoE from layer 1 (so layer 2 alone),
# no shared expert; the keys whose defaults in our model and transformers' differ left out.
GROUPED = dict(
    n_group=4,
    topk_group=2,
    norm_topk_prob=False,
    moe_layer_freq=2,
    routed_scaling_factor=1.0,
    n_shared_experts=0,
)
GROUPED_OMITS = (
    "routed_scaling_factor",
    "q_lora_rank",
    "n_shared_experts",
    "topk_method",
    "scoring_func",
)
# Every layer MoE: first_k_dense_replace left out (our 0, transformers' 3).
ALL_MOE = dict(first_k_dense_replace=0, n_group=2, topk_group=1)
CHECKPOINTS = {
    "like-kimi-vl": (LIKE_KIMI_VL, ()),
    "grouped-keys-left-out": (GROUPED, GROUPED_OMITS),
    "all-moe-first-k-left-out": (ALL_MOE, ("first_k_dense_replace",)),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def kimi(request, tmp_path_factory) -> Path:
    text, omit = CHECKPOINTS[request.param]
    return kimi_checkpoint(tmp_path_factory.mktemp(request.param), text, omit)


@pytest.fixture(scope="module")
def exported(kimi, tmp_path_factory) -> Path:
    return export_language_model(kimi, tmp_path_factory.mktemp("ds") / "ckpt")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.inference_mode()
def our_logits(kimi: Path, zero_bias: bool = False) -> torch.Tensor:
    ours = load_model(kimi, role="language").language_model
    if zero_bias:
        for module in ours.modules():
            if isinstance(module, Router):
                module.e_score_correction_bias.zero_()
    hidden, _ = ours.prefill(ours.embed(PROMPT))
    return ours.logits(hidden)


def test_the_exported_config_says_how_our_model_routes(kimi, exported):
    """Every setting as our model read it, whether the checkpoint wrote it or not; the fields
    vLLM reads with a default of its own (softmax, no correction bias) among them."""
    text = load_model_config(kimi).text
    raw = json.loads((exported / "config.json").read_text())
    assert raw["topk_method"] == "noaux_tc" and raw["scoring_func"] == "sigmoid"
    config = DeepseekV3Config.from_pretrained(exported)
    assert getattr(config, "scoring_func", "softmax") == "sigmoid"  # vLLM's reading
    assert getattr(config, "topk_method", None) == "noaux_tc"  # else vLLM drops the bias
    for key in (
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        "num_experts_per_tok",
        "n_routed_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "q_lora_rank",
        "kv_lora_rank",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        assert getattr(config, key) == getattr(text, key), key
    moe = [i for i in range(text.num_hidden_layers) if text.is_moe_layer(i)]
    dense = config.first_k_dense_replace
    assert list(range(dense, config.num_hidden_layers)) == moe
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": text.rope_theta}
    assert config.rope_interleave and config.num_nextn_predict_layers == 0
    with safe_open(exported / "model.safetensors", framework="pt") as f:
        assert not [n for n in f.keys() if "inv_freq" in n]  # noqa: SIM118 (not a dict)


def test_keys_a_checkpoint_leaves_out_are_exported_as_our_model_reads_them(tmp_path):
    kimi = kimi_checkpoint(tmp_path / "kimi", GROUPED, GROUPED_OMITS)
    raw = json.loads((export_language_model(kimi, tmp_path / "ds") / "config.json").read_text())
    # transformers' defaults: 2.5, 1536, 1, first_k_dense_replace 3
    assert raw["routed_scaling_factor"] == 1.0 and raw["q_lora_rank"] is None
    assert raw["n_shared_experts"] == 0
    assert (raw["n_group"], raw["topk_group"], raw["norm_topk_prob"]) == (4, 2, False)
    assert (raw["first_k_dense_replace"], raw["moe_layer_freq"]) == (2, 1)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # no shared expert
@torch.inference_mode()
def test_the_exported_model_gives_our_logits(kimi, exported):
    oracle = DeepseekV3ForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    expected = oracle(PROMPT[None]).logits[0]
    ours = our_logits(kimi)
    assert rel_err(ours, expected) <= 1e-4
    # The bias decides routes here: an export that lost it (as vLLM does without topk_method
    # "noaux_tc") would not pass.
    assert rel_err(our_logits(kimi, zero_bias=True), expected) > 1e-2


def edited(tiny_checkpoint: Path, tmp_path: Path, **text: Any) -> Path:
    out = shutil.copytree(tiny_checkpoint, tmp_path / "kimi")
    raw = json.loads((out / "config.json").read_text())
    raw["text_config"].update(text)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize(
    "text,field",
    [
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(topk_method="greedy"), "topk_method='greedy'"),
        (dict(topk_method="group_limited_greedy"), "topk_method"),
        # MoE layers 0 and 2 of 3: DeepSeek-V3's are all those from one on
        (dict(first_k_dense_replace=0, moe_layer_freq=2), "moe_layer_freq=2"),
    ],
)
def test_what_deepseek_v3_cannot_express_is_refused_naming_the_field(
    tiny_checkpoint, tmp_path, text, field
):
    kimi = edited(tiny_checkpoint, tmp_path, **text)
    with pytest.raises(ExportError, match=field.replace("(", r"\(")):
        export_language_model(kimi, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
