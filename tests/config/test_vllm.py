"""vLLM's command lines: each vLLM flag sets the epd setting it stands for, in every role."""

import argparse
import json
import re

import pytest

from epd.cli import parser
from epd.config.roles import DecodeConfig, PrefillConfig
from epd.config.sources import read_config_file, resolve, role_values
from epd.serve import plan

# Kimi-VL's own recipe (its README), with `vllm` replaced by `epd` and a local checkpoint.
RECIPE = (
    "serve /m --served-model-name kimi-vl --trust-remote-code --tensor-parallel-size 1 "
    "--max-num-batched-tokens 32768 --max-model-len 32768 --limit-mm-per-prompt image=64"
)
CHILDREN = ("encode", "prefill", "decode")


def args(*argv: str) -> argparse.Namespace:
    return parser().parse_args(list(argv))


def children(*argv: str) -> dict:
    return plan(args("serve", *argv))[1]


def refused(capsys, *argv: str) -> str:
    """The error argparse gives for a command line it refuses (exit code 2)."""
    with pytest.raises(SystemExit) as exit:
        args(*argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_kimi_vls_vllm_recipe_sets_each_role():
    encode, prefill, decode = (children(*RECIPE.split()[1:])[r] for r in CHILDREN)
    assert {c.model for c in (encode, prefill, decode)} == {"/m"}
    assert prefill.model_name == "kimi-vl" and prefill.trust_remote_code
    assert prefill.max_prefill_tokens == 32768
    assert prefill.max_model_len == decode.max_model_len == 32768
    assert prefill.max_images == encode.max_images == 64


def test_the_model_may_come_first_in_every_role():
    assert resolve(DecodeConfig, "decode", args("decode", "/m")).model == "/m"
    assert resolve(PrefillConfig, "prefill", args("prefill", "--port", "9000", "/m")).model == "/m"
    assert children("/m", "--model", "/m")["encode"].model == "/m"  # the same twice is one


def test_two_different_models_are_an_error():
    with pytest.raises(ValueError, match="two models: /a first, and --model /b"):
        children("/a", "--model", "/b")


@pytest.mark.parametrize(
    "given,images",
    [("image=4", 4), ("image=4,video=0", 4), (" image = 5 ", 5), ('{"image": 6}', 6)],
)
def test_limit_mm_per_prompt_in_either_form_is_max_images(given, images):
    encode, prefill = (children("/m", "--limit-mm-per-prompt", given)[r] for r in CHILDREN[:2])
    assert encode.max_images == prefill.max_images == images


@pytest.mark.parametrize(
    "given,message",
    [
        ("video=2", "epd takes images only"),
        ('{"image": 2, "audio": 1}', "epd takes images only"),
        ("image=many", "is not image=N"),
        ('{"image": ', "is not image=N"),
        ('{"image": true}', "gives no whole number of images"),
        ("video=0", "gives no whole number of images"),
    ],
)
def test_a_limit_epd_cannot_keep_is_refused(capsys, given, message):
    assert message in refused(capsys, "serve", "/m", "--limit-mm-per-prompt", given)


def test_no_images_is_refused_by_name():
    with pytest.raises(ValueError, match="max_images=0: must be at least 1"):
        children("/m", "--limit-mm-per-prompt", "image=0")


def test_max_num_seqs_is_decodes_batch():
    assert children("/m", "--max-num-seqs", "8")["decode"].max_batch_size == 8


def test_tensor_parallel_size_is_one_device_or_an_error(capsys):
    assert children("/m", "-tp", "1")["decode"].model == "/m"
    error = refused(capsys, "serve", "/m", "--tensor-parallel-size", "2")
    assert "--tensor-parallel-size" in error and "one device" in error


@pytest.mark.parametrize("share", ["0.5", "1", "0"])
def test_gpu_memory_utilization_is_a_share_for_decode(share):
    assert children("/m", "--gpu-memory-utilization", share)["decode"].gpu_memory_utilization == (
        float(share)
    )


@pytest.mark.parametrize("share", ["1.5", "-0.1", "nan"])
def test_gpu_memory_utilization_past_the_whole_is_refused(share):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        children("/m", "--gpu-memory-utilization", share)


def test_max_model_len_zero_is_the_checkpoints_and_a_negative_is_refused():
    assert children("/m")["decode"].max_model_len == 0
    for automatic in ("auto", "-1"):  # vLLM's spellings of its automatic length
        assert children("/m", "--max-model-len", automatic)["decode"].max_model_len == 0
    with pytest.raises(ValueError, match="max_model_len=-2: must be 0"):
        children("/m", "--max-model-len", "-2")


def test_prefix_caching_is_on_unless_turned_off():
    assert children("/m")["prefill"].enable_prefix_caching
    assert not children("/m", "--no-enable-prefix-caching")["prefill"].enable_prefix_caching
    assert children("/m", "--enable-prefix-caching")["prefill"].enable_prefix_caching


def test_prefill_takes_the_api_servers_flags():
    prefill = children(
        "/m",
        *("--chat-template", "templates/kimi.jinja", "--uvicorn-log-level", "trace"),
        "--disable-log-requests",
    )["prefill"]
    assert prefill.chat_template == "templates/kimi.jinja"
    assert prefill.uvicorn_log_level == "trace" and prefill.disable_log_requests
    with pytest.raises(ValueError, match="uvicorn_log_level='loud': must be one of debug"):
        children("/m", "--uvicorn-log-level", "loud")


@pytest.mark.parametrize(
    "given,origins",
    [
        (['["*"]'], ("*",)),
        (
            ['["https://a.example", "https://b.example"]'],
            ("https://a.example", "https://b.example"),
        ),
        (["https://a.example", "https://b.example"], ("https://a.example", "https://b.example")),
        (["https://a.example https://b.example"], ("https://a.example", "https://b.example")),
        (["[]"], ()),
    ],
)
def test_allowed_origins_take_vllms_json_list_and_words(given, origins):
    assert children("/m", "--allowed-origins", *given)["prefill"].allowed_origins == origins


@pytest.mark.parametrize(
    "value,origins",
    [
        ("'[\"*\"]'", ("*",)),
        ("https://a.example https://b.example", ("https://a.example", "https://b.example")),
        ("[https://a.example]", ("https://a.example",)),  # a YAML list
    ],
)
def test_allowed_origins_in_a_config_file_take_either_form(tmp_path, value, origins):
    path = tmp_path / "c.yaml"
    path.write_text(f"prefill:\n  allowed_origins: {value}\n")
    assert role_values(read_config_file(path), "prefill")["allowed_origins"] == origins


def test_a_list_that_is_not_json_is_refused():
    with pytest.raises(ValueError, match="allowed_origins: '\\[\"\\*\"' is not a JSON list"):
        children("/m", "--allowed-origins", '["*"')


def test_an_unknown_flag_is_an_error_with_the_subcommands_usage(capsys):
    error = refused(capsys, "serve", "/m", "--swap-spaces", "4")
    assert "epd serve: error: unrecognized arguments: --swap-spaces 4" in error
    assert error.startswith("usage: epd serve ")


@pytest.mark.parametrize("role", ["serve", "prefill", "decode", "encode"])
def test_flags_asking_for_what_epd_does_anyway_are_accepted(role):
    parsed = args(
        role,
        "/m",
        *("--enforce-eager", "--disable-log-stats", "--enable-chunked-prefill"),
        *("--kv-cache-dtype", "auto", "--load-format", "safetensors", "--block-size", "16"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2", "-pp", "1", "-dp", "1"),
    )
    assert parsed.model_path == "/m"


@pytest.mark.parametrize(
    "argv,says",
    [
        (("--quantization", "fp8"), "-q/--quantization: epd runs the checkpoint's weights"),
        (("--enable-lora",), "--enable-lora/--lora-modules: epd serves no LoRA adapters"),
        (("--kv-transfer-config", "{}"), "epd hands KV from prefill to decode itself"),
        (("--tokenizer", "x/y"), "reads the tokenizer from the checkpoint directory"),
        (("--kv-cache-dtype", "fp8"), "fp8: accepted as auto only"),
        (("--block-size", "32"), "epd's KV blocks hold 16 tokens"),
        (("--tool-call-parser", "hermes"), "accepted as kimi_k2 only"),
        (("--pipeline-parallel-size", "2"), "one device"),
    ],
)
def test_flags_for_what_epd_does_not_do_say_what_it_does_instead(capsys, argv, says):
    error = refused(capsys, "serve", "/m", *argv)
    assert "epd serve: error:" in error and says in error


@pytest.mark.parametrize(
    "given,tokens",
    [
        ("32768", 32768),
        ("32k", 32000),
        ("32K", 32768),
        ("1M", 2**20),
        ("1m", 10**6),
        ("1.5k", 1500),
    ],
)
def test_max_model_len_takes_vllms_suffixes(given, tokens):
    prefill, decode = (children("/m", "--max-model-len", given)[r] for r in CHILDREN[1:])
    assert prefill.max_model_len == decode.max_model_len == tokens


@pytest.mark.parametrize("given", ["1.5K", "32x", "k", ""])
def test_max_model_len_that_is_no_count_is_refused(capsys, given):
    assert "is not a whole number such as 32768" in refused(
        capsys, "serve", "/m", "--max-model-len", given
    )


@pytest.mark.parametrize(
    "given,dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")]
)
def test_dtype_takes_vllms_names(given, dtype):
    assert {c.dtype for c in children("/m", "--dtype", given).values()} == {dtype}


def test_served_model_name_takes_several_and_every_role_carries_the_first():
    configs = children("/m", "--served-model-name", "kimi", "kimi-vl")
    assert {c.model_name for c in configs.values()} == {"kimi"}
    assert configs["prefill"].model_names == ("kimi", "kimi-vl", "/m")


def test_enable_log_requests_is_the_inverse_of_disable():
    assert not children("/m", "--enable-log-requests")["prefill"].disable_log_requests
    assert children("/m", "--no-enable-log-requests")["prefill"].disable_log_requests


@pytest.mark.parametrize(
    "given,says",
    [
        ("[1]", "must be a JSON object of temperature"),
        ("{", "must be a JSON object"),
        ('{"stop": 1}', "must be a JSON object"),
        ('{"temperature": "hot"}', "must give each field a number"),
    ],
)
def test_override_generation_config_is_checked_before_any_role_starts(given, says):
    ok = '{"temperature": 0.6, "max_new_tokens": 9}'
    assert (
        children("/m", "--override-generation-config", ok)["prefill"].override_generation_config
        == ok
    )
    with pytest.raises(ValueError, match=f"override_generation_config=.*: {says}"):
        children("/m", "--override-generation-config", given)


def test_kv_events_config_reaches_prefill_and_decode_as_given():
    given = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv-events"}'
    configs = children("/m", "--kv-events-config", given)
    assert configs["prefill"].kv_events_config == given
    decode = json.loads(configs["decode"].kv_events_config)  # its own port: the next one
    assert decode == json.loads(given) | {"endpoint": "tcp://*:5558"}
    assert children("/m")["decode"].kv_events_config == ""  # off


@pytest.mark.parametrize(
    "given,says",
    [
        ('{"enable_kv_cache_events": true, "topc": "x"}', "has unknown keys topc; known: enable"),
        ("[]", "must be a JSON object of enable_kv_cache_events, publisher"),
        ("{", "must be a JSON object"),
    ],
)
def test_kv_events_config_is_checked_before_any_role_starts(given, says):
    with pytest.raises(ValueError, match=f"kv_events_config=.*: {re.escape(says)}"):
        children("/m", "--kv-events-config", given)


def test_generation_config_is_auto_vllm_or_a_folder_with_one(tmp_path):
    with pytest.raises(ValueError, match="generation_config=.*: must be auto, vllm or a dir"):
        children("/m", "--generation-config", str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{}")
    assert children("/m", "--generation-config", str(tmp_path))["prefill"].generation_config


def test_seed_and_generation_config_reach_prefill(tmp_path):
    prefill = children("/m", "--seed", "7", "--generation-config", "vllm")["prefill"]
    assert prefill.seed == 7 and prefill.generation_config == "vllm"
    with pytest.raises(ValueError, match="seed=-2: must be -1"):
        children("/m", "--seed", "-2")


def test_allowed_local_media_path_must_be_a_directory(tmp_path):
    given = children("/m", "--allowed-local-media-path", str(tmp_path))["prefill"]
    assert given.allowed_local_media_path == str(tmp_path)
    with pytest.raises(ValueError, match="allowed_local_media_path=.*must be a directory"):
        children("/m", "--allowed-local-media-path", str(tmp_path / "none"))


def test_revision_and_download_dir_reach_every_role():
    configs = children("/m", "--revision", "v1", "--download-dir", "/cache")
    assert {(c.revision, c.download_dir) for c in configs.values()} == {("v1", "/cache")}


def test_help_says_what_each_vllm_flag_maps_to(capsys):
    with pytest.raises(SystemExit):
        args("serve", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-batch-size MAX_BATCH_SIZE, --max-num-seqs MAX_BATCH_SIZE" in text
    assert "--max-prefill-tokens MAX_PREFILL_TOKENS, --max-num-batched-tokens" in text
    assert "--limit-mm-per-prompt VALUE --max-images in vLLM's form" in text
    assert "vLLM: --gpu-memory-utilization" in text and "accepted as 1 only" in text
    assert "--enforce-eager vLLM's flag, accepted: epd captures no CUDA graphs" in text
