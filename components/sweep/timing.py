"""Time per image that means something: every config's samples, a measured noise, honest ratios.

One run per config is one timing sample, taken whenever the sweep got to it; on a shared machine
the speed drifts meanwhile (seen: 18.7 s -> 52.9 s per image across one sweep), so ratios between
single samples can be pure noise. The sweep therefore measures the noise:
- the determinism config re-runs the reference last, so the reference has a sample at the start
  and one at the end of the sweep;
- `timing: {repeats: N}` adds N rounds that run every config again, round-robin (interleaved, so a
  drift touches every config alike), and keeps only their times.

noise = the largest relative spread (max - min) / min of any config's samples. A config's time is
the median of its samples; its speed ratio against the reference is a finding only when
- each arm (the config and the reference) has at least MIN_SAMPLES samples,
- the ratio's interval from the samples (reference min / config max .. reference max / config min)
  excludes 1, i.e. the two arms' ranges do not overlap, and
- the two medians differ by more than the noise.
Otherwise it reads "within noise (n=...)". Without any repeated sample there is no noise estimate and
every ratio is within noise.
"""

from __future__ import annotations

import statistics
from typing import Any

NO_ESTIMATE = "no timing noise estimate: enable precision_budget.determinism or timing.repeats"
# timing samples each arm needs before its speed ratio is a finding (fewer cannot show a noise band)
MIN_SAMPLES = 3


def _spread(samples: list[float]) -> float | None:
    return (max(samples) - min(samples)) / min(samples) if len(samples) >= 2 and min(samples) > 0 else None


def timing_summary(samples: dict[str, list[float]], reference: str) -> dict[str, Any]:
    """samples: config -> per-run mean seconds per image (a config missing or empty: no time).

    Returns {"noise", "noise_from", "configs": {name: {samples, median, spread, speedup,
    speedup_reliable, speedup_note}}}."""
    configs: dict[str, dict[str, Any]] = {}
    for name, values in samples.items():
        values = [float(v) for v in values if v is not None and v > 0]
        configs[name] = {"samples": values, "median": statistics.median(values) if values else None,
                         "spread": _spread(values)}  # fmt: skip
    spreads = {n: c["spread"] for n, c in configs.items() if c["spread"] is not None}
    noise = max(spreads.values()) if spreads else None
    noise_from = ""
    if noise is not None:
        worst = max(spreads, key=lambda n: spreads[n])
        shown = ", ".join(f"{v:.3g} s" for v in configs[worst]["samples"])
        noise_from = f"{worst} timed {len(configs[worst]['samples'])}× per image: {shown}"
    ref = configs.get(reference, {}).get("median")
    ref_samples = configs.get(reference, {}).get("samples") or []
    for name, c in configs.items():
        c["speedup"] = ref / c["median"] if ref and c["median"] else None
        c["speedup_reliable"], c["speedup_note"] = speed_finding(c["samples"], ref_samples, noise)
        if c["speedup"] is None:
            c["speedup_note"] = "no time"
    return {"noise": noise, "noise_from": noise_from, "configs": configs}


def speed_finding(samples: list[float], ref_samples: list[float], noise: float | None) -> tuple[bool, str]:
    """(whether the speed ratio of `samples` against `ref_samples` is a finding, why in words): only
    with MIN_SAMPLES per arm, ranges apart (the ratio's interval excludes 1) and medians further
    apart than the noise."""
    n = f"n={len(samples)}, ref n={len(ref_samples)}"
    if not samples or not ref_samples:
        return False, "no time"
    if min(len(samples), len(ref_samples)) < MIN_SAMPLES:
        return False, f"within noise ({n}): fewer than {MIN_SAMPLES} timing samples per arm"
    if noise is None:
        return False, f"within noise ({n}): {NO_ESTIMATE}"
    lo, hi = min(ref_samples) / max(samples), max(ref_samples) / min(samples)
    if lo <= 1 <= hi:
        return False, f"within noise ({n}): the ratio from the samples spans {lo:.2f}–{hi:.2f}, which includes 1"
    med, ref = statistics.median(samples), statistics.median(ref_samples)
    diff = abs(med - ref) / min(med, ref)
    if diff <= noise:
        return False, f"within noise ({n}): differs by {pct(diff)}, noise ±{pct(noise)}"
    return True, f"differs by {pct(diff)}, more than the timing noise ±{pct(noise)} ({n}, ratio {lo:.2f}–{hi:.2f})"


def within_noise_words(note: str) -> str:
    """The short cell text of a ratio that is no finding: 'within noise (n=2, ref n=1)'."""
    return note.split(":", 1)[0] if note.startswith("within noise") else "within noise"


def pct(x: float) -> str:
    """A relative spread as a percentage; one decimal below 10 % so that 0.1 % does not read as 0 %."""
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def noise_line(summary: dict[str, Any]) -> str:
    """One line for the CLI and the report."""
    if summary.get("noise") is None:
        return f"timing: {NO_ESTIMATE}; speed ratios are unreliable"
    return (f"timing noise ±{pct(summary['noise'])} ({summary['noise_from']}): a speed ratio is a finding only "
            f"with >= {MIN_SAMPLES} samples per arm and outside it, otherwise it reads 'within noise'")  # fmt: skip
