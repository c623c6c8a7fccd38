"""`epd bench`'s settings: `vllm bench serve`'s command lines parse into them, where requests go,
and what is refused."""

import math
import shlex

import pytest

from epd.bench.config import BenchConfig
from epd.cli import parser
from epd.config.sources import build, flag_values


def bench(command: str) -> BenchConfig:
    """`epd bench` given a `vllm bench serve` command line's flags."""
    flags = shlex.split(command.removeprefix("vllm bench serve"))
    return build(BenchConfig, flag_values(parser().parse_args(["bench", *flags]), BenchConfig))


def test_a_vllm_sharegpt_command_line_parses_into_the_same_run():
    config = bench(
        "vllm bench serve --backend vllm --model moonshotai/Kimi-VL-A3B-Instruct "
        "--host 10.0.0.2 --port 8001 --endpoint /v1/completions --dataset-name sharegpt "
        "--dataset-path ShareGPT_V3.json --sharegpt-output-len 128 --num-prompts 200 "
        "--max-concurrency 16 --request-rate inf --seed 7 --ignore-eos --num-warmups 2 "
        "--label epd --save-result --result-dir out --result-filename run.json"
    )
    assert (config.model, config.requests, config.concurrency) == (
        "moonshotai/Kimi-VL-A3B-Instruct",
        200,
        16,
    )
    assert math.isinf(config.rate) and (config.seed, config.warmup) == (7, 2)
    assert (config.dataset, config.dataset_path) == ("sharegpt", "ShareGPT_V3.json")
    assert config.sharegpt_output_tokens == 128 and config.ignore_eos and not config.chat
    assert config.request_url == "http://10.0.0.2:8001/v1/completions"
    assert config.api_base == "http://10.0.0.2:8001/v1"
    assert (config.save_result, config.result_dir, config.json) == (True, "out", "run.json")
    assert config.label == "epd"


def test_a_vllm_random_command_line_sets_the_lengths_and_the_rate():
    config = bench(
        "vllm bench serve --backend openai-chat --base-url http://gpu-box:8000 "
        "--endpoint /v1/chat/completions --dataset-name random --random-input-len 512 "
        "--random-output-len 64 --request-rate 4 --num-prompts 100"
    )
    assert (config.prompt_tokens, config.output_tokens, config.rate) == (512, 64, 4.0)
    assert config.dataset == "random" and config.chat and config.concurrency == 0
    assert config.request_url == "http://gpu-box:8000/v1/chat/completions"


@pytest.mark.parametrize(
    ("settings", "url"),
    [
        ({}, "http://127.0.0.1:8000/v1/chat/completions"),
        ({"base_url": "http://h:9/v1"}, "http://h:9/v1/chat/completions"),  # OpenAI's form
        (
            {"base_url": "http://h:9/v1/", "endpoint": "/v1/completions"},
            "http://h:9/v1/completions",
        ),
        (
            {"base_url": "https://h/api", "endpoint": "/v1/completions"},
            "https://h/api/v1/completions",
        ),
        ({"backend": "openai"}, "http://127.0.0.1:8000/v1/completions"),
        ({"host": "::1", "port": 8080}, "http://[::1]:8080/v1/chat/completions"),
    ],
)
def test_requests_go_to_the_base_url_and_the_endpoint_a_v1_written_once(settings, url):
    assert BenchConfig(**settings).request_url == url


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"dataset": "sharegpt"}, "name its JSON file with --dataset-path"),
        ({"dataset_path": "a.json"}, "the random dataset reads no file"),
        ({"dataset": "sonnet"}, "must be one of random, sharegpt"),
        ({"dataset": "sharegpt", "dataset_path": "a.json", "turns": 2}, "one turn"),
        ({"endpoint": "/v1/embeddings"}, "must be a path such as"),
        ({"endpoint": "v1/completions"}, "must be a path such as"),
        ({"endpoint": "/v1/completions", "images": 1}, "takes text only"),
        ({"backend": "openai-chat", "endpoint": "/v1/completions"}, "does not send to"),
        ({"backend": "tgi"}, "must be one of openai-chat, openai, vllm"),
        ({"base_url": "ftp://h"}, "must be an http"),
        ({"host": "h/evil"}, "must be a host name"),
        ({"port": 0}, "must be a port number"),
        ({"rate": -math.inf}, "must be a finite number"),
        ({"rate": math.nan}, "must be a finite number"),
    ],
)
def test_a_setting_that_cannot_run_is_refused_and_named(settings, error):
    with pytest.raises(ValueError, match=error):
        BenchConfig(**settings)
