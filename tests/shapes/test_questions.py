"""The shapes task covers what the demo promises: sizes, colours, shapes, counts, phrasings."""

import random

from epd.checkpoint.config import ProcessorConfig
from epd.multimodal.image_processor import ImageProcessor
from shapes.questions import KINDS, ORDINALS, sample
from shapes.scenes import COLOURS, SHAPES

PROCESSOR = ImageProcessor(ProcessorConfig(image_mean=(0.5,) * 3, image_std=(0.5,) * 3))


def samples(kind, n=300):
    return [sample(random.Random(f"t-{kind}-{i}"), kind) for i in range(n)]


def test_images_vary_in_grid_including_non_square_and_padded():
    images = [image for kind in KINDS for s in samples(kind, 100) for image in s.images]
    grids = {PROCESSOR.grid_for_size(*image.size) for image in images}
    assert len(grids) >= 12 and any(h != w for h, w in grids)
    assert any(image.width % 28 or image.height % 28 for image in images)  # padding needed


def test_answers_cover_every_colour_shape_and_count():
    assert {s.answer for s in samples("colour")} == set(COLOURS) and len(COLOURS) >= 6
    assert {s.answer for s in samples("shape")} == set(SHAPES) == {"circle", "square", "triangle"}
    assert {s.answer for s in samples("count")} == {"1", "2", "3", "4"}


def test_phrasings_vary_with_both_spellings():
    questions = {s.question for s in samples("colour")}
    assert any("colour" in q for q in questions) and any("color" in q for q in questions)
    assert any("image" in q for q in questions) and any("image" not in q for q in questions)


def test_multi_image_questions_single_out_one_image():
    for s in samples("multi", 100):
        assert 2 <= len(s.images) <= 3
        ordinal = next(o for o in ORDINALS if o in s.question)
        assert ORDINALS.index(ordinal) < len(s.images)


def test_samples_are_reproducible_from_their_seed():
    a, b = sample(random.Random("x")), sample(random.Random("x"))
    assert (a.question, a.answer) == (b.question, b.answer)
    assert a.images[0].tobytes() == b.images[0].tobytes()


def test_followups_ask_about_the_same_images_without_repeating_a_question():
    for kind in KINDS:
        for i in range(50):
            plain = sample(random.Random(f"t-{kind}-{i}"), kind)
            extra = sample(random.Random(f"t-{kind}-{i}"), kind, followups=2)
            assert (extra.question, extra.answer) == (plain.question, plain.answer)
            asked = [extra.question, *(q for q, _ in extra.followups)]
            assert len(extra.followups) <= 2 and len(set(asked)) == len(asked)
            if kind == "multi":  # each question names a different image
                ordinals = [next(o for o in ORDINALS if o in q) for q in asked]
                assert len(set(ordinals)) == len(ordinals)
            if kind in ("colour", "shape"):  # the other attribute of the one shape
                assert [a in COLOURS for _, a in extra.followups] == [kind == "shape"]
