"""Which prefill a request goes to first, and in what order the others are tried."""

from epd.route.choice import CACHE_HIT, LOAD, ROUND_ROBIN, Candidate, order


def urls(ranked):
    return [c.url for c in ranked]


def test_the_prefill_holding_the_prefix_wins_over_an_idle_one():
    holder, idle = Candidate("a", load=2, matched=9), Candidate("b", load=0, matched=1)
    ranked, why = order([idle, holder], "cache-aware", blocks=10, turn=0)
    assert urls(ranked) == ["a", "b"] and why == CACHE_HIT


def test_a_prefix_held_everywhere_goes_to_the_least_loaded():
    busy, calm = Candidate("a", load=3, matched=5), Candidate("b", load=1, matched=5)
    ranked, why = order([busy, calm], "cache-aware", blocks=10, turn=0)
    assert urls(ranked) == ["b", "a"] and why == CACHE_HIT


def test_a_prompt_nobody_holds_goes_by_load_and_equals_take_turns():
    a, b = Candidate("a", load=0), Candidate("b", load=0)
    firsts = [order([a, b], "cache-aware", blocks=10, turn=t)[0][0].url for t in range(4)]
    assert firsts == ["a", "b", "a", "b"]
    assert order([a, b], "cache-aware", blocks=0, turn=0)[1] == LOAD  # not named: load alone


def test_a_small_share_of_the_prefix_does_not_outweigh_a_queue():
    holder, idle = Candidate("a", load=2, matched=1), Candidate("b", load=0, matched=0)
    assert urls(order([holder, idle], "cache-aware", blocks=20, turn=0)[0]) == ["b", "a"]


def test_round_robin_and_least_loaded_ignore_the_prefix():
    holder, idle = Candidate("a", load=5, matched=10), Candidate("b", load=0, matched=0)
    rotated = [order([holder, idle], "round-robin", 10, t) for t in range(2)]
    assert [urls(r) for r, _ in rotated] == [["a", "b"], ["b", "a"]]
    assert rotated[0][1] == ROUND_ROBIN
    assert urls(order([holder, idle], "least-loaded", 10, 0)[0]) == ["b", "a"]


def test_no_candidate_gives_an_empty_order():
    assert order([], "cache-aware", 3, 0) == ([], LOAD)


def test_out_of_balance_the_least_loaded_goes_first_whatever_the_other_holds():
    """Four streams of one prompt came together and all went to the prefill whose events had
    just named its block: past the balance bound, load decides."""
    holder, idle = Candidate("a", load=3, matched=4), Candidate("b", load=0)
    assert order([holder, idle], "cache-aware", blocks=4, turn=0) == ([idle, holder], LOAD)
    near = Candidate("c", load=2, matched=4)
    assert order([near, idle], "cache-aware", blocks=4, turn=0)[0][0] is near  # 2 to 0: held
