"""What prefill believes each decoder holds: what it handed it, less what the decoder said it
lacks, within a bound, and nothing of a decoder that left."""

from epd.prefill.kv import DecoderBlocks

HASHES = [bytes([i]) * 32 for i in range(6)]


def test_a_decoder_holds_the_leading_blocks_prefill_handed_it():
    held = DecoderBlocks()
    assert held.blocks("a", HASHES) == 0
    held.sent("a", HASHES[:4])
    assert held.blocks("a", HASHES) == 4 and held.blocks("b", HASHES) == 0
    assert held.blocks("a", [HASHES[0], HASHES[5], HASHES[1]]) == 1  # a prefix, no more


def test_what_a_decoder_lacks_is_forgotten_and_one_that_keeps_nothing_is_never_believed():
    held = DecoderBlocks()
    held.sent("a", HASHES)
    held.missing("a", HASHES, held=2, keeps=True)
    assert held.blocks("a", HASHES) == 2
    held.missing("a", HASHES, held=0, keeps=False)  # its prefix cache is off
    held.sent("a", HASHES)
    assert held.blocks("a", HASHES) == 0


def test_each_decoder_is_remembered_within_a_bound_least_recently_used_out():
    held = DecoderBlocks(per_decoder=4)
    held.sent("a", HASHES[:4])
    assert held.blocks("a", HASHES[1:2]) == 1  # asked of: every candidate is, it stays old
    held.sent("a", HASHES[:1])  # the first block, handed again
    held.sent("a", HASHES[4:5])
    assert held.blocks("a", HASHES[:1]) == 1 and held.blocks("a", HASHES[1:2]) == 0


def test_decoders_that_left_are_forgotten():
    held = DecoderBlocks()
    held.sent("a", HASHES)
    held.sent("b", HASHES)
    held.missing("c", HASHES, held=0, keeps=False)
    held.keep_only(["b"])
    assert held.held.keys() == {"b"} and not held.keep_nothing
