"""The bundled demo checkpoint answers questions right through the three-process stack.

Most pictures are drawn here, not by shapes, in sizes whose grids differ (most need
padding), so a mis-sliced, misplaced or misordered image embedding gives a wrong answer. They
are pictures the model gets right (it is right on about 98% of held-out colour, shape and
which-image questions and 88% of counts, not on all); each answer must also equal the
one-process path's.
"""

import random
from pathlib import Path

import openai
import pytest
from PIL import Image, ImageDraw

from epd.local import LocalPipeline
from shapes.questions import sample

from .stack import data_url, free_base, image_part, serve, text_part

DEMO = Path(__file__).parents[2] / "checkpoints" / "kimi-vl-shapes"
MODEL = DEMO.name
RGB = {
    "red": (220, 40, 40),
    "blue": (40, 80, 220),
    "green": (40, 170, 60),
    "yellow": (235, 210, 40),
}


def picture(shape: tuple[str, str], size: tuple[int, int]) -> str:
    """A white picture with one (kind, colour) shape in the middle, 0.6 of the shorter side
    across (in training a lone shape spans at least half the shorter side)."""
    (kind, colour), (width, height) = shape, size
    image = Image.new("RGB", size, "white")
    pen, side = ImageDraw.Draw(image), int(min(size) * 0.6)
    x0, y0 = (width - side) // 2, (height - side) // 2
    box = (x0, y0, x0 + side, y0 + side)
    if kind == "circle":
        pen.ellipse(box, fill=RGB[colour])
    elif kind == "square":
        pen.rectangle(box, fill=RGB[colour])
    else:
        pen.polygon([(x0 + side / 2, y0), (x0 + side, y0 + side), (x0, y0 + side)], RGB[colour])
    return data_url(image)


THREE = [  # different grids: (6, 6) after padding, (4, 8), (4, 6)
    picture(("circle", "red"), (84, 70)),
    picture(("square", "blue"), (56, 98)),
    picture(("triangle", "green"), (84, 56)),
]


@pytest.fixture(scope="module")
def demo():
    base = free_base()
    process = serve(DEMO, base)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="-", max_retries=0)
    yield client
    assert process.stop() == 0


@pytest.fixture(scope="module")
def local():
    return LocalPipeline(DEMO)


def ask(client: openai.OpenAI, content: list[dict]) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason == "stop"  # the model ends its answer itself
    return reply.choices[0].message.content or ""


def local_answer(local: LocalPipeline, content: list[dict]) -> str:
    messages = [{"role": "user", "content": content}]
    return local.chat(
        {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    ).text


@pytest.mark.parametrize(
    "shape,size,question,answer",
    [
        (("circle", "red"), (84, 70), "What colour is the shape?", "red"),
        (("square", "blue"), (70, 98), "What color is the shape in the image?", "blue"),
        (("triangle", "yellow"), (98, 56), "What shape is in the image?", "triangle"),
        (("circle", "green"), (56, 56), "What shape is this?", "circle"),
        (("square", "red"), (112, 84), "Which shape is in the image?", "square"),
    ],
)
def test_one_picture(demo, local, shape, size, question, answer):
    content = [image_part(picture(shape, size)), text_part(question)]
    assert ask(demo, content) == answer == local_answer(local, content)


@pytest.mark.parametrize("seed,n", [(0, "1"), (15, "2"), (1, "3"), (3, "4")])
def test_counting(demo, local, seed, n):
    """Held-out pictures from the training generator: shapes of random sizes and places."""
    question = sample(random.Random(f"e2e-count-{seed}"), "count")
    assert question.answer == n
    content = question.messages(data_url)[0]["content"]
    assert ask(demo, content) == n == local_answer(local, content)


@pytest.mark.parametrize("target", [0, 1, 2])
@pytest.mark.parametrize("about", ["colour", "shape"])
def test_one_picture_among_three(demo, local, target, about):
    ordinal = ("first", "second", "third")[target]
    question = {
        "colour": f"What colour is the shape in the {ordinal} image?",
        "shape": f"What shape is in the {ordinal} image?",
    }[about]
    content = [*map(image_part, THREE), text_part(question)]
    expected = [("red", "blue", "green"), ("circle", "square", "triangle")][about == "shape"]
    assert ask(demo, content) == expected[target] == local_answer(local, content)


def test_the_question_may_come_before_the_pictures(demo, local):
    content = [text_part("What colour is the shape in the second image?"), *map(image_part, THREE)]
    assert ask(demo, content) == "blue" == local_answer(local, content)
