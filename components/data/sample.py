"""Small synthetic datasets for demos, tests and the demo model: procedural scenes, no downloads.

A scene is a handful of parameters (`Scene`: sky colour, sun or crescent moon, ground, shapes with
colour / size / position, optional rainbow and house, sunset light, black-and-white or watercolor
look). `render(scene, size)` draws it with PIL, `caption(scene)` describes it in words, and for
every sample instruction `apply_edit(scene, kind)` gives the edited scene, so each edit row and
each caption has an exact target image. Scenes come from a seeded `random.Random`, so the same
(n, size, seed) always gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
from dataclasses import dataclass

import pyarrow as pa

from .datasets import write_parquet_bytes
from .objectstore import open_object_store, split_uri

# instruction -> edit kind (apply_edit); the order is the sample datasets' row order
EDIT_KINDS = {
    "make the sky purple": "sky_purple",
    "turn the sun into a crescent moon": "crescent_moon",
    "cover the ground with snow": "snow",
    "make the red shape blue": "red_to_blue",
    "add a rainbow across the sky": "rainbow",
    "convert the picture to black and white": "black_white",
    "make it look like a watercolor painting": "watercolor",
    "remove the smallest shape": "remove_smallest",
    "add a small house on the ground": "add_house",
    "make it sunset with orange light": "sunset",
}
EDIT_INSTRUCTIONS = list(EDIT_KINDS)
KIND_INSTRUCTIONS = {kind: text for text, kind in EDIT_KINDS.items()}

# Colours by name. Skies are a vertical gradient (top, horizon); the sky name alone decides it.
SKY_COLORS = {
    "blue": ((60, 120, 220), (170, 210, 250)),
    "teal": ((20, 130, 140), (140, 215, 210)),
    "pink": ((220, 110, 170), (250, 200, 225)),
    "purple": ((110, 50, 170), (190, 150, 230)),
}
SUNSET_SKY = ((230, 110, 30), (250, 200, 90))
SOURCE_SKIES = ("blue", "teal", "pink")  # purple is what an edit makes
GROUND_COLORS = {"grass": (60, 150, 60), "sand": (205, 180, 120), "snow": (245, 245, 250)}
SOURCE_GROUNDS = ("grass", "sand")
SHAPE_COLORS = {"red": (220, 40, 40), "blue": (40, 60, 220), "black": (25, 25, 25), "purple": (140, 60, 170)}
SHAPE_KINDS = ("square", "triangle", "circle")
SUN_COLOR = (255, 220, 60)
MOON_COLOR = (240, 240, 215)
SUNSET_TINT = (1.0, 0.72, 0.45)  # multiplies the ground under sunset light
RAINBOW = [(230, 50, 50), (245, 140, 40), (245, 225, 60), (70, 180, 70), (60, 110, 220), (130, 70, 190)]
HOUSE_WALL, HOUSE_ROOF, HOUSE_DOOR = (150, 95, 55), (90, 60, 45), (60, 40, 30)
# the house's place: fixed, in the foreground (fractions of the image), so the edit has one answer
HOUSE_BOX = (0.70, 0.80, 0.90, 0.96)  # wall x0, y0 (roof base), x1, y1 (ground line)


@dataclass(frozen=True)
class Shape:
    kind: str  # square | triangle | circle
    color: str  # a SHAPE_COLORS name
    size: float  # width as a fraction of the image
    x: float  # left edge, fraction of the image; the shape stands on the horizon


@dataclass(frozen=True)
class Scene:
    sky: str = "blue"  # a SKY_COLORS name
    celestial: str = "sun"  # sun | moon (a crescent)
    sun_x: float = 0.3
    sun_y: float = 0.2
    sun_r: float = 0.08
    ground: str = "grass"  # a GROUND_COLORS name
    horizon: float = 0.62  # fraction of the height where the ground starts
    shapes: tuple[Shape, ...] = ()
    rainbow: bool = False
    house: bool = False
    sunset: bool = False
    style: str = "plain"  # plain | black_white | watercolor

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Scene":
        data = json.loads(text)
        data["shapes"] = tuple(Shape(**s) for s in data["shapes"])
        return cls(**data)


# -- drawing scenes -------------------------------------------------------------------------------
def random_scene(rng: random.Random, edit: str | None = None) -> Scene:
    """A random source scene; with `edit` (an edit kind) one that edit changes visibly (a red shape
    to recolour, a sun to turn into a moon, ...)."""
    n_shapes = rng.randint(2, 3)
    sizes = _distinct_sizes(rng, n_shapes)
    xs = _spread(rng, sizes)
    colors = [rng.choice(list(SHAPE_COLORS)) for _ in range(n_shapes)]
    if edit == "red_to_blue" and "red" not in colors:
        colors[rng.randrange(n_shapes)] = "red"
    shapes = tuple(Shape(rng.choice(SHAPE_KINDS), c, s, x) for c, s, x in zip(colors, sizes, xs, strict=True))
    horizon = rng.uniform(0.58, 0.68)
    sun_r = rng.uniform(0.07, 0.10)
    celestial = "sun" if edit in ("crescent_moon", "sunset") else rng.choice(("sun", "sun", "moon"))
    return Scene(sky=rng.choice(SOURCE_SKIES), celestial=celestial,
                 sun_x=rng.uniform(0.15, 0.85), sun_y=rng.uniform(0.14, horizon - 0.22), sun_r=sun_r,
                 ground=rng.choice(SOURCE_GROUNDS), horizon=horizon, shapes=shapes)


def random_caption_scene(rng: random.Random) -> Scene:
    """A random scene for a text-to-image caption (purple skies and snow included)."""
    scene = random_scene(rng)
    return dataclasses.replace(scene, sky=rng.choice(list(SKY_COLORS)), ground=rng.choice(list(GROUND_COLORS)),
                               sunset=rng.random() < 0.15)


def _distinct_sizes(rng: random.Random, n: int) -> list[float]:
    """Shape widths 0.09-0.22 of the image, each at least 25 % apart from the others (one smallest)."""
    while True:
        sizes = [rng.uniform(0.09, 0.22) for _ in range(n)]
        ordered = sorted(sizes)
        if all(b > a * 1.25 for a, b in zip(ordered, ordered[1:])):
            return sizes


def _spread(rng: random.Random, sizes: list[float]) -> list[float]:
    """Left edges for shapes of these widths, left to right, not overlapping, within [0.03, 0.97]."""
    free = 0.94 - sum(sizes) - 0.03 * (len(sizes) - 1)
    cuts = sorted(rng.uniform(0, free) for _ in range(len(sizes)))
    xs, x, used = [], 0.03, 0.0
    for cut, size in zip(cuts, sizes, strict=True):
        x += cut - used
        used = cut
        xs.append(x)
        x += size + 0.03
    return xs


def render(scene: Scene, size: int = 128):
    """The scene as a size x size RGB PIL image."""
    from PIL import Image, ImageDraw, ImageFilter

    s = size
    img = Image.new("RGB", (s, s))
    draw = ImageDraw.Draw(img)
    top, bottom = SUNSET_SKY if scene.sunset else SKY_COLORS[scene.sky]
    horizon = int(round(s * scene.horizon))
    for y in range(horizon):  # sky: vertical gradient
        t = y / max(1, horizon - 1)
        draw.line([(0, y), (s, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom, strict=True)))
    if scene.rainbow:  # arcs centred on the horizon's middle
        cx, width = s / 2, s * 0.035
        for i, color in enumerate(RAINBOW):
            r = s * 0.46 - i * width
            draw.arc([cx - r, horizon - r, cx + r, horizon + r], 180, 360, fill=color, width=max(1, round(width)))
    cx, cy, r = s * scene.sun_x, s * scene.sun_y, s * scene.sun_r
    if scene.celestial == "sun":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=SUN_COLOR)
    else:  # crescent: a disc with a disc of sky colour cut from its upper right
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=MOON_COLOR)
        ox, oy = cx + 0.55 * r, cy - 0.25 * r
        y0 = max(0, int(oy - r))
        for y in range(y0, min(horizon, int(oy + r) + 1)):  # the cut follows the sky gradient
            t = y / max(1, horizon - 1)
            color = tuple(int(a + (b - a) * t) for a, b in zip(top, bottom, strict=True))
            half = max(0.0, r * r - (y + 0.5 - oy) ** 2) ** 0.5
            if half > 0:
                draw.line([(ox - half, y), (ox + half, y)], fill=color)
    ground = GROUND_COLORS[scene.ground]
    if scene.sunset:
        ground = tuple(int(c * k) for c, k in zip(ground, SUNSET_TINT, strict=True))
    draw.rectangle([0, horizon, s, s], fill=ground)
    for shape in scene.shapes:
        draw_shape(draw, shape, s, horizon)
    if scene.house:
        x0, y0, x1, y1 = (v * s for v in HOUSE_BOX)
        draw.rectangle([x0, y0, x1, y1], fill=HOUSE_WALL)
        draw.polygon([(x0 - 0.02 * s, y0), (x1 + 0.02 * s, y0), ((x0 + x1) / 2, y0 - 0.09 * s)], fill=HOUSE_ROOF)
        dw = (x1 - x0) * 0.25
        draw.rectangle([(x0 + x1) / 2 - dw / 2, y1 - (y1 - y0) * 0.6, (x0 + x1) / 2 + dw / 2, y1], fill=HOUSE_DOOR)
    if scene.style == "black_white":
        img = img.convert("L").convert("RGB")
    elif scene.style == "watercolor":
        img = img.filter(ImageFilter.GaussianBlur(radius=s * 0.02))
        img = Image.blend(img, Image.new("RGB", img.size, (250, 245, 235)), 0.2)
    return img


def draw_shape(draw, shape: Shape, s: int, horizon: int) -> None:
    color = SHAPE_COLORS[shape.color]
    w = shape.size * s
    x0 = shape.x * s
    base = horizon + 0.04 * s  # standing a little in front of the horizon
    if shape.kind == "square":
        draw.rectangle([x0, base - w, x0 + w, base], fill=color)
    elif shape.kind == "triangle":
        draw.polygon([(x0, base), (x0 + w, base), (x0 + w / 2, base - w)], fill=color)
    else:
        draw.ellipse([x0, base - w, x0 + w, base], fill=color)


def render_png(scene: Scene, size: int = 128) -> bytes:
    buf = io.BytesIO()
    render(scene, size).save(buf, format="PNG")
    return buf.getvalue()


def draw_scene(size: int, rng: random.Random) -> bytes:
    """One random procedural scene as PNG bytes."""
    return render_png(random_scene(rng), size)


# -- words ----------------------------------------------------------------------------------------
# Where the sun or moon is, in words: five columns over sun_x's range (0.15-0.85) and two rows split
# at sun_y's median. A caption that leaves the disc's place open asks a model for a small object
# anywhere in a 2-D region, whose mean over the places (what a model predicts from pure noise) is
# no disc at all; the words narrow the place to a cell about one sun wide.
SKY_COLUMNS = ((0.29, "on the far left"), (0.43, "on the left"), (0.57, "in the middle"), (0.71, "on the right"),
               (2.0, "on the far right"))
SKY_HIGH_BELOW = 0.27  # sun_y (fraction of the height, from the top) below it: "high", else "low"
# Whether captions name that place: the shipped demo checkpoint was trained on captions that do
# (`components.demo.train --caption-places 1`), and a model's captions are the words it learned.
# Off only to write data for, or train, a model of the older wording.
CAPTION_PLACES = True


def sky_place(scene: Scene) -> str:
    """The sun's or moon's rough place: "high on the far left", "low in the middle", ..."""
    column = next(words for edge, words in SKY_COLUMNS if scene.sun_x < edge)
    return f"{'high' if scene.sun_y < SKY_HIGH_BELOW else 'low'} {column}"


def caption(scene: Scene, places: bool | None = None) -> str:
    """The scene in words: sky, sun or moon (and its rough place, with `places`; default
    CAPTION_PLACES), light, ground, the shapes left to right, extras."""
    light = " at sunset" if scene.sunset else ""
    body = "a sun" if scene.celestial == "sun" else "a crescent moon"
    if CAPTION_PLACES if places is None else places:
        body += " " + sky_place(scene)
    shapes = [f"a {s.color} {s.kind}" for s in sorted(scene.shapes, key=lambda s: s.x)]
    listed = shapes[0] if len(shapes) == 1 else ", ".join(shapes[:-1]) + " and " + shapes[-1] if shapes else "no shapes"
    text = f"a {scene.sky} sky with {body}{light}, {scene.ground} ground, {listed}"
    if scene.rainbow:
        text += ", a rainbow"
    if scene.house:
        text += ", a small house"
    if scene.style == "black_white":
        text += ", in black and white"
    elif scene.style == "watercolor":
        text += ", as a watercolor painting"
    return text


EDIT_SUMMARIES = {
    "sky_purple": "the sky becomes purple",
    "crescent_moon": "the sun becomes a crescent moon",
    "snow": "the ground becomes snow",
    "red_to_blue": "the red shapes become blue",
    "rainbow": "a rainbow appears across the sky",
    "black_white": "the picture becomes black and white",
    "watercolor": "the picture becomes a watercolor painting",
    "remove_smallest": "the smallest shape is removed",
    "add_house": "a small house appears on the ground",
    "sunset": "the light becomes an orange sunset",
}


def chain_of_thought(kind: str | None, scene: Scene) -> tuple[str, str]:
    """(think, recaption) texts the demo model writes: for an edit, what changes; for a caption
    (kind None), the scene's caption again."""
    if kind is None:
        return "draw the described scene.", caption(scene)
    return f"edit: {EDIT_SUMMARIES[kind]}.", f"the same picture, where {EDIT_SUMMARIES[kind]}."


# -- edits ----------------------------------------------------------------------------------------
def edit_kind(instruction: str) -> str | None:
    """The edit kind of a sample instruction (None for any other text)."""
    return EDIT_KINDS.get(" ".join(str(instruction).lower().split()).rstrip("."))


def apply_edit(scene: Scene, kind: str) -> Scene:
    """The scene after the edit `kind`: its exact target."""
    replace = dataclasses.replace
    if kind == "sky_purple":
        return replace(scene, sky="purple")
    if kind == "crescent_moon":
        return replace(scene, celestial="moon")
    if kind == "snow":
        return replace(scene, ground="snow")
    if kind == "red_to_blue":
        return replace(scene, shapes=tuple(replace(s, color="blue") if s.color == "red" else s for s in scene.shapes))
    if kind == "rainbow":
        return replace(scene, rainbow=True)
    if kind == "black_white":
        return replace(scene, style="black_white")
    if kind == "watercolor":
        return replace(scene, style="watercolor")
    if kind == "remove_smallest":
        if not scene.shapes:
            return scene
        smallest = min(scene.shapes, key=lambda s: s.size)
        return replace(scene, shapes=tuple(s for s in scene.shapes if s is not smallest))
    if kind == "add_house":
        return replace(scene, house=True)
    if kind == "sunset":
        return replace(scene, sunset=True)
    raise ValueError(f"unknown edit kind {kind!r}; known: {', '.join(KIND_INSTRUCTIONS)}")


def edit_example(rng: random.Random, kind: str) -> tuple[Scene, Scene]:
    """(source, target) scenes of one edit."""
    source = random_scene(rng, edit=kind)
    return source, apply_edit(source, kind)


# -- datasets -------------------------------------------------------------------------------------
def _write(uri: str, table: pa.Table, default_name: str) -> str:
    """Write to `uri` if it names a .parquet file, else to `{uri}/{default_name}`; returns the URI."""
    uri = str(uri).rstrip("/")
    if not uri.endswith(".parquet"):
        uri = f"{uri}/{default_name}"
    parent, name = split_uri(uri)
    open_object_store(parent).put_bytes(name, write_parquet_bytes(table))
    return uri


TARGET_FIELDS = [("target", pa.binary()), ("target_scene", pa.string())]


def write_sample_edit_dataset(path: str, n: int = 8, size: int = 256, seed: int = 0, output_size: str = "auto",
                              targets: bool = False) -> str:
    """An edit dataset (id, instruction, image, seed, size=`output_size`) of `n` synthetic `size`^2
    scenes. `targets`: also `target` (the exact edited scene, PNG at `size`) and `target_scene`
    (its parameters as JSON), which `components.evaluate.judge` scores outputs against."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        instruction = EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]
        source, target = edit_example(rng, EDIT_KINDS[instruction])
        row = {"id": f"edit-{i:04d}", "instruction": instruction, "image": render_png(source, size),
               "seed": seed * 1000 + i, "size": output_size}
        if targets:
            row |= {"target": render_png(target, size), "target_scene": target.to_json()}
        rows.append(row)
    schema = pa.schema([("id", pa.string()), ("instruction", pa.string()), ("image", pa.binary()),
                        ("seed", pa.int64()), ("size", pa.string()), *(TARGET_FIELDS if targets else [])])
    return _write(path, pa.Table.from_pylist(rows, schema=schema), "edit.parquet")


def write_sample_generate_dataset(path: str, n: int = 8, seed: int = 0, size: str = "auto",
                                  targets: bool = False, target_size: int = 256) -> str:
    """A text-to-image dataset (id, prompt, seed, size) of `n` scene captions. `targets`: also
    `target` (one scene the caption describes, PNG at `target_size`) and `target_scene`."""
    rng = random.Random(10_000 + seed)  # other scenes than the edit dataset's
    rows = []
    for i in range(n):
        scene = random_caption_scene(rng)
        row = {"id": f"gen-{i:04d}", "prompt": caption(scene), "seed": seed * 1000 + i, "size": size}
        if targets:
            row |= {"target": render_png(scene, target_size), "target_scene": scene.to_json()}
        rows.append(row)
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("size", pa.string()),
                        *(TARGET_FIELDS if targets else [])])
    return _write(path, pa.Table.from_pylist(rows, schema=schema), "generate.parquet")


# Kept for callers that want open-domain prompts (benchmarks, sweeps): the demo model knows only scenes.
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
