"""A semantic judge for the procedural scenes of components/data/sample.py.

Every sample row knows its exact target (the scene re-rendered with the edit applied, or the scene a
caption was drawn from), so an output is scored two ways:

- PSNR and SSIM against the target image (resized to the output's size);
- one check per instruction kind, on the region the instruction is about. For an edit the region is
  where the source and the target differ (the sky for "make the sky purple", the cut of the moon,
  the red shapes, ...): the output must be nearer the target than the source there, and the kind's
  own property must hold (purple sky hue, white ground, grey levels, the named shape's colour, the
  shape gone, the sun's shape, ...). The unedited source fails every check by construction.
  For a caption (text to image) the layout is free (a caption names the sun's rough place, which is
  not checked), so the checks read what the caption names: the sky colour, sun or moon, the ground,
  and each named shape colour.

`passed` is the semantic check; PSNR / SSIM are reported beside it (for captions they compare with
one of many layouts the caption allows, so they are no gate there).
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter

from components.data import sample
from components.data.sample import Scene

# mean |difference| (0-255 levels, over channels) where source and target differ: above it a pixel
# belongs to the edited region
REGION_LEVEL = 30
# the output must be at most this far (mean abs level) from the target in the edited region
REGION_TOLERANCE = 45.0


@dataclass
class Verdict:
    passed: bool
    check: str  # the instruction kind's check ("t2i" for captions)
    detail: str  # what was measured, in words
    psnr: float
    ssim: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- image helpers --------------------------------------------------------------------------------
def load(image) -> Image.Image:
    if isinstance(image, (bytes, bytearray)):
        image = Image.open(io.BytesIO(image))
    return image.convert("RGB")


def fit(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """float [H, W, 3] in 0-255 at `size` (width, height)."""
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    return np.asarray(image, dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    from components.evaluate.metrics import _ssim

    return _ssim(a / 255.0, b / 255.0)


def erode(mask: np.ndarray, pixels: int = 1) -> np.ndarray:
    """The mask shrunk by `pixels` (anti-aliased borders belong to neither side)."""
    image = Image.fromarray(mask.astype(np.uint8) * 255)
    for _ in range(pixels):
        image = image.filter(ImageFilter.MinFilter(3))
    return np.asarray(image) > 0


def differs(a: np.ndarray, b: np.ndarray, level: float = REGION_LEVEL) -> np.ndarray:
    return np.abs(a - b).mean(axis=2) > level


def mean_color(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return image[mask].mean(axis=0) if mask.any() else np.full(3, np.nan)


def nearest(color: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    return min(palette, key=lambda name: float(np.linalg.norm(color - np.array(palette[name]))))


def saturation(image: np.ndarray) -> float:
    """Mean HSV saturation (0-1) over the image."""
    mx, mn = image.max(axis=2), image.min(axis=2)
    return float(np.mean(np.where(mx > 0, (mx - mn) / np.maximum(mx, 1e-9), 0.0)))


def sharpness(image: np.ndarray) -> float:
    """Mean absolute Laplacian of the grey image (edges; a watercolor wash lowers it)."""
    grey = image.mean(axis=2)
    lap = (4 * grey[1:-1, 1:-1] - grey[:-2, 1:-1] - grey[2:, 1:-1] - grey[1:-1, :-2] - grey[1:-1, 2:])
    return float(np.abs(lap).mean())


def sky_palette(scene: Scene) -> dict[str, tuple[int, int, int]]:
    """The mid-sky colour of each sky name (the gradient's middle) and of a sunset sky."""
    mid = lambda pair: tuple((a + b) // 2 for a, b in zip(*pair, strict=True))  # noqa: E731
    return {**{name: mid(pair) for name, pair in sample.SKY_COLORS.items()}, "sunset": mid(sample.SUNSET_SKY)}


# -- edits ----------------------------------------------------------------------------------------
def judge_edit(output, source, target, instruction: str) -> Verdict:
    """Score an edit output against the source image and the exact target (images or PNG bytes)."""
    out_img = load(output)
    size = out_img.size
    out, src, tgt = (fit(load(x), size) for x in (out_img, source, target))
    kind = sample.edit_kind(instruction)
    p, s = psnr(out, tgt), ssim(out, tgt)
    if kind is None:
        return Verdict(False, "unknown", f"no check for instruction {instruction!r}", p, s)
    region = erode(differs(src, tgt), 1)
    if not region.any():
        return Verdict(False, kind, "source and target do not differ: nothing to check", p, s)
    to_target = float(np.abs(out - tgt)[region].mean())
    to_source = float(np.abs(out - src)[region].mean())
    moved = to_target < to_source and to_target < REGION_TOLERANCE
    detail = f"edited region ({int(region.sum())} px): {to_target:.0f} levels from target, {to_source:.0f} from source"
    ok, extra = KIND_CHECKS[kind](out, src, tgt, region)
    return Verdict(bool(moved and ok), kind, f"{detail}; {extra}", p, s)


def _hue_check(expected_color: tuple[int, int, int], other: dict[str, tuple[int, int, int]]):
    """The region's mean colour is nearer `expected_color` than any colour of `other`."""
    def check(out, src, tgt, region):
        palette = {"expected": expected_color, **other}
        got = nearest(mean_color(out, region), palette)
        return got == "expected", f"region colour nearest {got}"
    return check


def _sky_check(name: str):
    def check(out, src, tgt, region):
        target_mean = mean_color(tgt, region)
        source_mean = mean_color(src, region)
        got = mean_color(out, region)
        ok = np.linalg.norm(got - target_mean) < np.linalg.norm(got - source_mean)
        return bool(ok), f"sky colour {np.round(got).astype(int).tolist()} (want {name})"
    return check


def _snow(out, src, tgt, region):
    got = mean_color(out, region)
    return bool(got.min() > 200), f"ground colour {np.round(got).astype(int).tolist()} (want white)"


def _black_white(out, src, tgt, region):
    sat = saturation(out)
    return sat < 0.08, f"saturation {sat:.3f} (grey-level below 0.08)"


def _watercolor(out, src, tgt, region):
    got, want, before = sharpness(out), sharpness(tgt), sharpness(src)
    return abs(got - want) < abs(got - before), f"sharpness {got:.2f} (target {want:.2f}, source {before:.2f})"


def _shape_gone(out, src, tgt, region):
    """The smallest shape's pixels now show the background (the count drops by one)."""
    got = mean_color(out, region)
    d_bg, d_shape = np.linalg.norm(got - mean_color(tgt, region)), np.linalg.norm(got - mean_color(src, region))
    return bool(d_bg < d_shape), f"removed shape's area {np.round(got).astype(int).tolist()}: background"


def _crescent(out, src, tgt, region):
    """The cut of the disc shows sky, and no sun-yellow is left there."""
    got = mean_color(out, region)
    yellow = np.linalg.norm(got - np.array(sample.SUN_COLOR))
    sky = np.linalg.norm(got - mean_color(tgt, region))
    return bool(sky < yellow), f"moon's cut {np.round(got).astype(int).tolist()}: sky, not sun"


KIND_CHECKS = {
    "sky_purple": _sky_check("purple"),
    "sunset": _sky_check("orange sunset"),
    "crescent_moon": _crescent,
    "snow": _snow,
    "red_to_blue": _hue_check(sample.SHAPE_COLORS["blue"], {k: v for k, v in sample.SHAPE_COLORS.items() if k != "blue"}),
    "rainbow": lambda out, src, tgt, region: (True, "rainbow arcs compared above"),
    "black_white": _black_white,
    "watercolor": _watercolor,
    "remove_smallest": _shape_gone,
    "add_house": _hue_check(sample.HOUSE_WALL, {"grass": sample.GROUND_COLORS["grass"],
                                                "sand": sample.GROUND_COLORS["sand"]}),
}


# -- captions (text to image) ---------------------------------------------------------------------
def judge_generate(output, target, scene: Scene) -> Verdict:
    """Score a text-to-image output against the scene its caption describes (layout free)."""
    out_img = load(output)
    size = out_img.size
    out, tgt = fit(out_img, size), fit(load(target), size)
    p, s = psnr(out, tgt), ssim(out, tgt)
    w, h = size
    failures, notes = [], []
    # sky: the top band's colour (above the highest sun and the shapes), away from the sun/moon
    top = out[: int(h * 0.1)]
    want_sky = "sunset" if scene.sunset else scene.sky
    got_sky = nearest(np.median(top.reshape(-1, 3), axis=0), sky_palette(scene))
    (notes if got_sky == want_sky else failures).append(f"sky {got_sky} (want {want_sky})")
    # ground: the bottom band (below the shapes; the house's corner excluded)
    band = out[int(h * 0.97):, : int(w * 0.6)]
    grounds = {name: tuple(int(c * (k if scene.sunset else 1)) for c, k in zip(col, sample.SUNSET_TINT, strict=True))
               for name, col in sample.GROUND_COLORS.items()}
    got_ground = nearest(np.median(band.reshape(-1, 3), axis=0), grounds)
    (notes if got_ground == scene.ground else failures).append(f"ground {got_ground} (want {scene.ground})")
    # sun or moon: sun-yellow pixels above the horizon band
    sky_part = out[: int(h * 0.5)]
    # the disc's pixels stand out from their row's sky (the row median), then sun-yellow or moon-pale
    stands_out = np.abs(sky_part - np.median(sky_part, axis=1, keepdims=True)).mean(axis=2) > 25
    yellow = int((stands_out & _near(sky_part, sample.SUN_COLOR, 70)).sum())
    pale = int((stands_out & _near(sky_part, sample.MOON_COLOR, 50)).sum())
    disc = math.pi * (0.07 * w) ** 2
    got_body = "sun" if yellow > 0.4 * disc else "moon" if pale > 0.15 * disc else "none"
    (notes if got_body == scene.celestial else failures).append(f"{got_body} (want {scene.celestial})")
    # each named shape colour shows up near the horizon
    for color in sorted({sh.color for sh in scene.shapes}):
        smallest = min(sh.size for sh in scene.shapes if sh.color == color)
        area = (smallest * w) ** 2 * 0.5  # a triangle's
        found = _count_near(out[int(h * 0.3):], sample.SHAPE_COLORS[color], 70)
        (notes if found > 0.3 * area else failures).append(f"{color} shape {found} px")
    detail = "; ".join(failures or notes)
    return Verdict(not failures, "t2i", ("failed: " if failures else "") + detail, p, s)


def _near(image: np.ndarray, color: tuple[int, int, int], distance: float) -> np.ndarray:
    return np.linalg.norm(image - np.array(color, dtype=np.float64), axis=2) < distance


def _count_near(image: np.ndarray, color: tuple[int, int, int], distance: float) -> int:
    return int(_near(image, color, distance).sum())


# -- rows -----------------------------------------------------------------------------------------
def judge_row(output, row: dict) -> Verdict:
    """One dataset row with its `target` (and `target_scene`) columns, and the row's output image."""
    if row.get("instruction") is not None and row.get("image") is not None:
        return judge_edit(output, row["image"], row["target"], row["instruction"])
    return judge_generate(output, row["target"], Scene.from_json(row["target_scene"]))


def summarize(verdicts: list[Verdict]) -> dict:
    """Pass rate, mean PSNR / SSIM (finite values) and the rows by kind."""
    finite = [v.psnr for v in verdicts if math.isfinite(v.psnr)]
    by_kind: dict[str, list[int]] = {}
    for v in verdicts:
        passed, total = by_kind.get(v.check, [0, 0])
        by_kind[v.check] = [passed + int(v.passed), total + 1]
    return {"rows": len(verdicts), "passed": sum(v.passed for v in verdicts),
            "pass_rate": sum(v.passed for v in verdicts) / len(verdicts) if verdicts else None,
            "mean_psnr": sum(finite) / len(finite) if finite else None,
            "mean_ssim": float(np.nanmean([v.ssim for v in verdicts])) if verdicts else None,
            "by_kind": by_kind}


def judge_run(dataset: str, run: str) -> tuple[list[tuple[str, Verdict | None]], dict]:
    """Judge every row of a finished run (`<output>/<run_id>`) against its dataset's targets:
    [(row id, verdict or None when the row has no image)], and the summary of the verdicts."""
    import pyarrow.parquet as pq

    from components.evaluate.runio import load_run_rows, read_image

    outputs = load_run_rows(run)
    results: list[tuple[str, Verdict | None]] = []
    for row in pq.read_table(dataset).to_pylist():
        if row.get("target") is None:
            continue
        out = outputs.get(row["id"])
        image = read_image(out) if out is not None else None
        results.append((row["id"], judge_row(image, row) if image is not None else None))
    return results, summarize([v for _, v in results if v is not None])


def main(argv: list[str] | None = None) -> int:
    """python -m components.evaluate.judge DATASET RUN_DIR: a line per row, then the summary."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("dataset", help="the run's input Parquet file, written with `ardit sample-data --targets`")
    parser.add_argument("run", help="the run directory (<output>/<run_id>)")
    args = parser.parse_args(argv)
    results, summary = judge_run(args.dataset, args.run)
    for row_id, v in results:
        line = "no image" if v is None else f"{'pass' if v.passed else 'FAIL'} {v.psnr:5.1f} dB {v.check}: {v.detail}"
        print(f"{row_id}  {line}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
