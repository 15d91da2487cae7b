"""Report step: write `{sweep_dir}/report.html` from a finished sweep directory."""

from __future__ import annotations

from pathlib import Path

from components.report.render import write_report


def run(sweep_dir: str | Path, out: str | Path | None = None, max_rows: int = 24) -> Path:
    return write_report(sweep_dir, out, max_rows=max_rows)
