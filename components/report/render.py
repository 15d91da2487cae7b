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


def build_context(sweep_dir: Path, max_rows: int = 24, report_dir: Path | None = None) -> dict[str, Any]:
    """Everything the template shows; `report_dir`: where the report goes (image links are
    relative to it; default the sweep directory)."""
    report_dir = report_dir or sweep_dir
    meta_path = sweep_dir / "sweep.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{sweep_dir} is not a sweep directory (no sweep.json); run `ardit sweep` first")
    meta = json.loads(meta_path.read_text())
    meta.setdefault("dataset", (meta.get("base") or {}).get("dataset", "–"))
    meta.setdefault("description", "")
    configs = _read(sweep_dir / "sweep.parquet")
    rows = _read(sweep_dir / "rows.parquet")
    budget = _read(sweep_dir / "budget.parquet")
    runs = sweep_dir / "runs"
    ref_name = meta["reference"]
    ref_rec = next((c for c in configs if c["config"] == ref_name), {})
    timing = meta.get("timing") or {}
    ref_sizes = {str(r["id"]): r for r in rows if r.get("config") == ref_name}
    size_changes: dict[str, dict[str, int]] = {}
    for r in rows:
        if r.get("eval_status") == SIZE_MISMATCH:
            counts = size_changes.setdefault(r["config"], {})
            kind = _size_change(ref_sizes.get(str(r["id"])), r)
            counts[kind] = counts.get(kind, 0) + 1

    config_rows = []
    speed_points = []
    profiles = []
    for rec in configs:
        status = _status(rec)
        th = _thresholds(rec)
        t, time_text, speed = _timing_cells(rec, ref_name)
        n = rec.get("rows") or 0
        config_rows.append(
            {
                "name": rec["config"],
                "label": rec.get("label") or "",
                "role_label": ROLE_LABELS.get(rec.get("role", ""), ""),
                "status": status,
                "status_title": "; ".join(rec.get("violations") or [])
                or ("not gated" if not rec.get("gated") else "all rows pass"),
                "rows_ok": _rows_ok(rec, size_changes.get(rec["config"], {})),
                "psnr_mean": _db(rec.get("psnr_mean")),
                "psnr_min": _db(rec.get("psnr_min")),
                "ssim_min": _f(rec.get("ssim_min")),
                "mean_abs_max": _f(rec.get("mean_abs_max")),
                "p99_abs_max": _f(rec.get("p99_abs_max")),
                "bitwise": f"{rec.get('bitwise_rows', 0)}/{n}" if n else "–",
                "cot": _f(rec.get("cot_similarity_mean"), 3),
                "time": time_text,
                "speed": speed,
                "cls": _cell_classes(rec, th),
            }
        )
        psnr = _num(rec.get("psnr_mean"))
        if t is not None and psnr is not None:
            samples = [float(x) for x in rec.get("time_samples") or []] or [t]
            speed_points.append({"name": rec["config"], "time_s": t, "time_lo": min(samples), "time_hi": max(samples),
                                 "psnr": psnr, "status": status, "reliable": bool(rec.get("speedup_reliable"))})  # fmt: skip
        if rec.get("role") != "reference":
            crow = [r for r in rows if r.get("config") == rec["config"] and r.get("eval_status") == OK]
            if crow:
                worst = max(crow, key=lambda r: _num(r.get("mean_abs")) or 0.0)
                keys = [percentile_key(q) for q in (50, 90, 99, 99.9)] + ["max_abs"]
                profiles.append({"name": rec["config"], "values": [_num(worst.get(k)) for k in keys]})

    # Row grids: rows with failures first, then by worst PSNR over non-reference configs.
    ref_rows_meta: dict[str, Any] = {}
    try:
        ref_rows_meta = load_run_rows(runs / ref_name)
    except (FileNotFoundError, ValueError):
        pass
    try:
        inputs = load_run_inputs(runs / ref_name)  # what each row asked for
    except (OSError, ValueError):
        inputs = {}
    others = [c["config"] for c in configs if c["config"] != ref_name]
    gated_names = [c["config"] for c in configs if c.get("gated")]
    ranking = gated_names or others  # rows are ranked by the configs that gate the sweep
    by_row: dict[str, dict[str, dict[str, Any]]] = {}
    order: list[str] = []
    for r in rows:
        rid = str(r["id"])
        if rid not in by_row:
            by_row[rid] = {}
            order.append(rid)
        by_row[rid][r["config"]] = r

    def badness(rid: str) -> tuple[int, float]:
        cells = [by_row[rid].get(c) for c in ranking]
        failed = sum(1 for c in cells if c is None or c.get("eval_status") != OK)
        psnrs = [_num(c.get("psnr")) for c in cells if c and c.get("eval_status") == OK]
        finite = [p for p in psnrs if p is not None and math.isfinite(p)]
        return (-failed, min(finite) if finite else math.inf)

    ranked = sorted(order, key=badness)
    cfg_th = {c["config"]: _thresholds(c) if c.get("gated") else None for c in configs}
    row_ctx = []
    for rid in ranked[:max_rows]:
        row_ctx.append(_row_context(rid, by_row[rid], ref_name, others, runs, cfg_th, ref_rows_meta.get(rid),
                                    inputs.get(rid), report_dir))

    gated = [c for c in configs if c.get("gated")]
    th_all = Thresholds.from_dict(meta.get("thresholds") or {})
    overrides = []
    for c in configs:
        th = _thresholds(c)
        if c.get("gated") and th and th != th_all:
            overrides.append(f"{c['config']}: {th.describe()}")
    any_small = any(r.get("small") for r in row_ctx)
    spec_path = sweep_dir / "spec.yaml"
    return {
        "meta": meta,
        "verdict": PASS if meta.get("passed") else FAIL,
        "verdict_words": VERDICTS,
        "configs": config_rows,
        "n_gated": len(gated),
        "n_gated_pass": sum(1 for c in gated if c.get("passed")),
        "n_rows": len(order),
        "shown_rows": len(row_ctx),
        "ranked_by": "the gated configs' lowest PSNR" if gated_names else "the lowest PSNR",
        "gates_text": th_all.describe(),
        "overrides_text": "; ".join(overrides),
        "failures": meta.get("failures") or [],
        "speed_plot": plots.speed_fidelity_plot(speed_points, th_all.psnr_min),
        "timing_line": noise_line(timing) if timing else noise_line({"noise": None}),
        "timing_warn": timing.get("noise") is None or timing["noise"] > UNRELIABLE_NOISE,
        "delta_plot": plots.delta_profile_plot(profiles),
        "budget": [_budget_row(b) for b in budget],
        "rows": row_ctx,
        "colorbar": plots.colorbar_plot(),
        "n_cells": len(others) + 1 + (1 if any(r["input_img"] for r in row_ctx) else 0),
        "has_inputs": any(r["input_img"] for r in row_ctx),
        "pixelated": any_small,
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sweep_dir": str(sweep_dir),
        "version": _ardit_version(),
        "spec_text": spec_path.read_text() if spec_path.is_file() else "",
    }


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
        "id": rid, "cells": [], "ref_img": None, "ref_error": "", "ref_info": "", "cot": "", "prompt": "", "small": False,
        "ref_link": _link(ref_path, report_dir), "input_img": None, "input_info": "", "instruction": "",
        "instruction_label": "",
    }  # fmt: skip
    if job is not None:
        ctx["instruction"] = job.text or ""
        ctx["instruction_label"] = "instruction" if job.kind == "edit" else "prompt"
        images = job.pil_images() if job.image or job.reference_image else []
        if images:
            ctx["input_img"] = _thumb(images[0])
            ctx["input_info"] = f"{images[0].size[0]}×{images[0].size[1]}" + (
                f" · + {len(images) - 1} reference image" if len(images) > 1 else "")
    if ref_img is None:
        ctx["ref_error"] = ref_rec.get("eval_error") or "reference image not found"
    else:
        ctx["ref_img"] = _thumb(ref_img)
        ctx["small"] = max(ref_img.size) < 200
        t = _num(ref_rec.get("time_per_image_s"))
        ctx["ref_info"] = f"{ref_img.size[0]}×{ref_img.size[1]}" + (f" · {_secs(t)}" if t is not None else "")
    if ref_meta is not None:
        ctx["cot"] = ref_meta.cot_text or ""
        ctx["prompt"] = _truncate(ref_meta.extra.get("prompt"))
    if ctx["instruction"]:
        ctx["prompt"] = ""  # the full instruction/prompt is shown instead
    psnrs: dict[str, float] = {}
    resized: list[str] = []
    for name in others:
        rec = cells.get(name)
        cell: dict[str, Any] = {
            "config": name,
            "bitwise": False,
            "badge": "",
            "error": "",
            "size_note": "",
            "extra": "",
            "link": "",
            "fails": [],
        }
        ctx["cells"].append(cell)
        if rec is None:
            cell["error"] = "no metrics for this row (run or evaluation failed)"
            cell["badge"] = FAIL
            continue
        th = cfg_th.get(name)
        if rec.get("eval_status") == SIZE_MISMATCH:
            path = _find_image(rec.get("image_path"), runs, name, rid)
            img = _open(path)
            if img is not None and ref_img is not None:
                cell["img"] = _thumb(img)
                cell["link"] = _link(path, report_dir)
                kind = _size_change({"width": ref_img.size[0], "height": ref_img.size[1]},
                                    {"width": img.size[0], "height": img.size[1]})
                cell["size_note"] = f"{kind}: {img.size[0]}×{img.size[1]} vs {ref_img.size[0]}×{ref_img.size[1]}"
                cell["badge"] = FAIL if th is not None and th.active else "SIZE"
                cell["extra"] = _extra(rec)
                resized.append(name)
                continue
        if rec.get("eval_status") != OK:
            cell["error"] = f"{rec.get('eval_status')}: {rec.get('eval_error')}"
            cell["badge"] = FAIL
            continue
        path = _find_image(rec.get("image_path"), runs, name, rid)
        img = _open(path)
        if img is None or ref_img is None:
            cell["error"] = "image file not found for the report"
            continue
        try:
            heat = plots.heatmap_image(abs_diff_map(ref_img, img))
        except ImageMismatchError as exc:
            cell["error"] = str(exc)
            continue
        psnr, ssim = _num(rec.get("psnr")), _num(rec.get("ssim"))
        fails = _failed_metrics(rec, th)
        cell.update(
            img=_thumb(img),
            heat=_thumb(heat),
            link=_link(path, report_dir),
            fails=[text for _, text in fails],
            psnr=_db(psnr),
            ssim=_f(ssim, 3),
            mean_abs=_f(rec.get("mean_abs"), 3),
            p99=_f(rec.get("p99_abs"), 3),
            bitwise=bool(rec.get("bitwise")),
            **{f"{key}_cls": ("bad" if key in dict(fails) else "") for key in ("psnr", "ssim", "mean_abs", "p99")},
        )
        cell["extra"] = _extra(rec)
        if th is not None and th.active and not cell["bitwise"]:
            cell["badge"] = FAIL if row_violations(rec, th) else "PASS"
        if psnr is not None:
            psnrs[name] = psnr
    failed = [c["config"] for c in ctx["cells"] if c.get("error")]
    gated = {n for n, th in cfg_th.items() if th is not None}
    ctx["worst"] = _worst_label(failed, resized, psnrs, gated)
    return ctx


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
