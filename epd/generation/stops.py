"""Stop strings, found as a reply's text grows: one Aho-Corasick automaton over a request's stop
strings, fed each new character once.

The automaton's state after a character stands for the longest tail of the text that is a
prefix of some stop string. That tail is what the client does not get yet (it may still grow
into a stop string), and a state where a stop string ends says where the reply is cut. So a
token costs its own characters, however many and however long the stop strings are, where
looking for each stop string in the tail again at every token grew with their lengths
(docs/benchmarks.md, "Stop strings at every token").

A reply stops at the first character that completes a stop string, and is cut before the
longest one that ends there: where a token's text completes two, the one that ends first wins,
as it would have had the tokens been shorter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Automaton:
    """A trie of the stop strings (state 0 is the empty prefix), each state with its failure
    link: the state of its longest proper suffix that is also in the trie."""

    children: tuple[dict[str, int], ...]
    fail: tuple[int, ...]
    depth: tuple[int, ...]  # characters of the prefix a state stands for
    ends: tuple[int, ...]  # length of the longest stop string that ends at a state; 0: none

    def next(self, state: int, char: str) -> int:
        return follow(self.children, self.fail, state, char)


def follow(children: Sequence[dict[str, int]], fail: Sequence[int], state: int, char: str) -> int:
    """The state after one more character. Amortised O(1) a character: a failure link shortens
    the prefix, and a character lengthens it by at most one."""
    while state and char not in children[state]:
        state = fail[state]
    return children[state].get(char, 0)


@lru_cache(maxsize=16)  # the choices of a request share theirs; bounded, as requests choose them
def automaton(stops: tuple[str, ...]) -> Automaton:
    children: list[dict[str, int]] = [{}]
    depth, ends = [0], [0]
    for stop in stops:
        state = 0
        for char in stop:
            if char not in children[state]:
                children[state][char] = len(children)
                children.append({})
                depth.append(depth[state] + 1)
                ends.append(0)
            state = children[state][char]
        ends[state] = len(stop)
    fail = [0] * len(children)
    queue = deque(children[0].values())  # depth 1: their failure link is the empty prefix
    while queue:  # breadth first: a shorter prefix's link is known before a longer one needs it
        state = queue.popleft()
        for char, child in children[state].items():
            fail[child] = follow(children, fail, fail[state], char)
            ends[child] = ends[child] or ends[fail[child]]  # a shorter stop string ending here
            queue.append(child)
    return Automaton(tuple(children), tuple(fail), tuple(depth), tuple(ends))


class StopScanner:
    """One reply's place in its request's automaton."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.automaton = automaton(stops) if stops else None
        self.state = 0

    @property
    def held(self) -> int:
        """Characters at the end of the text that may still grow into a stop string."""
        return self.automaton.depth[self.state] if self.automaton else 0

    def scan(self, text: str, honoured: bool = True) -> tuple[int, int] | None:
        """Feed the reply's new text. Where a stop string ends in it (and `honoured`: not before
        min_tokens), return where that stop string starts and ends, from the start of `text`
        (the start negative if it began in text fed before). Then feed nothing more."""
        if self.automaton is None:
            return None
        for index, char in enumerate(text):
            self.state = self.automaton.next(self.state, char)
            if honoured and (length := self.automaton.ends[self.state]):
                return index + 1 - length, index + 1
        return None
