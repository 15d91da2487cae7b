"""Time per image that means something: every config's samples, a measured noise, honest ratios.

One run per config is one timing sample, taken whenever the sweep got to it; on a shared machine
the speed drifts meanwhile (seen: 18.7 s -> 52.9 s per image across one sweep), so ratios between
single samples can be pure noise. The sweep therefore measures the noise:
- the determinism config re-runs the reference last, so the reference has a sample at the start
  and one at the end of the sweep;
- `timing: {repeats: N}` adds N rounds that run every config again, round-robin (interleaved, so a
  drift touches every config alike), and keeps only their times.

noise = the largest relative spread (max - min) / min of any config's samples. A config's time is
the median of its samples; its speed ratio against the reference counts only when the two medians
differ by more than the noise. Without any repeated sample there is no noise estimate and every
ratio is marked unreliable.
"""

from __future__ import annotations

import statistics
from typing import Any

NO_ESTIMATE = "no timing noise estimate: enable precision_budget.determinism or timing.repeats"


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
    for name, c in configs.items():
        c["speedup"] = ref / c["median"] if ref and c["median"] else None
        if c["speedup"] is None:
            c["speedup_reliable"], c["speedup_note"] = False, "no time"
        elif noise is None:
            c["speedup_reliable"], c["speedup_note"] = False, NO_ESTIMATE
        else:
            diff = abs(c["median"] - ref) / min(c["median"], ref)
            c["speedup_reliable"] = diff > noise
            c["speedup_note"] = (f"differs by {pct(diff)}, more than the timing noise ±{pct(noise)}" if c["speedup_reliable"]
                                 else f"within timing noise: differs by {pct(diff)}, noise ±{pct(noise)}")  # fmt: skip
    return {"noise": noise, "noise_from": noise_from, "configs": configs}


def pct(x: float) -> str:
    """A relative spread as a percentage; one decimal below 10 % so that 0.1 % does not read as 0 %."""
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def noise_line(summary: dict[str, Any]) -> str:
    """One line for the CLI and the report."""
    if summary.get("noise") is None:
        return f"timing: {NO_ESTIMATE}; speed ratios are unreliable"
    return (f"timing noise ±{pct(summary['noise'])} ({summary['noise_from']}): speed ratios within it are "
            "marked ~ and mean nothing")  # fmt: skip
