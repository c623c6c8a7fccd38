"""A reasoning model's replies as vLLM's reasoning parsers give them: the reasoning as
`reasoning` (and `reasoning_content`, its older name, which clients still read) beside
`content`, in chat replies and stream deltas, and as the Responses API's reasoning item.

Which parser (`--reasoning-parser`): `kimi_vl`, `none`, or `auto`, the default: `kimi_vl`
where the checkpoint's own files show a thinking model (its chat template names the start
marker, or config.json's `_name_or_path`, its folder or, in a Hugging Face cache, its
repository's folder names a -Thinking model). The split itself is `generation.reasoning`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from epd.generation.reasoning import Markers, Split
from epd.wire.messages import TokenDelta


class ReasonedDelta(TokenDelta, frozen=True):
    """A delta as the API shapes it for a reasoning model: `text` the answer's part of it,
    `reasoning` the reasoning's. (Not a wire message: decode sends plain TokenDeltas.)"""

    reasoning: str = ""


async def split_deltas(
    deltas: AsyncIterator[TokenDelta], markers: Markers, open_: bool
) -> AsyncIterator[TokenDelta]:
    """Each delta with its text split into reasoning and answer, choice by choice (text that
    may begin a marker waits for the next delta, or for the choice's end)."""
    splits: dict[int, Split] = {}
    async for delta in deltas:
        split = splits.setdefault(delta.index, Split(markers, open_))
        reasoning, answer = split.feed(delta.text)
        if delta.finish_reason is not None:
            held = split.finish()
            reasoning, answer = reasoning + held[0], answer + held[1]
        fields = msgspec.structs.asdict(delta) | {"text": answer}
        yield ReasonedDelta(**fields, reasoning=reasoning)


def reasoning_of(delta: TokenDelta) -> str:
    return delta.reasoning if isinstance(delta, ReasonedDelta) else ""
