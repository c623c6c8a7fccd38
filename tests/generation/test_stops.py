"""Stop strings found by the automaton, against a plain search of the whole text after every
character: the same cut and the same text held back, whatever the stop strings overlap."""

import itertools
import random

import pytest

from epd.generation.stops import StopScanner, automaton


def plain_held(text: str, stops: tuple[str, ...]) -> int:
    """The longest tail of text that some stop string starts with."""
    sizes = range(min(len(text), max(map(len, stops))), 0, -1)
    return next((k for k in sizes if any(s.startswith(text[-k:]) for s in stops)), 0)


def plain_cut(text: str, stops: tuple[str, ...]) -> tuple[int, int] | None:
    """Where the first stop string to end in text starts (the longest of those ending there),
    and where it ends."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return min(starts), end
    return None


def scanned(chunks: list[str], stops: tuple[str, ...]) -> tuple[tuple[int, int] | None, list[int]]:
    """Feed the chunks; the stop string's place from the start of the text, and the held
    counts along the way."""
    scanner, fed, held = StopScanner(stops), 0, []
    for chunk in chunks:
        found = scanner.scan(chunk)
        if found is not None:
            return (fed + found[0], fed + found[1]), held
        fed += len(chunk)
        held.append(scanner.held)
    return None, held


@pytest.mark.parametrize("seed", range(200))
def test_the_automaton_cuts_and_holds_back_as_a_plain_search(seed):
    rng = random.Random(seed)
    alphabet = "abé"  # few letters, so stop strings overlap and partial matches abound
    stops = tuple(
        "".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 5))
    )
    text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
    cuts = sorted({0, len(text), *rng.sample(range(len(text) + 1), min(len(text), 6))})
    chunks = [text[a:b] for a, b in itertools.pairwise(cuts)]
    cut, held = scanned(chunks, stops)
    assert cut == plain_cut(text, stops)
    fed = 0
    for chunk, h in zip(chunks, held, strict=False):
        fed += len(chunk)
        assert h == plain_held(text[:fed], stops)


def test_the_first_stop_string_to_end_wins_and_the_longest_of_those_ending_there():
    assert scanned(["abcd"], ("abcd", "bc"))[0] == (1, 3)  # "bc" ends first
    assert scanned(["xabc"], ("abc", "bc"))[0] == (1, 4)  # both end at c: cut before the longer
    assert scanned(["ab", "ab", "c"], ("ababc",))[0] == (0, 5)  # begun two tokens before


def test_nothing_is_held_back_without_stop_strings_or_partial_matches():
    assert scanned(["hello"], ())[1] == [0]
    assert scanned(["hello", " wor"], ("world!",))[1] == [0, 3]


def test_a_stop_string_ending_before_min_tokens_is_passed_over_but_the_next_one_counts():
    scanner = StopScanner(("ab",))
    assert scanner.scan("xab", honoured=False) is None
    assert scanner.scan("ab", honoured=True) == (0, 2)


def test_a_request_s_choices_share_one_automaton():
    assert automaton(("x", "yz")) is automaton(("x", "yz"))
