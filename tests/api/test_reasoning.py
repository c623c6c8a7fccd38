"""A reasoning model's replies as vLLM's reasoning parsers give them: chat messages and stream
deltas with `reasoning` beside `content`, forced tool calls after the reasoning, and the
Responses API's reasoning item; which checkpoints turn the parser on."""

import asyncio
import json
import shutil

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from epd.api.prepare import PromptBuilder
from epd.api.reasoning import split_deltas
from epd.api.responses import Reply
from epd.api.responses_api import ResponseReply
from epd.api.schema import parse_request
from epd.api.tool_prompts import ForcedTools
from epd.api.tools import ToolReply
from epd.checkpoint.tokenizer import load_tokenizer
from epd.generation.reasoning import PARSERS, markers_for
from epd.wire.messages import TokenDelta

KIMI = PARSERS["kimi_vl"]
PIECES = ["◁thi", "nk▷ It is ", "round.◁/", "think▷", '{"shape":', '"circle"}']
EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)


def deltas(pieces=PIECES, finish="stop"):
    last = len(pieces) - 1
    return [
        TokenDelta("r", (i,), text, i + 1, finish if i == last else None)
        for i, text in enumerate(pieces)
    ]


def split(items, open_=False):
    async def source():
        for item in items:
            yield item

    async def run():
        return [d async for d in split_deltas(source(), KIMI, open_)]

    return asyncio.run(run())


def chunks(reply, items):
    sent = [reply.delta_chunk(d) for d in items]
    return [json.loads(c[len("data: ") :]) for c in sent if c]


def test_a_chat_message_has_its_reasoning_beside_its_content():
    reply = Reply("r", "m", 3, False, reasoning=True)
    body = ChatCompletion.model_validate(reply.completion(split(deltas())))
    message = body.choices[0].message
    assert message.content == '{"shape":"circle"}'
    assert message.reasoning == message.reasoning_content == " It is round."


def test_a_reply_without_reasoning_has_none_and_one_cut_short_no_content():
    reply = Reply("r", "m", 3, False, reasoning=True)
    plain = reply.completion(split(deltas(["It is ", "red."])))["choices"][0]["message"]
    assert plain == {
        "role": "assistant",
        "content": "It is red.",
        "reasoning": None,
        "reasoning_content": None,
    }
    cut = reply.completion(split(deltas(["◁think▷ hmm ◁/thi"], "length")))["choices"][0]
    assert cut["message"]["content"] is None and cut["message"]["reasoning"] == " hmm ◁/thi"


def test_stream_deltas_carry_reasoning_then_content():
    reply = Reply("r", "m", 3, False, reasoning=True)
    sent = chunks(reply, split(deltas()))
    for chunk in sent:
        ChatCompletionChunk.model_validate(chunk)
    said = [c["choices"][0]["delta"] for c in sent]
    assert "".join(d.get("reasoning", "") for d in said) == " It is round."
    assert "".join(d.get("reasoning_content", "") for d in said) == " It is round."
    assert "".join(d.get("content", "") for d in said) == '{"shape":"circle"}'
    first_content = next(i for i, d in enumerate(said) if d.get("content"))
    assert not any(d.get("reasoning") for d in said[first_content:])


def test_the_prompt_may_open_the_reasoning():
    reply = Reply("r", "m", 3, False, reasoning=True)
    items = split(deltas([" red", "◁/think▷", "Red."]), open_=True)
    message = reply.completion(items)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (" red", "Red.")


def test_a_forced_call_comes_after_the_reasoning():
    chat = parse_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    forced = ForcedTools.of(chat)
    whole = ToolReply("r", "m", 3, False, reasoning=True, forced=forced)
    message = whole.completion(split(deltas()))["choices"][0]["message"]
    assert message["reasoning"] == " It is round." and message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == '{"shape":"circle"}'
    streamed = ToolReply("r", "m", 3, False, reasoning=True, forced=forced)
    said = [c["choices"][0]["delta"] for c in chunks(streamed, split(deltas()))]
    arguments = [d["tool_calls"][0]["function"]["arguments"] for d in said if "tool_calls" in d]
    assert "".join(arguments) == '{"shape":"circle"}'
    assert "".join(d.get("reasoning", "") for d in said) == " It is round."


def test_the_responses_api_gives_a_reasoning_item_first():
    reply = ResponseReply("r", "m", 5, want_logprobs=False, reasoning=True)
    items = split(deltas())
    whole = Response.model_validate(reply.completion(items))
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == " It is round."
    assert whole.output_text == '{"shape":"circle"}'
    stream = "".join(reply.opening(1)) + "".join(reply.delta_chunk(d) for d in items)
    sent = [
        EVENT.validate_python(json.loads(line[6:]))
        for line in stream.splitlines()
        if line.startswith("data: ")
    ]
    kinds = [e.type for e in sent]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning item
        "response.reasoning_text.delta",
    ]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert kinds[-1] == "response.completed"
    assert [o.type for o in sent[-1].response.output] == ["reasoning", "message"]
    assert [e.sequence_number for e in sent] == list(range(len(sent)))


@pytest.fixture
def thinking(checkpoint_in, tmp_path):
    """A copy of a tiny checkpoint under a Thinking model's folder name."""
    return shutil.copytree(checkpoint_in("appended"), tmp_path / "Kimi-VL-A3B-Thinking-2506")


def test_auto_turns_the_parser_on_for_thinking_checkpoints(checkpoint_in, thinking, tmp_path):
    plain = checkpoint_in("appended")
    assert markers_for("auto", plain, "") is None
    assert markers_for("auto", thinking, "") == KIMI  # its name
    assert markers_for("auto", plain, "{{ '◁think▷' }}") == KIMI  # its template
    cache = tmp_path / "models--moonshotai--Kimi-VL-A3B-Thinking" / "snapshots" / "abc123"
    shutil.copytree(plain, cache)
    assert markers_for("auto", cache, "") == KIMI  # a Hugging Face cache's repository
    assert markers_for("none", thinking, "{{ '◁think▷' }}") is None
    assert markers_for("kimi_vl", plain, "") == KIMI


def test_a_chat_continued_inside_its_reasoning_opens_it(thinking):
    tokenizer = load_tokenizer(thinking)
    builder = PromptBuilder.from_checkpoint(thinking, tokenizer, 16)
    assert builder.reasoning == KIMI

    def sampling(last):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": last}]
        chat = parse_request(
            {
                "model": "m",
                "messages": messages,
                "continue_final_message": True,
                "add_generation_prompt": False,
            }
        )
        return builder.prepare(builder.read(chat), []).sampling

    assert sampling("◁think▷ I see").reasoning_open
    assert not sampling("◁think▷ I see◁/think▷ It").reasoning_open
    assert sampling("It").reasoning == (KIMI.start, KIMI.end)


def test_choices_are_split_each_on_its_own():
    """n > 1: deltas of different choices interleave; each has its own reasoning state."""
    first = deltas()
    second = [
        TokenDelta("r", (9,), text, i + 1, "stop" if i == 1 else None, index=1)
        for i, text in enumerate(["Just ", "red."])
    ]
    mixed = [first[0], second[0], *first[1:3], second[1], *first[3:]]
    reply = Reply("r", "m", 3, False, reasoning=True)
    choices = reply.completion(split(mixed))["choices"]
    assert [c["message"]["reasoning"] for c in choices] == [" It is round.", None]
    assert [c["message"]["content"] for c in choices] == ['{"shape":"circle"}', "Just red."]
