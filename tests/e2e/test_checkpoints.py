"""Checkpoints in every layout real models ship, each through the three-process stack (real
processes, the openai client) and equal token for token to the one-process path, in float32.

The matrix: a tokenizer.json with its special tokens inside the vocabulary (after it: the
session's checkpoint, `test_stack.py`), Kimi's tiktoken files; one weights file and shards;
float32 and bfloat16 weights; RoPE `inv_freq` buffers; q_lora_rank null and set; and
Kimi-VL-A3B-Thinking-2506 in its likeness: its published config.json at its real widths
(vocabulary 163,840, 64 experts top-6, 2 shared, a 512-wide latent, a 1152-wide vision tower),
the depth cut to a dense and an MoE layer and one vision block (`epd.checkpoint.published`);
-Instruct's and -Thinking's likenesses by what their chat templates get from the reasoning
parser.
"""

from __future__ import annotations

import json
import multiprocessing
import urllib.request
from concurrent.futures import ProcessPoolExecutor

import jsonschema
import openai
import pytest
import torch
from PIL import Image

from epd.checkpoint.published import make_published
from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.reasoning import PARSERS, Split, markers_for
from epd.local import LocalPipeline

from ..checkpoint.test_hub import COMMIT, REPOSITORY, lay_out_cache
from .stack import cluster, data_url, free_base, health, image_part, serve, text_part

TINY = {
    "specials inside the vocabulary": {"tokenizer": "inside"},
    "one weights file, bfloat16 weights, RoPE buffers, q_lora": {
        "shards": 1,
        "dtype": torch.bfloat16,
        "inv_freq": True,
        "q_lora_rank": 24,
    },
    "Kimi's tiktoken files": {"tokenizer": "tiktoken"},
}
PUBLISHED = ("Kimi-VL-A3B-Instruct", "Kimi-VL-A3B-Thinking", "Kimi-VL-A3B-Thinking-2506")
SCHEMA = {
    "type": "object",
    "properties": {"shape": {"enum": ["circle", "square"]}},
    "required": ["shape"],
    "additionalProperties": False,
}
IMAGE = data_url(Image.new("RGB", (84, 56), "red"))  # (4, 6) patches: 6 tokens
REQUESTS = {
    "text": {
        "messages": [{"role": "user", "content": "What colour is it? 中文English naïve"}],
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 2,
    },
    "image": {
        "messages": [{"role": "user", "content": [image_part(IMAGE), text_part("Colour?")]}],
        "max_tokens": 8,
        "logprobs": True,
    },
    "structured": {
        "messages": [{"role": "user", "content": "Which shape?"}],
        "max_tokens": 12,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    },
    "continued": {  # an answer begun inside its reasoning: a thinking model's reply reasons on
        "messages": [
            {"role": "user", "content": "Colour?"},
            {"role": "assistant", "content": "◁think▷ I see"},
        ],
        "max_tokens": 6,
        "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
    },
}
OPENED = {"continued"}  # the requests whose prompt opens the reasoning
# n-gram drafts from a single token on: a short random-weight reply still meets some
SPECULATIVE = (
    "--speculative-config",
    json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
)
TOKENIZED = "中文English混合 naïve I'LL 12345 <|im_end|>"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The three published likenesses; the Thinking ones share the Instruct one's weights."""
    root = tmp_path_factory.mktemp("published")
    instruct = make_published(root / PUBLISHED[0], PUBLISHED[0])
    made = {PUBLISHED[0]: instruct}
    for name in PUBLISHED[1:]:
        made[name] = make_published(root / name, name, weights=instruct)
    return made


def expected(checkpoint, copies=True):
    """Each request served by the one-process path, in a process of its own whose memory is
    given back before the stack loads (at real widths both would not fit beside each other)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(serve_locally, checkpoint, copies).result()


def serve_locally(checkpoint, copies):
    torch.set_num_threads(2)
    local = LocalPipeline(checkpoint, dtype=torch.float32, cpu_weight_copies=copies)
    found = {
        name: local.chat({"model": "m", "temperature": 0, **flat(body)})
        for name, body in REQUESTS.items()
    }
    return found, local.builder.tokenizer.encode(TOKENIZED, add_special_tokens=False)


def served(checkpoint, copies=True, decode=()):
    """The requests through the three processes; `decode`: that role's own flags."""
    flags = ("--dtype", "float32", *(() if copies else ("--no-cpu-weight-copies",)))
    roles = {"decode": decode}
    with cluster(checkpoint, flags=flags, one_by_one=not copies, role_flags=roles) as (
        processes,
        client,
        base,
    ):
        replies = {
            name: client.chat.completions.create(model="tiny", temperature=0, **body)
            for name, body in REQUESTS.items()
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{base + 20}/tokenize",
            data=json.dumps({"prompt": TOKENIZED, "add_special_tokens": False}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            tokenized = json.loads(response.read())["tokens"]
        output = {name: process.output for name, process in processes.items()}
        output["decode /health"] = json.dumps(health(base + 12)[1])
    return replies, tokenized, output


def flat(body):
    """A request as the openai client sends it: its `extra_body` among the other fields."""
    return {k: v for k, v in body.items() if k != "extra_body"} | body.get("extra_body", {})


def said(message) -> tuple[str | None, str]:
    """A message's reasoning (None without a reasoning parser) and its content."""
    return (message.model_extra or {}).get("reasoning"), message.content or ""


def parsed(text, name, thinking):
    """The one-process path's text as the API gives it: split by the parser where it is on."""
    if not thinking:
        return None, text
    split = Split(PARSERS["kimi_vl"], name in OPENED)
    (reasoning, answer), (held_reasoning, held_answer) = split.feed(text), split.finish()
    return (reasoning + held_reasoning) or None, answer + held_answer


def check_equal(replies, tokenized, found, tokens, thinking=False):
    for name, reply in replies.items():
        choice, local = reply.choices[0], found[name]
        reasoning, content = said(choice.message)
        expected_reasoning, expected_content = parsed(local.text, name, thinking)
        assert (reasoning, content) == (expected_reasoning, expected_content), name
        assert choice.finish_reason == local.finish_reason, name
        assert reply.usage.completion_tokens == len(local.token_ids), name
        assert reply.usage.prompt_tokens == local.prompt_tokens, name
        if choice.logprobs:
            ours = [t.token for t in choice.logprobs.content]
            assert ours == [e.token for d in local.deltas for e in d.logprobs], name
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
                [e.logprob for d in local.deltas for e in d.logprobs], abs=1e-4
            )
    assert tokenized == tokens


@pytest.mark.parametrize("case", list(TINY))
def test_a_layout_serves_as_the_one_process_path(case, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "c", "tiny", seed=4, **TINY[case])
    found, tokens = expected(checkpoint)
    replies, tokenized, _ = served(checkpoint)
    check_equal(replies, tokenized, found, tokens)
    structured = json.loads(replies["structured"].choices[0].message.content)
    jsonschema.validate(structured, SCHEMA)


# One of the three serves here (~2 minutes of the suite each): -Thinking differs from
# -Thinking-2506 only in its image processor's token limit (a unit of
# multimodal/image_processor's), and -Instruct in its chat template, which the next test reads.
def test_the_thinking_2506_likeness_serves_at_real_widths(published):
    """Kimi's own layout at the real vocabulary (special tokens from 163584), no remote code;
    the replies come through the reasoning parser, on by default for a thinking model. Its
    decoder verifies n-gram drafts (speculative decoding): the replies are still the
    one-process path's, which has none."""
    checkpoint = published[PUBLISHED[2]]
    assert (checkpoint / "tokenization_moonshot.py").is_file()
    assert not (checkpoint / "tokenizer.json").exists()
    found, tokens = expected(checkpoint, copies=False)
    replies, tokenized, output = served(checkpoint, copies=False, decode=SPECULATIVE)
    check_equal(replies, tokenized, found, tokens, thinking=True)
    assert json.loads(output["decode /health"])["speculative"]["draft_tokens"] > 0
    # A reply begun inside its reasoning reasons all the way (random weights).
    continued = replies["continued"].choices[0].message
    assert continued.model_extra["reasoning"] and continued.content is None
    assert "reasoning parser" in output["prefill"]
    assert "tokenizer code" not in "".join(output.values())  # no remote code ran


@pytest.mark.parametrize("name", PUBLISHED)
def test_only_the_thinking_likenesses_get_the_reasoning_parser(name, published):
    """What `auto` gives each published likeness: the serving path is the one above, at the
    same widths, with the markers or without."""
    checkpoint = published[name]
    tokenizer = load_tokenizer(checkpoint)
    markers = markers_for("auto", checkpoint, tokenizer.chat_template or "")
    assert markers == (PARSERS["kimi_vl"] if "Thinking" in name else None)


def test_every_role_starts_where_the_grammar_engine_cannot_be_built(checkpoint_in):
    """A WordPiece tokenizer serves text, but llguidance cannot read it: each role starts and
    says so once, text is served, and a request for structured output gets a 400 with why."""
    with cluster(checkpoint_in("wordpiece")) as (processes, client, _):
        messages = [{"role": "user", "content": "what colour is the circle?"}]
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 6
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="tiny", messages=messages, response_format={"type": "json_object"}
            )
        assert refused.value.code == "structured_outputs_unavailable"
        assert "llguidance cannot read this model's tokenizer" in refused.value.message
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert again.usage.completion_tokens == 2
        outputs = {name: process.output for name, process in processes.items()}
    for name in ("prefill", "decode"):
        warned = "WARNING epd.generation.grammar: structured outputs are unavailable"
        assert outputs[name].count(warned) == 1, outputs[name]


@pytest.mark.parametrize("layout", ["inside", "tiktoken"])
def test_epd_serve_serves_each_layout_without_remote_code(checkpoint_in, layout, tmp_path):
    """Kimi's own layout (tiktoken) as a user has it: by repository name, from the Hugging
    Face cache, offline; the other from its directory."""
    base, env, model = free_base(), {}, checkpoint_in(layout)
    if layout == "tiktoken":
        lay_out_cache(tmp_path, model, {"main": COMMIT})
        env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
        model = REPOSITORY
    process = serve(model, base, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-")
        (card,) = client.models.list().data
        assert card.id == (REPOSITORY if layout == "tiktoken" else model.name)
        reply = client.chat.completions.create(
            model=card.id,
            messages=[{"role": "user", "content": "Which shape?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
            max_tokens=12,
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    finally:
        assert process.stop() == 0, process.output
    assert "tokenizer code" not in process.output
