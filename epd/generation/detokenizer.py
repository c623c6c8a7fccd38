"""Incremental detokenisation that never splits a multi-byte character.

Byte-level tokens can end in the middle of a UTF-8 character; decoding such a prefix yields
U+FFFD. New text is released only once the decoded tail no longer ends in U+FFFD, measured
against a short window of recent tokens so each step decodes O(window) tokens, not the whole reply.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from epd.checkpoint.tokenizer import decode_text


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special: bool = True) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = []
        self.prefix = 0  # start of the window that is re-decoded for context
        self.read = 0  # tokens up to here have been turned into released text

    def _text(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids, self.skip_special)

    def add(self, token: int) -> str:
        """Append one token id; return the text it completes ('' while a character is split)."""
        self.ids.append(token)
        before = self._text(self.ids[self.prefix : self.read])
        after = self._text(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]
