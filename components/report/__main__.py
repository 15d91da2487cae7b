"""python -m components.report --sweep-dir DIR [--out FILE] [--max-rows N]"""

from __future__ import annotations

import argparse
import sys

from components.extras import MissingExtra, needs_extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.report", description=__doc__)
    p.add_argument("--sweep-dir", required=True, help="{output}/{sweep_id} written by `ardit sweep`")
    p.add_argument("--out", help="HTML file (default SWEEP_DIR/report.html)")
    p.add_argument("--max-rows", type=int, default=24, help="rows shown as image grids, worst first")
    a = p.parse_args(argv)
    try:
        with needs_extra("report", "python -m components.report"):
            from components.report.run import run
        path = run(a.sweep_dir, a.out, a.max_rows)
    except (MissingExtra, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
