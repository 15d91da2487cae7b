"""Accuracy thresholds, per-row checks and the per-config summary of row metrics."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import pyarrow as pa

from components.evaluate.metrics import MISMATCH_LEVELS, OK, SIZE_MISMATCH, mismatch_key


# One verdict vocabulary for a config, used by the sweep CLI, sweep.parquet and the report alike.
REF, PASS, FAIL, INFO = "REF", "PASS", "FAIL", "INFO"
VERDICTS: dict[str, str] = {
    REF: "the reference: every other config is compared with it",
    PASS: "gated: every row passes its thresholds",
    FAIL: "a run or row failed, or a gated config missed a threshold (fails the sweep)",
    INFO: "not gated: measured and shown, never fails the sweep on its numbers",
}


def config_verdict(passed: bool, gated: bool, reference: bool) -> str:
    """The verdict of one config: a failure first, then the reference, then gated or not."""
    if not passed:
        return FAIL
    if reference:
        return REF
    return PASS if gated else INFO


@dataclass(frozen=True)
class Thresholds:
    """Per-image gates (None = not checked). Defaults in the sweep spec follow vLLM-Omni's
    pixel-accuracy test: PSNR >= 30 dB, SSIM >= 0.97, mean |delta| <= 0.03, p99 |delta| <= 0.30.
    `bitwise: true` asks for identical pixels (the determinism floor of a re-run)."""

    psnr_min: float | None = None
    ssim_min: float | None = None
    mean_abs_max: float | None = None
    p99_abs_max: float | None = None
    bitwise: bool | None = None
    # per config: the share of rows the semantic judge passes (components/evaluate/judge.py), for
    # datasets with targets (`dataset: {sample: edit, targets: true}`)
    judge_pass_min: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Thresholds:
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown threshold(s) {sorted(unknown)}; known: {sorted(known)}")
        bitwise = data.pop("bitwise", None)
        if bitwise not in (None, True, False):
            raise ValueError(f"bitwise must be true or false, not {bitwise!r}")
        return cls(bitwise=bitwise or None, **{k: (None if v is None else float(v)) for k, v in data.items()})

    def merged(self, override: dict[str, Any] | None) -> Thresholds:
        """These thresholds with the keys of `override` replaced (a None value disables a gate)."""
        if not override:
            return self
        Thresholds.from_dict(override)  # validates the keys
        return Thresholds.from_dict({**asdict(self), **override})

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @property
    def active(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def describe(self) -> str:
        parts = ["bitwise identical"] if self.bitwise else []
        if self.psnr_min is not None:
            parts.append(f"PSNR ≥ {self.psnr_min:g} dB")
        if self.ssim_min is not None:
            parts.append(f"SSIM ≥ {self.ssim_min:g}")
        if self.mean_abs_max is not None:
            parts.append(f"mean |Δ| ≤ {self.mean_abs_max:g}")
        if self.p99_abs_max is not None:
            parts.append(f"p99 |Δ| ≤ {self.p99_abs_max:g}")
        if self.judge_pass_min is not None:
            parts.append(f"judge pass ≥ {self.judge_pass_min:.0%}")
        return ", ".join(parts) or "no gates"


def row_violations(row: dict[str, Any], th: Thresholds) -> list[str]:
    """Reasons one metrics row fails the gates (a row that could not be compared always fails)."""
    if row.get("eval_status") != OK:
        return [f"{row.get('eval_status')}: {row.get('eval_error')}"]
    out = []
    if th.bitwise and not row.get("bitwise"):
        out.append(f"not bitwise identical (max |Δ| {row.get('max_abs', math.nan):.4g})")
    psnr, ssim = row.get("psnr"), row.get("ssim")
    if th.psnr_min is not None and not (psnr is not None and psnr >= th.psnr_min):
        out.append(f"PSNR {fmt_db(psnr)} < {th.psnr_min:g} dB")
    if th.ssim_min is not None and not (ssim is not None and ssim >= th.ssim_min):
        out.append(f"SSIM {ssim:.4f} < {th.ssim_min:g}")
    if th.mean_abs_max is not None and not (row.get("mean_abs", math.inf) <= th.mean_abs_max):
        out.append(f"mean |Δ| {row.get('mean_abs'):.4f} > {th.mean_abs_max:g}")
    if th.p99_abs_max is not None and not (row.get("p99_abs", math.inf) <= th.p99_abs_max):
        out.append(f"p99 |Δ| {row.get('p99_abs'):.4f} > {th.p99_abs_max:g}")
    return out


def fmt_db(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return "∞" if math.isinf(v) else f"{v:.2f}"


def _vals(rows: list[dict[str, Any]], key: str) -> list[float]:
    out = []
    for r in rows:
        v = r.get(key)
        if v is None or isinstance(v, bool):
            continue
        v = float(v)
        if not math.isnan(v):
            out.append(v)
    return out


def _mean(v: list[float]) -> float | None:
    return float(sum(v) / len(v)) if v else None


def summarize(rows: list[dict[str, Any]], th: Thresholds | None = None) -> dict[str, Any]:
    """Aggregate one config's row metrics. PSNR mean is inf only when every row is identical."""
    ok = [r for r in rows if r.get("eval_status") == OK]
    out: dict[str, Any] = {
        "rows": len(rows),
        "rows_compared": len(ok),
        "rows_failed_eval": len(rows) - len(ok),
        "psnr_mean": _mean(_vals(ok, "psnr")),
        "psnr_min": min(_vals(ok, "psnr"), default=None),
        "ssim_mean": _mean(_vals(ok, "ssim")),
        "ssim_min": min(_vals(ok, "ssim"), default=None),
        "mean_abs_mean": _mean(_vals(ok, "mean_abs")),
        "mean_abs_max": max(_vals(ok, "mean_abs"), default=None),
        "p99_abs_max": max(_vals(ok, "p99_abs"), default=None),
        "max_abs": max(_vals(ok, "max_abs"), default=None),
        "mismatch_any_mean": _mean(_vals(ok, "mismatch_any")),
    }
    for level in MISMATCH_LEVELS:
        out[f"{mismatch_key(level)}_mean"] = _mean(_vals(ok, mismatch_key(level)))
    out["bitwise_rows"] = sum(1 for r in ok if r.get("bitwise"))
    out["rows_size_mismatch"] = sum(1 for r in rows if r.get("eval_status") == SIZE_MISMATCH)
    # AR-side metrics come from every row whose text/tokens could be compared (even a size change).
    out["cot_similarity_mean"] = _mean(_vals(rows, "cot_similarity"))
    tok = [r for r in rows if r.get("tokens_identical") is not None]
    out["token_rows"] = len(tok)
    out["tokens_identical_rows"] = sum(1 for r in tok if r["tokens_identical"])
    divs = sorted(int(r["first_divergence"]) for r in tok if r.get("first_divergence") is not None)
    out["first_divergence_median"] = float(divs[len(divs) // 2]) if divs else None
    out["latent_cos_dist_mean"] = _mean(_vals(ok, "latent_cos_dist"))
    for key in ("time_per_image_s", "ar_prefill_s", "ar_decode_s", "dit_total_s", "vae_decode_s"):
        out[f"{key}_mean"] = _mean(_vals(rows, key))
    if th is not None:
        violations = []
        for r in rows:
            for reason in row_violations(r, th):
                violations.append(f"{r.get('id')}: {reason}")
        out["violations"] = violations
        out["passed"] = not violations
    return out


def records_to_table(records: list[dict[str, Any]]) -> pa.Table:
    """A table over the union of the records' keys (first-seen order); missing values are null."""
    keys: list[str] = []
    seen: set[str] = set()
    for r in records:
        for k in r:
            if k not in seen:
                seen.add(k)
                keys.append(k)
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in records])
