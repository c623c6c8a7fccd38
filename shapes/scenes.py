"""Pictures of coloured shapes on plain or noisy backgrounds, in many sizes and aspect ratios."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = ((255, 255, 255), (200, 200, 200), (90, 90, 90), (20, 20, 20))
MIN_SIZE = 20  # pixels: an outline that always spans more than one 14-pixel patch


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1


def background(rng: random.Random, width: int, height: int) -> Image.Image:
    base = rng.choice(BACKGROUNDS)
    if rng.random() < 0.5:
        return Image.new("RGB", (width, height), base)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, 25, (height, width, 3))
    return Image.fromarray(np.clip(np.array(base) + noise, 0, 255).astype(np.uint8))


def place(rng: random.Random, width: int, height: int, size: int, taken: list[tuple[int, ...]]):
    """A free square box of side `size`, or None after some tries."""
    for _ in range(50):
        x, y = rng.randint(1, width - size - 1), rng.randint(1, height - size - 1)
        box = (x, y, x + size, y + size)
        if all(
            box[2] + 2 < t[0] or t[2] + 2 < box[0] or box[3] + 2 < t[1] or t[3] + 2 < box[1]
            for t in taken
        ):
            return box
    return None


def draw(image: Image.Image, shape: Shape) -> None:
    pen, colour = ImageDraw.Draw(image), COLOURS[shape.colour]
    x0, y0, x1, y1 = shape.box
    if shape.kind == "circle":
        pen.ellipse(shape.box, fill=colour)
    elif shape.kind == "square":
        pen.rectangle(shape.box, fill=colour)
    else:
        pen.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)


def scene(
    rng: random.Random, kinds: list[str], colours: list[str]
) -> tuple[Image.Image, list[Shape]]:
    """An image of a random size holding one shape per (kind, colour) pair, none overlapping."""
    while True:
        low = 28 if len(kinds) == 1 else 56
        width, height = rng.randint(low, 112), rng.randint(low, 112)
        limit = min(width, height) // (1 if len(kinds) == 1 else 2) - 4
        image, shapes = background(rng, width, height), list[Shape]()
        for kind, colour in zip(kinds, colours, strict=True):
            size = rng.randint(max(MIN_SIZE, limit // 2), max(MIN_SIZE, limit))
            box = place(rng, width, height, size, [s.box for s in shapes])
            if box is None:
                break
            shapes.append(Shape(kind, colour, box))
        if len(shapes) == len(kinds):
            for shape in shapes:
                draw(image, shape)
            return image, shapes
