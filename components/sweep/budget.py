"""Precision budget: how much of a difference is noise, how much is KV reuse, how much is the AR.

From a sweep's row metrics, one entry per budget config (cf. the seed PR: reuse reruns bitwise,
non-reuse reruns 26.7 dB, reuse vs non-reuse 10.2 dB):
- determinism floor: the reference re-run against itself (bitwise rows, PSNR or inf);
- reuse drift: kv_reuse toggled with the AR tokens held fixed (the run takes the reference's AR
  outputs; when the runner cannot pin them, only rows whose generated tokens match are used);
- AR diversity: another seed (CoT similarity, first token divergence, image PSNR).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from components.evaluate.gates import summarize
from components.evaluate.metrics import OK, SIZE_MISMATCH
from components.sweep.spec import AR_DIVERSITY, DETERMINISM, REUSE_DRIFT, SweepConfig

MEASURES = {
    DETERMINISM: "Determinism floor (reference re-run)",
    REUSE_DRIFT: "KV reuse drift (AR tokens fixed)",
    AR_DIVERSITY: "AR diversity (seed change)",
}


# The per-config statistics a precision-budget entry carries.
_BUDGET_STATS = ("rows_compared", "bitwise_rows", "psnr_mean", "psnr_min", "ssim_mean", "mean_abs_mean",
                 "p99_abs_max", "max_abs", "cot_similarity_mean", "tokens_identical_rows", "token_rows",
                 "first_divergence_median", "latent_cos_dist_mean")


def _kv_paths(rows: list[dict[str, Any]]) -> str:
    counts = Counter(str(r.get("kv_path")) for r in rows if r.get("kv_path"))
    return ", ".join(f"{k} {v}/{len(rows)}" for k, v in sorted(counts.items())) or "not recorded"


def compute_budget(
    configs: list[SweepConfig], config_records: list[dict[str, Any]], row_records: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One record per precision-budget config present in the sweep."""
    by_name = {r["config"]: r for r in config_records}
    out: list[dict[str, Any]] = []
    for cfg in configs:
        if cfg.role not in MEASURES:
            continue
        rec = by_name.get(cfg.name, {})
        rows = [r for r in row_records if r.get("config") == cfg.name]
        ref_rows = [r for r in row_records if r.get("config") == cfg.baseline]
        entry: dict[str, Any] = {
            "measure": MEASURES[cfg.role],
            "role": cfg.role,
            "config": cfg.name,
            "baseline": cfg.baseline,
            "note": "",
        }
        if rec.get("run_error") or rec.get("eval_error") or not rows:
            entry["note"] = rec.get("run_error") or rec.get("eval_error") or "no rows"
            entry["rows_used"] = 0
            out.append(entry)
            continue
        notes = []
        used = rows
        if cfg.role == REUSE_DRIFT:
            notes.append(f"reference kv_path: {_kv_paths(ref_rows)}; this run: {_kv_paths(rows)}")
            if rec.get("ar_pinned"):
                notes.insert(0, "AR outputs taken from the reference run")
            else:
                known = [r for r in rows if r.get("tokens_identical") is not None]
                if known:
                    used = [r for r in rows if r.get("tokens_identical")]
                    notes.insert(0, f"AR re-run: {len(used)}/{len(rows)} rows with identical tokens used")
                else:
                    notes.insert(0, "AR re-run, token identity not recorded (no generated_ids)")
        stats = summarize(used) if used else summarize([])
        ok = [r for r in used if r.get("eval_status") == OK]
        entry.update(rows=len(rows), rows_used=len(used), **{k: stats[k] for k in _BUDGET_STATS})
        resized = sum(1 for r in used if r.get("eval_status") == SIZE_MISMATCH)
        failed = len(used) - len(ok) - resized
        if resized:
            notes.append(f"{resized} row(s) changed image size (another ratio): no pixel metrics")
        if failed:
            notes.append(f"{failed} row(s) could not be compared")
        if cfg.role == AR_DIVERSITY and ok and stats["token_rows"] == 0:
            notes.append("no generated_ids recorded: token divergence unknown")
        entry["note"] = "; ".join(notes)
        out.append(entry)
    return out
