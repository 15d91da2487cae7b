"""Small synthetic datasets for demos and tests: real PNG images drawn with PIL, no downloads.

Each edit image is a little scene (sky gradient, sun, ground, a few shapes) drawn from a seeded
random generator, so the same (n, size, seed) always gives the same bytes.
"""

from __future__ import annotations

import io
import random

import pyarrow as pa

from .datasets import write_parquet_bytes
from .objectstore import open_object_store, split_uri

EDIT_INSTRUCTIONS = [
    "make the sky purple",
    "turn the sun into a crescent moon",
    "cover the ground with snow",
    "make the red shape blue",
    "add a rainbow across the sky",
    "convert the picture to black and white",
    "make it look like a watercolor painting",
    "remove the smallest shape",
    "add a small house on the ground",
    "make it sunset with orange light",
]

GENERATE_PROMPTS = [
    "a red fox sitting in fresh snow, morning light",
    "a lighthouse on a cliff during a storm, oil painting",
    "a bowl of ramen on a wooden table, top view, photo",
    "an astronaut riding a bicycle on the moon, watercolor",
    "a cozy library with tall shelves and a cat on an armchair",
    "a futuristic city skyline at night with neon reflections",
    "a macro photo of a dew drop on a green leaf",
    "a paper origami crane on a white background",
    "a mountain lake at sunrise with mist over the water",
    "a vintage bicycle leaning against a yellow wall",
]


def draw_scene(size: int, rng: random.Random) -> bytes:
    """One procedural scene as PNG bytes."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(img)
    top = (rng.randint(40, 120), rng.randint(90, 180), rng.randint(180, 255))
    bottom = (rng.randint(160, 240), rng.randint(200, 250), 255)
    horizon = int(size * rng.uniform(0.55, 0.75))
    for y in range(horizon):  # sky: vertical gradient
        t = y / max(1, horizon - 1)
        draw.line([(0, y), (size, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom, strict=True)))
    ground = (rng.randint(30, 90), rng.randint(110, 170), rng.randint(30, 80))
    draw.rectangle([0, horizon, size, size], fill=ground)
    r = size // rng.randint(8, 12)
    cx, cy = rng.randint(r, size - r), rng.randint(r, max(r + 1, horizon - r))
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(255, rng.randint(200, 240), 60))
    for _ in range(rng.randint(2, 4)):  # a few shapes standing on the ground
        w = rng.randint(size // 12, size // 5)
        x = rng.randint(0, size - w)
        color = rng.choice([(220, 40, 40), (40, 60, 220), (240, 240, 240), (120, 60, 160)])
        if rng.random() < 0.5:
            draw.rectangle([x, horizon - w, x + w, horizon], fill=color)
        else:
            draw.polygon([(x, horizon), (x + w, horizon), (x + w // 2, horizon - w)], fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _write(uri: str, table: pa.Table, default_name: str) -> str:
    """Write to `uri` if it names a .parquet file, else to `{uri}/{default_name}`; returns the URI."""
    uri = str(uri).rstrip("/")
    if not uri.endswith(".parquet"):
        uri = f"{uri}/{default_name}"
    parent, name = split_uri(uri)
    open_object_store(parent).put_bytes(name, write_parquet_bytes(table))
    return uri


def write_sample_edit_dataset(path: str, n: int = 8, size: int = 256, seed: int = 0, output_size: str = "auto") -> str:
    """An edit dataset (id, instruction, image, seed, size=`output_size`) of `n` synthetic `size`^2 scenes."""
    rng = random.Random(seed)
    rows = [
        {
            "id": f"edit-{i:04d}",
            "instruction": EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)],
            "image": draw_scene(size, rng),
            "seed": seed * 1000 + i,
            "size": output_size,
        }
        for i in range(n)
    ]
    schema = pa.schema([("id", pa.string()), ("instruction", pa.string()), ("image", pa.binary()),
                        ("seed", pa.int64()), ("size", pa.string())])
    return _write(path, pa.Table.from_pylist(rows, schema=schema), "edit.parquet")


def write_sample_generate_dataset(path: str, n: int = 8, seed: int = 0, size: str = "auto") -> str:
    """A text-to-image dataset (id, prompt, seed, size) of `n` prompts."""
    rows = [
        {"id": f"gen-{i:04d}", "prompt": GENERATE_PROMPTS[i % len(GENERATE_PROMPTS)],
         "seed": seed * 1000 + i, "size": size}
        for i in range(n)
    ]
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("size", pa.string())])
    return _write(path, pa.Table.from_pylist(rows, schema=schema), "generate.parquet")
