"""Questions about the scenes, asked the many ways people ask them, with exact answers."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from PIL import Image

from shapes.scenes import COLOURS, SHAPES, scene

KINDS = ("colour", "shape", "count", "multi")
# How often training draws each kind (KINDS order). The first stage has one image at a time and
# mostly outlines: in the full mix from the start, the language model settles on answer priors
# long before the tower tells outlines apart. Colour is learned at once and shape is also asked
# in follow-ups and about one image among several; counting is the hardest to get right and
# telling images apart by their order ("the second image") is learned last, so after the first
# stage those two get most of the questions.
FIRST_STAGE_MIX = (0.1, 0.5, 0.4, 0.0)
TRAINING_MIX = (0.05, 0.2, 0.35, 0.4)
ORDINALS = ("first", "second", "third")
COLOUR_QUESTIONS = [
    "What colour is the shape?",
    "What color is the shape?",
    "What colour is the shape in the image?",
    "What color is the shape in the image?",
    "What is the colour of the shape?",
    "What is the color of the shape?",
    "What colour is it?",
    "What color is it?",
    "Which colour is the shape in the picture?",
    "What color is the shape in this picture?",
]
SHAPE_QUESTIONS = [
    "What shape is this?",
    "What shape is it?",
    "What shape is in the image?",
    "What shape is shown in the picture?",
    "Which shape is in the image?",
    "What is the shape?",
    "Name the shape.",
    "What shape do you see?",
]
COUNT_QUESTIONS = [
    "How many shapes are there?",
    "How many shapes are in the image?",
    "How many shapes are in the picture?",
    "Count the shapes.",
    "How many shapes do you see?",
    "How many shapes can you see in the image?",
]
MULTI_QUESTIONS = {
    "colour": [
        "What colour is the shape in the {n} image?",
        "What color is the shape in the {n} image?",
        "What colour is the shape in the {n} picture?",
        "In the {n} image, what color is the shape?",
        "What is the colour of the shape in the {n} image?",
    ],
    "shape": [
        "What shape is in the {n} image?",
        "What shape is in the {n} picture?",
        "Which shape does the {n} image show?",
        "In the {n} image, what is the shape?",
    ],
}


@dataclass(frozen=True)
class Sample:
    kind: str
    images: list[Image.Image]
    question: str
    answer: str
    question_first: bool
    # Later (question, answer) turns about the same images. Training uses them to get more
    # answers out of each encoded image; evaluation asks the first question only.
    followups: tuple[tuple[str, str], ...] = ()

    def messages(self, image_url: Any = "image") -> list[dict[str, Any]]:
        """OpenAI-style messages; `image_url(image)` gives each image part's URL."""
        to_url = image_url if callable(image_url) else (lambda _: image_url)
        images = [{"type": "image_url", "image_url": {"url": to_url(i)}} for i in self.images]
        text = [{"type": "text", "text": self.question}]
        return [
            {"role": "user", "content": text + images if self.question_first else images + text}
        ]

    def turns(self) -> list[tuple[list[dict[str, Any]], str]]:
        """The conversation up to each question (the first one holds the images), and its answer."""
        history, answer = self.messages(), self.answer
        turns = [(history, answer)]
        for question, next_answer in self.followups:
            history = [
                *history,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
            answer = next_answer
            turns.append((history, answer))
        return turns


def sample(
    rng: random.Random,
    kind: str | None = None,
    followups: int = 0,
    mix: tuple[float, ...] = TRAINING_MIX,
) -> Sample:
    """One question of `kind` (drawn from `mix` if None), with up to `followups` more."""
    kind = kind or rng.choices(KINDS, mix)[0]
    first = rng.random() < 0.2
    if kind == "count":
        n = rng.randint(1, 4)
        shapes = [rng.choice(SHAPES) for _ in range(n)]
        colours = [rng.choice(list(COLOURS)) for _ in range(n)]
        image = scene(rng, shapes, colours)[0]
        return Sample(kind, [image], rng.choice(COUNT_QUESTIONS), str(n), first)
    if kind == "multi":
        images, questions = multi(rng)
    else:
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        images = [scene(rng, [shape], [colour])[0]]
        questions = [(rng.choice(COLOUR_QUESTIONS), colour), (rng.choice(SHAPE_QUESTIONS), shape)]
        if kind == "shape":
            questions.reverse()
    (question, answer), *more = questions
    rng.shuffle(more)
    return Sample(kind, images, question, answer, first, tuple(more[:followups]))


def multi(rng: random.Random) -> tuple[list[Image.Image], list[tuple[str, str]]]:
    """Two or three one-shape images that differ in what is asked about one of them.

    Returns the images and (question, answer) pairs: the one asked first, then one about each
    other image.
    """
    count, about = rng.randint(2, 3), rng.choice(["colour", "shape"])
    colours = (
        rng.sample(list(COLOURS), count)
        if about == "colour"
        else [rng.choice(list(COLOURS))] * count
    )
    shapes = (
        rng.sample(SHAPES, count)
        if about == "shape"
        else [rng.choice(SHAPES) for _ in range(count)]
    )
    images = [scene(rng, [s], [c])[0] for s, c in zip(shapes, colours, strict=True)]
    target = rng.randrange(count)
    answers = colours if about == "colour" else shapes
    order = [target, *(i for i in range(count) if i != target)]
    questions = [
        (rng.choice(MULTI_QUESTIONS[about]).format(n=ORDINALS[i]), answers[i]) for i in order
    ]
    return images, questions


def corpus() -> list[str]:
    """Every phrase the task uses, for training the tokenizer.

    The chat template's role words and every answer also stand alone (as they follow a special
    token, without a leading space), so that with a big enough vocabulary each word the task uses
    is one token: prompts are about half as long as with byte pieces, and answers are one token.
    """
    lines = COLOUR_QUESTIONS + SHAPE_QUESTIONS + COUNT_QUESTIONS
    lines += [q.format(n=n) for qs in MULTI_QUESTIONS.values() for q in qs for n in ORDINALS]
    lines += [" ".join(COLOURS), " ".join(SHAPES), "1 2 3 4", "You are a helpful assistant"]
    lines += ["system", "user", "assistant", "image", *COLOURS, *SHAPES, "1", "2", "3", "4"]
    return lines
