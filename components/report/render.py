"""Build the self-contained HTML report of a sweep directory (see components/sweep/runner.py).

Everything is inlined: images and heatmaps as WebP thumbnails (each linking the run's full-size
PNG beside the report), plots as matplotlib PNG; no scripts and no network resources. The report
shows what each row asked for (the input image and instruction/prompt, from the reference run's
inputs/), the ardit version and the spec.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from PIL import Image

from components.data.images import to_rgb
from components.evaluate.gates import FAIL, PASS, VERDICTS, Thresholds, config_verdict, fmt_db, row_violations
from components.evaluate.metrics import (
    OK,
    SIZE_MISMATCH,
    ImageMismatchError,
    abs_diff_map,
    percentile_key,
)
from components.evaluate.runio import _num, load_run_inputs, load_run_rows, storage_name
from components.report import plots
from components.report.text import environment
from components.sweep.timing import NO_ESTIMATE, noise_line, pct, within_noise_words
from components.report.template import TEMPLATE

ROLE_LABELS = {
    "reference": "reference",
    "determinism": "budget: determinism",
    "reuse_drift": "budget: reuse drift",
    "ar_diversity": "budget: AR diversity",
    "extra": "",
    "grid": "",
}


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    table = pq.read_table(path)
    return table.to_pylist() if table.num_columns else []


def _f(v: Any, digits: int = 4) -> str:
    """Fixed decimals; tiny non-zero values (that would print as 0.0000) in scientific notation."""
    f = _num(v)
    if f is None:
        return "–"
    if f != 0 and abs(f) < 0.5 * 10**-digits:
        return f"{f:.1e}"
    return f"{f:.{digits}f}"


def _db(v: Any) -> str:
    f = _num(v)
    return "–" if f is None else (fmt_db(f) + ("" if math.isinf(f) else " dB"))


def _secs(v: Any) -> str:
    f = _num(v)
    if f is None:
        return "–"
    return f"{f * 1000:.0f} ms" if f < 1 else f"{f:.2f} s"


def _status(rec: dict[str, Any]) -> str:
    """The verdict the sweep stored (the one the CLI printed); recomputed the same way for old sweeps."""
    stored = rec.get("verdict")
    if stored:
        return str(stored)
    return config_verdict(bool(rec.get("passed", False)), bool(rec.get("gated")), rec.get("role") == "reference")


def _rows_ok(rec: dict[str, Any], sizes: dict[str, int]) -> str:
    """rows compared / rows, and why the others have no pixel metrics: another aspect ratio (the
    model picked it, e.g. under another seed) or the same ratio at another size (a real resize)."""
    if rec.get("run_error"):
        return "run failed"
    if rec.get("eval_error"):
        return "eval failed"
    text = f"{rec.get('rows_compared', 0)}/{rec.get('rows') or 0}"
    notes = [f"{sizes[k]} {k}" for k in (OTHER_RATIO, RESIZED) if sizes.get(k)]
    return text + (f" ({', '.join(notes)})" if notes else "")


OTHER_RATIO = "other aspect ratio"
RESIZED = "resized"


def _size_change(ref: dict[str, Any] | None, other: dict[str, Any]) -> str:
    """OTHER_RATIO or RESIZED for a row whose image size differs from the reference's."""
    rw, rh, w, h = (ref or {}).get("width"), (ref or {}).get("height"), other.get("width"), other.get("height")
    if not (rw and rh and w and h):
        return OTHER_RATIO
    return RESIZED if abs(rw / rh - w / h) < 0.01 else OTHER_RATIO


def _cell_classes(rec: dict[str, Any], th: Thresholds | None) -> dict[str, str]:
    cls = {"rows": "", "psnr": "", "ssim": "", "mean_abs": "", "p99": "", "bitwise": ""}
    resized_ok = 0 if rec.get("gated") else (rec.get("rows_size_mismatch") or 0)
    if (rec.get("rows_failed_eval") or 0) > resized_ok or rec.get("run_error") or rec.get("eval_error"):
        cls["rows"] = "bad"
    if th is None or not rec.get("gated") or not rec.get("rows_compared"):
        return cls
    checks = (
        ("psnr", "psnr_min", th.psnr_min, lambda v, t: v >= t),
        ("ssim", "ssim_min", th.ssim_min, lambda v, t: v >= t),
        ("mean_abs", "mean_abs_max", th.mean_abs_max, lambda v, t: v <= t),
        ("p99", "p99_abs_max", th.p99_abs_max, lambda v, t: v <= t),
    )
    for key, col, t, ok in checks:
        v = _num(rec.get(col))
        if t is not None and v is not None:
            cls[key] = "good" if ok(v, t) else "bad"
    if th.bitwise:
        cls["bitwise"] = "good" if rec.get("bitwise_rows") == rec.get("rows") else "bad"
    return cls


# Timing noise above which the report warns that speed comparisons on this machine mean little.
UNRELIABLE_NOISE = 0.25


def _timing_cells(rec: dict[str, Any], ref_name: str) -> tuple[float | None, str, dict[str, str]]:
    """(seconds per image, its text, the 'vs ref' cell: text, class and title)."""
    median = _num(rec.get("time_per_image_s_median"))
    t = median if median is not None else _num(rec.get("time_per_image_s_mean"))
    samples = rec.get("time_samples") or []
    spread = _num(rec.get("time_spread"))
    text = _secs(t)
    if len(samples) >= 2 and spread is not None:
        text += f" (n={len(samples)}, ±{pct(spread)})"
    ratio = _num(rec.get("speedup_vs_ref"))
    note = rec.get("speedup_note") or NO_ESTIMATE
    if rec["config"] == ref_name:
        return t, text, {"text": "ref", "cls": "", "title": "the reference"}
    if ratio is None:
        return t, text, {"text": "–", "cls": "", "title": note}
    if rec.get("speedup_reliable"):
        return t, text, {"text": speed_words(ratio), "cls": "", "title": note}
    # no finding: the ratio stays in the tooltip, the cell says why it means nothing
    return t, text, {"text": within_noise_words(note), "cls": "noisy", "title": f"{speed_words(ratio)}; {note}"}


def speed_words(ratio: float) -> str:
    """A speed ratio (reference time / this time) in words: '1.64× slower', '2.00× faster'."""
    if abs(ratio - 1) < 0.005:
        return "same speed"
    return f"{ratio:.2f}× faster" if ratio > 1 else f"{1 / ratio:.2f}× slower"


def _thresholds(rec: dict[str, Any]) -> Thresholds | None:
    raw = rec.get("thresholds")
    return Thresholds.from_dict(json.loads(raw)) if raw else None


def _find_image(stored: str | None, runs: Path, config: str, row_id: str) -> Path | None:
    if stored and Path(stored).is_file():
        return Path(stored)
    hits = sorted((runs / config / "shards").glob(f"*/images/{storage_name(row_id)}.png"))
    return hits[0] if hits else None


def _open(path: Path | None) -> Image.Image | None:
    if path is None or not path.is_file():
        return None
    with Image.open(path) as im:
        return to_rgb(im)


def _thumb(image: Image.Image) -> str:
    return plots.webp_data_uri(plots.thumbnail(image))


def _link(path: Path | None, base: Path) -> str:
    """The full-size image's address relative to the report's directory ('' when there is none)."""
    return "" if path is None else Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()


def _ardit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ardit")
    except PackageNotFoundError:
        return "unknown"


def _truncate(text: str | None, n: int = 140) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


@dataclass
class _Sweep:
    """A sweep directory's tables as the report reads them."""

    dir: Path
    meta: dict[str, Any]  # sweep.json
    configs: list[dict[str, Any]]  # sweep.parquet: one record per config
    rows: list[dict[str, Any]]  # rows.parquet: one record per (config, row)
    budget: list[dict[str, Any]]  # budget.parquet: one record per precision-budget measure

    @property
    def runs(self) -> Path:
        return self.dir / "runs"

    @property
    def ref_name(self) -> str:
        return str(self.meta["reference"])

    @property
    def gated(self) -> list[dict[str, Any]]:
        return [c for c in self.configs if c.get("gated")]


def _load_sweep(sweep_dir: Path) -> _Sweep:
    meta_path = sweep_dir / "sweep.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{sweep_dir} is not a sweep directory (no sweep.json); run `ardit sweep` first")
    meta = json.loads(meta_path.read_text())
    meta.setdefault("dataset", (meta.get("base") or {}).get("dataset", "–"))
    meta.setdefault("description", "")
    return _Sweep(sweep_dir, meta, _read(sweep_dir / "sweep.parquet"), _read(sweep_dir / "rows.parquet"),
                  _read(sweep_dir / "budget.parquet"))  # fmt: skip


def build_context(sweep_dir: Path, max_rows: int = 24, report_dir: Path | None = None) -> dict[str, Any]:
    """Everything the template shows, section by section; `report_dir`: where the report goes
    (image links are relative to it; default the sweep directory)."""
    sweep = _load_sweep(sweep_dir)
    gates = Thresholds.from_dict(sweep.meta.get("thresholds") or {})
    return {
        **_header_context(sweep),
        **_summary_context(sweep, gates),
        **_plots_context(sweep, gates),
        "budget": [_budget_row(b) for b in sweep.budget],
        **_images_context(sweep, max_rows, report_dir or sweep_dir),
    }


def _header_context(sweep: _Sweep) -> dict[str, Any]:
    """The sweep's name, verdict and provenance: what ran, when, with which ardit and spec."""
    spec_path = sweep.dir / "spec.yaml"
    return {
        "meta": sweep.meta,
        "verdict": PASS if sweep.meta.get("passed") else FAIL,
        "verdict_words": VERDICTS,
        "n_gated": len(sweep.gated),
        "n_gated_pass": sum(1 for c in sweep.gated if c.get("passed")),
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sweep_dir": str(sweep.dir),
        "version": _ardit_version(),
        "spec_text": spec_path.read_text() if spec_path.is_file() else "",
    }


def _summary_context(sweep: _Sweep, gates: Thresholds) -> dict[str, Any]:
    """The summary table (a line per config), the timing noise, the gates and the failures."""
    size_changes = _size_changes(sweep.rows, sweep.ref_name)
    timing = sweep.meta.get("timing") or {}
    return {
        "configs": [_config_row(rec, sweep.ref_name, size_changes.get(rec["config"], {})) for rec in sweep.configs],
        "timing_line": noise_line(timing) if timing else noise_line({"noise": None}),
        "timing_warn": timing.get("noise") is None or timing["noise"] > UNRELIABLE_NOISE,
        "gates_text": gates.describe(),
        "overrides_text": "; ".join(_gate_overrides(sweep.configs, gates)),
        "failures": sweep.meta.get("failures") or [],
    }


def _size_changes(rows: list[dict[str, Any]], ref_name: str) -> dict[str, dict[str, int]]:
    """Per config, how many of its rows have another image size than the reference's, by kind
    (OTHER_RATIO, RESIZED)."""
    ref_sizes = {str(r["id"]): r for r in rows if r.get("config") == ref_name}
    changes: dict[str, dict[str, int]] = {}
    for r in rows:
        if r.get("eval_status") == SIZE_MISMATCH:
            counts = changes.setdefault(r["config"], {})
            kind = _size_change(ref_sizes.get(str(r["id"])), r)
            counts[kind] = counts.get(kind, 0) + 1
    return changes


def _config_row(rec: dict[str, Any], ref_name: str, size_changes: dict[str, int]) -> dict[str, Any]:
    """One config's line of the summary table."""
    _, time_text, speed = _timing_cells(rec, ref_name)
    n = rec.get("rows") or 0
    return {
        "name": rec["config"],
        "label": rec.get("label") or "",
        "role_label": ROLE_LABELS.get(rec.get("role", ""), ""),
        "status": _status(rec),
        "status_title": "; ".join(rec.get("violations") or [])
        or ("not gated" if not rec.get("gated") else "all rows pass"),
        "rows_ok": _rows_ok(rec, size_changes),
        "psnr_mean": _db(rec.get("psnr_mean")),
        "psnr_min": _db(rec.get("psnr_min")),
        "ssim_min": _f(rec.get("ssim_min")),
        "mean_abs_max": _f(rec.get("mean_abs_max")),
        "p99_abs_max": _f(rec.get("p99_abs_max")),
        "bitwise": f"{rec.get('bitwise_rows', 0)}/{n}" if n else "–",
        "cot": _f(rec.get("cot_similarity_mean"), 3),
        "time": time_text,
        "speed": speed,
        "cls": _cell_classes(rec, _thresholds(rec)),
    }


def _gate_overrides(configs: list[dict[str, Any]], gates: Thresholds) -> list[str]:
    """'config: gates' for each gated config whose gates differ from the sweep's."""
    overrides = []
    for c in configs:
        th = _thresholds(c)
        if c.get("gated") and th and th != gates:
            overrides.append(f"{c['config']}: {th.describe()}")
    return overrides


def _plots_context(sweep: _Sweep, gates: Thresholds) -> dict[str, Any]:
    """Speed against fidelity per config, and the |Δ| percentile profile of each config's worst row."""
    speed_points = [p for p in (_speed_point(rec, sweep.ref_name) for rec in sweep.configs) if p]
    profiles = [p for p in (_delta_profile(rec, sweep.rows) for rec in sweep.configs) if p]
    return {
        "speed_plot": plots.speed_fidelity_plot(speed_points, gates.psnr_min),
        "delta_plot": plots.delta_profile_plot(profiles),
    }


def _speed_point(rec: dict[str, Any], ref_name: str) -> dict[str, Any] | None:
    """A config's point on the speed/fidelity plot (none without a time or a mean PSNR)."""
    t, _, _ = _timing_cells(rec, ref_name)
    psnr = _num(rec.get("psnr_mean"))
    if t is None or psnr is None:
        return None
    samples = [float(x) for x in rec.get("time_samples") or []] or [t]
    return {"name": rec["config"], "time_s": t, "time_lo": min(samples), "time_hi": max(samples),
            "psnr": psnr, "status": _status(rec), "reliable": bool(rec.get("speedup_reliable"))}  # fmt: skip


def _delta_profile(rec: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The |Δ| percentiles of a config's worst compared row (by mean |Δ|); none for the reference."""
    if rec.get("role") == "reference":
        return None
    compared = [r for r in rows if r.get("config") == rec["config"] and r.get("eval_status") == OK]
    if not compared:
        return None
    worst = max(compared, key=lambda r: _num(r.get("mean_abs")) or 0.0)
    keys = [percentile_key(q) for q in (50, 90, 99, 99.9)] + ["max_abs"]
    return {"name": rec["config"], "values": [_num(worst.get(k)) for k in keys]}


def _images_context(sweep: _Sweep, max_rows: int, report_dir: Path) -> dict[str, Any]:
    """The row cards, worst rows first: rows with failures, then by the lowest PSNR."""
    ref_name = sweep.ref_name
    try:
        ref_rows_meta = load_run_rows(sweep.runs / ref_name)
    except (FileNotFoundError, ValueError):
        ref_rows_meta = {}
    try:
        inputs = load_run_inputs(sweep.runs / ref_name)  # what each row asked for
    except (OSError, ValueError):
        inputs = {}
    others = [c["config"] for c in sweep.configs if c["config"] != ref_name]
    gated_names = [c["config"] for c in sweep.gated]
    by_row = _cells_by_row(sweep.rows)
    ranked = sorted(by_row, key=lambda rid: _row_badness(by_row[rid], gated_names or others))
    cfg_th = {c["config"]: _thresholds(c) if c.get("gated") else None for c in sweep.configs}
    cards = [_row_context(rid, by_row[rid], ref_name, others, sweep.runs, cfg_th, ref_rows_meta.get(rid),
                          inputs.get(rid), report_dir) for rid in ranked[:max_rows]]  # fmt: skip
    has_inputs = any(r["input_img"] for r in cards)
    return {
        "n_rows": len(by_row),
        "shown_rows": len(cards),
        "ranked_by": "the gated configs' lowest PSNR" if gated_names else "the lowest PSNR",
        "rows": cards,
        "colorbar": plots.colorbar_plot(),
        "n_cells": len(others) + 1 + (1 if has_inputs else 0),
        "has_inputs": has_inputs,
        "pixelated": any(r.get("small") for r in cards),
    }


def _cells_by_row(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """row id -> config -> that row's record, rows in the order they first appear."""
    by_row: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_row.setdefault(str(r["id"]), {})[r["config"]] = r
    return by_row


def _row_badness(cells: dict[str, dict[str, Any]], ranking: list[str]) -> tuple[int, float]:
    """Sort key of a row over the configs that rank rows (the gated ones, else all but the
    reference): most failed cells first, then the lowest finite PSNR."""
    ranked = [cells.get(c) for c in ranking]
    failed = sum(1 for c in ranked if c is None or c.get("eval_status") != OK)
    psnrs = [_num(c.get("psnr")) for c in ranked if c and c.get("eval_status") == OK]
    finite = [p for p in psnrs if p is not None and math.isfinite(p)]
    return (-failed, min(finite) if finite else math.inf)


def _budget_row(b: dict[str, Any]) -> dict[str, Any]:
    used, rows = b.get("rows_used") or 0, b.get("rows")
    token_rows = b.get("token_rows") or 0
    div = _num(b.get("first_divergence_median"))
    return {
        "measure": b.get("measure"),
        "config": b.get("config"),
        "rows": f"{used}/{rows}" if rows else "–",
        "bitwise": f"{b.get('bitwise_rows', 0)}/{used}" if used else "–",
        "psnr_mean": _db(b.get("psnr_mean")),
        "psnr_min": _db(b.get("psnr_min")),
        "ssim_mean": _f(b.get("ssim_mean")),
        "mean_abs": _f(b.get("mean_abs_mean")),
        "p99": _f(b.get("p99_abs_max")),
        "cot": _f(b.get("cot_similarity_mean"), 3),
        "tokens": f"{b.get('tokens_identical_rows', 0)}/{token_rows}" if token_rows else "–",
        "div": "none" if token_rows and div is None else ("–" if div is None else f"token {div:.0f}"),
        "latent": _f(b.get("latent_cos_dist_mean"), 5),
        "note": b.get("note") or "",
    }


def _row_context(
    rid: str,
    cells: dict[str, dict[str, Any]],
    ref_name: str,
    others: list[str],
    runs: Path,
    cfg_th: dict[str, Thresholds | None],
    ref_meta: Any,
    job: Any = None,
    report_dir: Path | None = None,
) -> dict[str, Any]:
    """One row's card: what was asked (input image, instruction/prompt), the reference and every
    other config's image with its |Δ| heatmap and metrics (failed metrics marked in words)."""
    report_dir = report_dir or runs.parent
    ref_rec = cells.get(ref_name, {})
    ref_path = _find_image(ref_rec.get("image_path") or ref_rec.get("ref_image_path"), runs, ref_name, rid)
    ref_img = _open(ref_path)
    ctx: dict[str, Any] = {
        "id": rid, "cells": [], "cot": "", "prompt": "", "ref_link": _link(ref_path, report_dir),
        **_ask_context(job), **_reference_context(ref_rec, ref_img),
    }  # fmt: skip
    if ref_meta is not None:
        ctx["cot"] = ref_meta.cot_text or ""
        ctx["prompt"] = _truncate(ref_meta.extra.get("prompt"))
    if ctx["instruction"]:
        ctx["prompt"] = ""  # the full instruction/prompt is shown instead
    psnrs: dict[str, float] = {}
    resized: list[str] = []
    for name in others:
        rec = cells.get(name)
        cell = _config_cell(name, rec, rid, runs, cfg_th.get(name), ref_img, report_dir)
        ctx["cells"].append(cell)
        psnr = _num(rec.get("psnr")) if rec and "heat" in cell else None  # compared cells only
        if cell["size_note"]:
            resized.append(name)
        elif psnr is not None:
            psnrs[name] = psnr
    failed = [c["config"] for c in ctx["cells"] if c.get("error")]
    gated = {n for n, th in cfg_th.items() if th is not None}
    ctx["worst"] = _worst_label(failed, resized, psnrs, gated)
    return ctx


def _ask_context(job: Any) -> dict[str, Any]:
    """What the row asked for: its instruction or prompt and its input image (when it has one)."""
    ctx: dict[str, Any] = {"instruction": "", "instruction_label": "", "input_img": None, "input_info": ""}
    if job is None:
        return ctx
    ctx["instruction"] = job.text or ""
    ctx["instruction_label"] = "instruction" if job.kind == "edit" else "prompt"
    images = job.pil_images() if job.image or job.reference_image else []
    if images:
        ctx["input_img"] = _thumb(images[0])
        ctx["input_info"] = f"{images[0].size[0]}×{images[0].size[1]}" + (
            f" · + {len(images) - 1} reference image" if len(images) > 1 else "")
    return ctx


def _reference_context(ref_rec: dict[str, Any], ref_img: Image.Image | None) -> dict[str, Any]:
    """The reference's image, its size and time, or why it is missing."""
    if ref_img is None:
        return {"ref_img": None, "small": False, "ref_info": "",
                "ref_error": ref_rec.get("eval_error") or "reference image not found"}  # fmt: skip
    t = _num(ref_rec.get("time_per_image_s"))
    return {
        "ref_img": _thumb(ref_img),
        "small": max(ref_img.size) < 200,
        "ref_info": f"{ref_img.size[0]}×{ref_img.size[1]}" + (f" · {_secs(t)}" if t is not None else ""),
        "ref_error": "",
    }


def _config_cell(
    name: str,
    rec: dict[str, Any] | None,
    rid: str,
    runs: Path,
    th: Thresholds | None,
    ref_img: Image.Image | None,
    report_dir: Path,
) -> dict[str, Any]:
    """One config's cell of a row card: its image and |Δ| heatmap with the metrics, its image with
    the size it has instead of the reference's, or why there is neither."""
    cell: dict[str, Any] = {"config": name, "bitwise": False, "badge": "", "error": "", "size_note": "", "extra": "",
                            "link": "", "fails": []}  # fmt: skip
    if rec is None:
        return {**cell, "error": "no metrics for this row (run or evaluation failed)", "badge": FAIL}
    if rec.get("eval_status") == SIZE_MISMATCH:
        path = _find_image(rec.get("image_path"), runs, name, rid)
        img = _open(path)
        if img is not None and ref_img is not None:
            return {**cell, **_resized_cell(rec, img, ref_img, th), "link": _link(path, report_dir)}
    if rec.get("eval_status") != OK:
        return {**cell, "error": f"{rec.get('eval_status')}: {rec.get('eval_error')}", "badge": FAIL}
    path = _find_image(rec.get("image_path"), runs, name, rid)
    img = _open(path)
    if img is None or ref_img is None:
        return {**cell, "error": "image file not found for the report"}
    try:
        heat = plots.heatmap_image(abs_diff_map(ref_img, img))
    except ImageMismatchError as exc:
        return {**cell, "error": str(exc)}
    fails = _failed_metrics(rec, th)
    cell.update(
        img=_thumb(img),
        heat=_thumb(heat),
        link=_link(path, report_dir),
        fails=[text for _, text in fails],
        psnr=_db(rec.get("psnr")),
        ssim=_f(rec.get("ssim"), 3),
        mean_abs=_f(rec.get("mean_abs"), 3),
        p99=_f(rec.get("p99_abs"), 3),
        bitwise=bool(rec.get("bitwise")),
        extra=_extra(rec),
        **{f"{key}_cls": ("bad" if key in dict(fails) else "") for key in ("psnr", "ssim", "mean_abs", "p99")},
    )
    if th is not None and th.active and not cell["bitwise"]:
        cell["badge"] = FAIL if row_violations(rec, th) else "PASS"
    return cell


def _resized_cell(
    rec: dict[str, Any], img: Image.Image, ref_img: Image.Image, th: Thresholds | None
) -> dict[str, Any]:
    """A cell whose image has another size than the reference's: no pixel metrics, the sizes in words."""
    (w, h), (rw, rh) = img.size, ref_img.size
    kind = _size_change({"width": rw, "height": rh}, {"width": w, "height": h})
    return {
        "img": _thumb(img),
        "size_note": f"{kind}: {w}×{h} vs {rw}×{rh}",
        "badge": FAIL if th is not None and th.active else "SIZE",
        "extra": _extra(rec),
    }


def _failed_metrics(rec: dict[str, Any], th: Thresholds | None) -> list[tuple[str, str]]:
    """(metric, 'PSNR 21.3 dB < 30 dB') for each gate this row misses (none when not gated)."""
    if th is None or not th.active:
        return []
    out = []
    checks = (("psnr", "psnr", th.psnr_min, "PSNR", " dB", 1), ("ssim", "ssim", th.ssim_min, "SSIM", "", 1),
              ("mean_abs", "mean_abs", th.mean_abs_max, "mean |Δ|", "", -1), ("p99", "p99_abs", th.p99_abs_max, "p99 |Δ|", "", -1))  # fmt: skip
    for key, col, limit, label, unit, sign in checks:
        v = _num(rec.get(col))
        if limit is None or v is None:
            continue
        if (sign > 0 and v < limit) or (sign < 0 and v > limit):
            shown = _db(v) if key == "psnr" else _f(v, 3)
            out.append((key, f"{label} {shown} {'<' if sign > 0 else '>'} {limit:g}{unit}"))
    if th.bitwise and not rec.get("bitwise"):
        out.append(("bitwise", "not bitwise identical"))
    return out


def _worst_label(failed: list[str], resized: list[str], psnrs: dict[str, float], gated: set[str]) -> str:
    """What is worst in a row over every config shown under it, gated or not; when the worst is an
    ungated config, the worst gated one too (rows are ranked by those)."""
    parts = []
    if failed:
        parts.append("failed in " + ", ".join(failed))
    if resized:
        parts.append("size differs in " + ", ".join(resized))
    finite = {n: p for n, p in psnrs.items() if math.isfinite(p)}
    if finite:
        name = min(finite, key=lambda n: finite[n])
        parts.append(f"{_db(finite[name])} ({name}{'' if name in gated else ', not gated'})")
        gated_finite = {n: p for n, p in finite.items() if n in gated}
        if name not in gated and gated_finite:
            g = min(gated_finite, key=lambda n: gated_finite[n])
            parts.append(f"worst gated {_db(gated_finite[g])} ({g})")
    return " · ".join(parts) or "identical to the reference"


def _extra(rec: dict[str, Any]) -> str:
    """The AR side and timing of one cell: CoT similarity, token divergence, KV path, time."""
    extra = []
    cot = _num(rec.get("cot_similarity"))
    if cot is not None and cot < 1:
        extra.append(f"CoT sim {cot:.3f}")
    if rec.get("tokens_identical") is False and rec.get("first_divergence") is not None:
        extra.append(f"tokens diverge @{rec['first_divergence']}")
    if rec.get("kv_path"):
        extra.append(f"kv {rec['kv_path']}")
    t = _num(rec.get("time_per_image_s"))
    if t is not None:
        extra.append(_secs(t))
    return " · ".join(extra)


def render_report(sweep_dir: str | Path, max_rows: int = 24, report_dir: Path | None = None) -> str:
    return environment().from_string(TEMPLATE).render(**build_context(Path(sweep_dir), max_rows, report_dir))


def write_report(sweep_dir: str | Path, out: str | Path | None = None, *, max_rows: int = 24) -> Path:
    sweep_dir = Path(sweep_dir)
    path = Path(out) if out else sweep_dir / "report.html"
    html = render_report(sweep_dir, max_rows, path.parent)
    path.write_text(html, encoding="utf-8")
    return path
