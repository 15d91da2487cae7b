"""python -m components.evaluate --output URI --ref-run ID --run ID [--psnr-min 30 ...]

Exits 1 when a gate is given and a row fails it (or cannot be compared)."""

from __future__ import annotations

import argparse
import sys

from components.evaluate.gates import Thresholds, fmt_db
from components.extras import MissingExtra, needs_extra, require_extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.evaluate", description=__doc__)
    p.add_argument("--output", required=True, help="output root holding both runs")
    p.add_argument("--ref-run", required=True, help="run id of the reference")
    p.add_argument("--run", required=True, help="run id to evaluate")
    p.add_argument("--psnr-min", type=float)
    p.add_argument("--ssim-min", type=float)
    p.add_argument("--mean-abs-max", type=float)
    p.add_argument("--p99-abs-max", type=float)
    a = p.parse_args(argv)
    try:
        require_extra("sweep", "python -m components.evaluate", modules=("skimage",))  # PSNR, SSIM
        with needs_extra("sweep", "python -m components.evaluate"):
            from components.evaluate.run import CONFIG_METRICS_FILE, METRICS_FILE, evaluate_run
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    th = Thresholds(a.psnr_min, a.ssim_min, a.mean_abs_max, a.p99_abs_max)
    _, summary = evaluate_run(a.output, a.ref_run, a.run, th if th.active else None)
    print(
        f"{a.run} vs {a.ref_run}: {summary['rows_compared']}/{summary['rows']} rows compared, "
        f"PSNR mean {fmt_db(summary['psnr_mean'])} dB min {fmt_db(summary['psnr_min'])} dB, "
        f"bitwise {summary['bitwise_rows']}/{summary['rows']}"
    )
    print(f"wrote {a.output}/{a.run}/{METRICS_FILE} and {CONFIG_METRICS_FILE}")
    for v in summary.get("violations", []):
        print(f"FAIL {v}", file=sys.stderr)
    failed = summary["rows_failed_eval"] > 0 or not summary.get("passed", True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
