"""Image, latent and text metrics for comparing two runs of the same job.

Pixels are compared as floats in [0, 1] (uint8 images are divided by 255). PSNR and SSIM come from
scikit-image (`peak_signal_noise_ratio`, `structural_similarity` with `channel_axis=-1` and
`data_range=1`), the same definitions the vLLM-Omni accuracy gates use. Absolute-difference
statistics (mean, percentiles, mismatch ratios) are taken over every channel value, so `p99_abs` is
the 99th percentile of |ref - other| over H x W x C values.

`compare_runs` matches the rows of two run directories by id and never drops a row silently: a row
that is missing, failed, has no image or differs in size gets an explicit `eval_status` and
`eval_error`, and counts as a failure.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from components.evaluate.runio import RunRow, load_latents, load_run_rows, read_image

ImageLike = Image.Image | np.ndarray

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)
# Mismatch tolerances in 8-bit levels: fraction of values with |delta| > k/255.
MISMATCH_LEVELS: tuple[int, ...] = (1, 4, 16)

OK = "ok"
# eval_status values other than OK: the row could not be compared and counts as a failure.
MISSING_IN_RUN = "missing_in_run"
MISSING_IN_REF = "missing_in_ref"
ERROR_IN_RUN = "error_in_run"
ERROR_IN_REF = "error_in_ref"
IMAGE_MISSING = "image_missing"
SIZE_MISMATCH = "size_mismatch"


class ImageMismatchError(ValueError):
    """The two images cannot be compared pixel by pixel (different size or channel count)."""


def percentile_key(q: float) -> str:
    """Column name of an |delta| percentile: 50 -> 'p50_abs', 99.9 -> 'p99_9_abs'."""
    text = f"{q:g}".replace(".", "_")
    return f"p{text}_abs"


def mismatch_key(level: int) -> str:
    return f"mismatch_gt_{level}"


def to_float_array(image: ImageLike) -> np.ndarray:
    """H x W x C float64 array in [0, 1]. PIL images are converted to RGB (alpha is dropped)."""
    if isinstance(image, Image.Image):
        if image.mode not in ("RGB", "L"):
            image = image.convert("RGB")
        arr = np.asarray(image)
    else:
        arr = np.asarray(image)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise ImageMismatchError(f"expected an H x W [x C] image, got shape {arr.shape}")
    if arr.dtype == np.uint8:
        return arr.astype(np.float64) / 255.0
    if arr.dtype == np.uint16:
        return arr.astype(np.float64) / 65535.0
    if arr.dtype == np.bool_:
        return arr.astype(np.float64)
    out = arr.astype(np.float64)
    if out.size and (np.nanmin(out) < -1e-6 or np.nanmax(out) > 1 + 1e-6):
        raise ValueError("float images must hold values in [0, 1]")
    return out


def _raw_array(image: ImageLike) -> np.ndarray:
    if isinstance(image, Image.Image):
        if image.mode not in ("RGB", "L"):
            image = image.convert("RGB")
        return np.asarray(image)
    return np.asarray(image)


def _ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM with the default 7x7 window, shrunk (odd) for images smaller than 7 pixels."""
    side = min(a.shape[0], a.shape[1])
    win = min(7, side if side % 2 == 1 else side - 1)
    if win < 3:
        return float("nan")
    from skimage.metrics import structural_similarity  # ardit[sweep], imported when first used

    return float(structural_similarity(a, b, channel_axis=-1, data_range=1.0, win_size=win))


def compare_images(ref: ImageLike, other: ImageLike) -> dict[str, Any]:
    """All pixel metrics of `other` against `ref`.

    Returns psnr (inf when identical), ssim, mse, mean_abs, p50/p90/p99/p99_9_abs, max_abs,
    mismatch_any and mismatch_gt_{1,4,16} (fractions of values), bitwise (identical arrays in their
    original dtype), width and height. Raises ImageMismatchError when the shapes differ.
    """
    raw_a, raw_b = _raw_array(ref), _raw_array(other)
    a, b = to_float_array(ref), to_float_array(other)
    if a.shape != b.shape:
        raise ImageMismatchError(
            f"size mismatch: reference {a.shape[1]}x{a.shape[0]}x{a.shape[2]}, "
            f"other {b.shape[1]}x{b.shape[0]}x{b.shape[2]}"
        )
    delta = np.abs(a - b)
    mse = float(np.mean((a - b) ** 2)) if delta.size else 0.0
    if mse == 0.0:
        psnr = math.inf
    else:
        from skimage.metrics import peak_signal_noise_ratio  # ardit[sweep], imported when first used

        psnr = float(peak_signal_noise_ratio(a, b, data_range=1.0))
    flat = delta.ravel()
    out: dict[str, Any] = {
        "psnr": psnr,
        "ssim": _ssim(a, b),
        "mse": mse,
        "mean_abs": float(flat.mean()) if flat.size else 0.0,
    }
    pct = np.percentile(flat, PERCENTILES) if flat.size else np.zeros(len(PERCENTILES))
    for q, v in zip(PERCENTILES, pct):
        out[percentile_key(q)] = float(v)
    out["max_abs"] = float(flat.max()) if flat.size else 0.0
    out["mismatch_any"] = float(np.mean(flat > 0)) if flat.size else 0.0
    for level in MISMATCH_LEVELS:
        # 1e-9 keeps an exact k/255 step (float rounding) on the "within tolerance" side.
        out[mismatch_key(level)] = float(np.mean(flat > level / 255.0 + 1e-9)) if flat.size else 0.0
    out["bitwise"] = bool(raw_a.shape == raw_b.shape and raw_a.dtype == raw_b.dtype and np.array_equal(raw_a, raw_b))
    out["width"] = int(a.shape[1])
    out["height"] = int(a.shape[0])
    return out


def abs_diff_map(ref: ImageLike, other: ImageLike) -> np.ndarray:
    """H x W map of |delta| averaged over channels (for heatmaps)."""
    a, b = to_float_array(ref), to_float_array(other)
    if a.shape != b.shape:
        raise ImageMismatchError(f"size mismatch: {a.shape} vs {b.shape}")
    return np.abs(a - b).mean(axis=2)


def latent_cosine_distance(a: Any, b: Any) -> float:
    """1 - cos(a, b) over the flattened tensors (0 = same direction). NaN if shapes differ."""
    x = np.asarray(_to_numpy(a), dtype=np.float64).ravel()
    y = np.asarray(_to_numpy(b), dtype=np.float64).ravel()
    if x.shape != y.shape or x.size == 0:
        return float("nan")
    if np.array_equal(x, y):
        return 0.0  # exactly, not 1 - (1 - eps)
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    if nx == 0 or ny == 0:
        return 0.0 if nx == ny else 1.0
    cos = float(np.dot(x, y) / (nx * ny))
    return 1.0 - min(1.0, max(-1.0, cos))


def _to_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        return t.detach().to("cpu").float().numpy()
    return np.asarray(t)


def text_similarity(a: str | None, b: str | None) -> float:
    """difflib ratio in [0, 1] of two texts (1.0 for two empty or missing texts)."""
    a, b = a or "", b or ""
    if a == b:
        return 1.0
    return float(difflib.SequenceMatcher(None, a, b, autojunk=False).ratio())


def common_prefix_len(a: Sequence[Any] | str | None, b: Sequence[Any] | str | None) -> int:
    a, b = a if a is not None else "", b if b is not None else ""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def first_divergence(a: Sequence[int] | None, b: Sequence[int] | None) -> int | None:
    """Index of the first position where two token id lists differ; None when identical.

    When one list is a strict prefix of the other, the divergence is at the shorter length.
    """
    a = list(a) if a is not None else []
    b = list(b) if b is not None else []
    i = common_prefix_len(a, b)
    if i == len(a) == len(b):
        return None
    return i


@dataclass
class RowPair:
    id: str
    ref: RunRow | None
    other: RunRow | None


def _row_failure(row_id: str, status: str, error: str, pair: RowPair) -> dict[str, Any]:
    out: dict[str, Any] = {"id": row_id, "eval_status": status, "eval_error": error}
    if pair.other is not None:
        out.update(pair.other.timing_fields())
    return out


def compare_rows(pair: RowPair, ref_dir: Path | str, other_dir: Path | str) -> dict[str, Any]:
    """Metrics for one row id of two runs (a failure record when they cannot be compared)."""
    ref, other = pair.ref, pair.other
    if other is None:
        return _row_failure(pair.id, MISSING_IN_RUN, "row missing from the run", pair)
    if ref is None:
        return _row_failure(pair.id, MISSING_IN_REF, "row missing from the reference run", pair)
    if not ref.ok:
        return _row_failure(pair.id, ERROR_IN_REF, f"reference row failed: {ref.error or ref.status}", pair)
    if not other.ok:
        return _row_failure(pair.id, ERROR_IN_RUN, f"row failed: {other.error or other.status}", pair)
    text = _text_metrics(ref, other)  # the AR side compares even when the images cannot
    ref_img, other_img = read_image(ref), read_image(other)
    if ref_img is None or other_img is None:
        which = "reference" if ref_img is None else "run"
        path = ref.image_path if ref_img is None else other.image_path
        return _row_failure(pair.id, IMAGE_MISSING, f"{which} image not found ({path})", pair) | text
    try:
        metrics = compare_images(ref_img, other_img)
    except ImageMismatchError as exc:
        out = _row_failure(pair.id, SIZE_MISMATCH, str(exc), pair) | text
        out["ref_image_path"] = str(ref.image_path)
        out["image_path"] = str(other.image_path)
        out["width"], out["height"] = other_img.size
        return out
    out: dict[str, Any] = {"id": pair.id, "eval_status": OK, "eval_error": ""}
    out.update(metrics)
    out.update(text)
    la, lb = load_latents(ref), load_latents(other)
    out["latent_cos_dist"] = latent_cosine_distance(la, lb) if la is not None and lb is not None else None
    out["ref_image_path"] = str(ref.image_path) if ref.image_path else ""
    out["image_path"] = str(other.image_path) if other.image_path else ""
    out.update(other.timing_fields())
    return out


def _text_metrics(ref: RunRow, other: RunRow) -> dict[str, Any]:
    out: dict[str, Any] = {
        "cot_similarity": text_similarity(ref.cot_text, other.cot_text),
        "cot_prefix_chars": common_prefix_len(ref.cot_text, other.cot_text),
        "tokens_identical": None,
        "first_divergence": None,
    }
    if ref.generated_ids is not None and other.generated_ids is not None:
        div = first_divergence(ref.generated_ids, other.generated_ids)
        out["tokens_identical"] = div is None
        out["first_divergence"] = div
    return out


def compare_runs(ref_run_dir: Path | str, other_run_dir: Path | str) -> list[dict[str, Any]]:
    """One metrics record per row id found in either run, in reference order then extra ids."""
    ref_rows = load_run_rows(ref_run_dir)
    other_rows = load_run_rows(other_run_dir)
    ids = list(ref_rows) + [i for i in other_rows if i not in ref_rows]
    return [compare_rows(RowPair(i, ref_rows.get(i), other_rows.get(i)), ref_run_dir, other_run_dir) for i in ids]
