"""The router names a request's blocks as prefill will: the same hashes, from the same request."""

import base64
import io
import json
import subprocess
import sys

import pytest
from PIL import Image

from epd.api.prepare import PromptBuilder
from epd.api.schema import parse_completion, parse_request
from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.tokenizer import load_tokenizer
from epd.kv.hashing import image_digests, image_spans, salt_digest
from epd.kv.index import external
from epd.route.prompts import CHAT, COMPLETIONS, PromptNamer

LONG = "the quick brown fox jumps over the lazy dog " * 12


@pytest.fixture(scope="module")
def builder(tiny_checkpoint):
    return PromptBuilder.from_checkpoint(tiny_checkpoint, load_tokenizer(tiny_checkpoint), 16)


def png(size=(64, 48), color=(200, 10, 10)) -> tuple[str, bytes]:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    data = buffer.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode(), data


def prefill_hashes(engine, builder, body, images=()):
    """The hashes prefill computes for a chat, as its coordinator does."""
    chat = parse_request(body)
    prepared = builder.prepare(builder.read(chat), list(images))
    digests = image_digests(list(images), chat.cache_salt)
    slot = engine.placeholder_id
    spans = image_spans(prepared.prompt_ids, slot, prepared.image_tokens, digests) if images else ()
    hashes = engine.hashes(prepared.prompt_ids, spans, salt_digest(chat.cache_salt))
    return [external(h) for h in hashes]


def chat(*content, **fields):
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": list(content)}]
    return {"model": "m", "messages": messages} | fields


def test_a_chat_is_named_as_prefill_names_it(engine, builder):
    body = chat({"type": "text", "text": "hello"})
    named = PromptNamer(builder, 1 << 20).name(CHAT, body)
    assert named is not None
    hashes = named.hashes(engine.model_key)
    assert len(hashes) >= 5 and hashes == prefill_hashes(engine, builder, body)


def test_images_and_a_salt_name_blocks_as_prefill_names_them(engine, builder):
    url, data = png()
    body = chat({"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"})
    namer = PromptNamer(builder, 1 << 20)
    plain = namer.name(CHAT, body).hashes(engine.model_key)
    assert plain == prefill_hashes(engine, builder, body, [data])
    salted = body | {"cache_salt": "tenant-1"}
    hashes = namer.name(CHAT, salted).hashes(engine.model_key)
    assert hashes == prefill_hashes(engine, builder, salted, [data])
    assert not set(hashes) & set(plain)  # another tenant's blocks are never the same blocks


def test_an_image_by_url_names_only_the_blocks_before_it(engine, builder):
    url, _ = png()
    given = chat({"type": "image_url", "image_url": {"url": url}})
    linked = chat({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})
    namer = PromptNamer(builder, 1 << 20)
    whole = namer.name(CHAT, given).hashes(engine.model_key)
    before = namer.name(CHAT, linked).hashes(engine.model_key)
    assert 0 < len(before) < len(whole) and whole[: len(before)] == before


def test_a_legacy_completion_is_named_from_its_tokens(engine, builder):
    body = {"model": "m", "prompt": LONG}
    named = PromptNamer(builder, 1 << 20).name(COMPLETIONS, body)
    prepared = builder.prepare_completion(parse_completion(body))
    expected = [external(h) for h in engine.hashes(prepared.prompt_ids, (), b"")]
    assert named.hashes(engine.model_key) == expected


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, {"model": "m", "messages": "not a list"}),  # prefill will give the 400
        (CHAT, chat({"type": "text", "text": "x"}, prompt_logprobs=1)),  # never cached
        (COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}),  # several prompts, one prefill
        ("/v1/models", {}),
    ],
)
def test_what_prefill_would_not_cache_or_would_refuse_names_no_blocks(builder, path, body):
    assert PromptNamer(builder, 1 << 20).name(path, body) is None


NAMED_WITHOUT_TORCH = """
import json, sys
from epd.route import keep_torch_out
keep_torch_out()
from epd.api.prepare import PromptBuilder
from epd.checkpoint.tokenizer import load_tokenizer
from epd.route.prompts import CHAT, PromptNamer
path, body = sys.argv[1], json.loads(sys.argv[2])
builder = PromptBuilder.from_checkpoint(path, load_tokenizer(path), 16)
named = PromptNamer(builder, 1 << 20).name(CHAT, body)
assert "torch" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
print(json.dumps(named.hashes(b"key")))
"""


@pytest.mark.parametrize("layout", ["inside", "tiktoken"])
def test_the_router_names_blocks_of_every_tokenizer_layout_without_torch(tmp_path, layout):
    """The router's process has no torch (`keep_torch_out`): Kimi's tiktoken files and a
    tokenizer.json with the specials inside the vocabulary are read there as prefill reads
    them, and a chat is named alike."""
    checkpoint = make_checkpoint(tmp_path, "tiny", tokenizer=layout)
    body = chat({"type": "text", "text": "中文English naïve " * 8})
    builder = PromptBuilder.from_checkpoint(checkpoint, load_tokenizer(checkpoint), 16)
    here = PromptNamer(builder, 1 << 20).name(CHAT, body).hashes(b"key")
    run = subprocess.run(
        [sys.executable, "-c", NAMED_WITHOUT_TORCH, str(checkpoint), json.dumps(body)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert len(here) >= 4 and json.loads(run.stdout) == here
