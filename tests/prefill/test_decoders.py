"""A decoder is chosen by what it holds of the prompt, how full it is and how busy."""

from dataclasses import replace

from epd.prefill.decoders import Candidate, choose


def test_the_decoder_holding_the_prompt_is_chosen_though_it_is_busier():
    holder = Candidate("a", held=8, kv_usage=0.5, running=3)
    empty = Candidate("b", held=0, kv_usage=0.1, running=1)
    assert choose([empty, holder], blocks=8) is holder


def test_without_a_prefix_the_freer_and_less_busy_decoder_is_chosen():
    full = Candidate("a", held=0, kv_usage=0.9, running=0)
    free = Candidate("b", held=0, kv_usage=0.2, running=0)
    assert choose([full, free], blocks=4) is free
    busy = Candidate("c", held=0, kv_usage=0.2, running=5)
    assert choose([busy, free], blocks=4) is free


def test_a_little_of_the_prompt_does_not_outweigh_a_full_cache():
    """A block of eight held, at 95% KV use, against an idle decoder with room."""
    holder = Candidate("a", held=1, kv_usage=0.95, running=4)
    idle = Candidate("b", held=0, kv_usage=0.0, running=0)
    assert choose([holder, idle], blocks=8) is idle


def test_equals_go_to_the_first_so_a_rotated_list_takes_turns():
    first, second = Candidate("a", 0, 0.0, 0), Candidate("b", 0, 0.0, 0)
    assert choose([first, second], blocks=0) is first
    assert choose([second, first], blocks=0) is second


def test_a_decoder_far_busier_than_another_is_passed_over_whatever_it_holds():
    """Eight streams of repeated prompts went to one of two decoders: the idle part of the score
    could not outweigh the prefix it held. Out of balance, the least busy decide."""
    holder = Candidate("a", held=8, kv_usage=0.1, running=5)
    idle = Candidate("b", held=0, kv_usage=0.1, running=0)
    assert choose([holder, idle], blocks=8) is idle
    calm = Candidate("c", held=2, kv_usage=0.5, running=0)
    assert choose([holder, idle, calm], blocks=8) is calm  # among the least busy: the prefix
    assert choose([holder, Candidate("d", 0, 0.1, 1)], blocks=8) is holder  # 5 to 1: in balance
    # 4 apart is in balance: a later turn stays where its KV is (moving it costs a hand-off of
    # its whole prompt; a decode batch a few streams larger costs little)
    assert choose([replace(holder, running=4), idle], blocks=8).address == "a"


def test_blocks_every_decoder_holds_do_not_tell_them_apart():
    """Both hold the shared system prompt (56 of 100 blocks); one holds the conversation's
    earlier turns too (95): it keeps the next turn, though it runs more streams (in balance)."""
    holder = Candidate("a", held=95, kv_usage=0.1, running=4)
    other = Candidate("b", held=56, kv_usage=0.1, running=0)
    assert choose([other, holder], blocks=100) is holder
    assert choose([other, replace(holder, held=56)], blocks=100) is other  # nothing apart: idle


def test_a_block_or_two_held_does_not_outweigh_a_full_busy_decoder():
    """The share is of the blocks some candidate lacks, but counted against at least
    PREFIX_FLOOR: one block apart saves 16 tokens, not worth a nearly full, busier decoder."""
    full = Candidate("a", held=61, kv_usage=0.97, running=4)
    free = Candidate("b", held=60, kv_usage=0.05, running=0)
    assert choose([full, free], blocks=61) is free
