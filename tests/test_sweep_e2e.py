"""End to end: `ardit sweep examples/sweeps/tiny.yaml` on the tiny model through
pipeline.local.run_job (AR + DiT on CPU), then the tables, the budget and the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

TINY = Path(__file__).resolve().parents[1] / "examples" / "sweeps" / "tiny.yaml"


@pytest.mark.slow
def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    from pipeline.sweep import app

    result = CliRunner().invoke(app, ["sweep", str(TINY), "--output", str(tmp_path), "--sweep-id", "tiny"])
    sweep_dir = tmp_path / "tiny"
    meta = json.loads((sweep_dir / "sweep.json").read_text())
    # The exit code is the gate's verdict, whatever it is.
    assert result.exit_code == (0 if meta["passed"] else 1), result.output
    assert not [s for s in meta["states"].values() if s["run_error"]], meta["states"]

    configs = {r["config"]: r for r in pq.read_table(sweep_dir / "sweep.parquet").to_pylist()}
    assert set(configs) == {
        "reuse-s8",
        "reuse-s4",
        "recompute-s8",
        "recompute-s4",
        "determinism",
        "reuse-drift",
        "ar-diversity",
    }
    for name, c in configs.items():
        assert c["rows"] == 4, name
        # output_size is pinned: another seed cannot pick another aspect ratio, every row is compared on pixels
        assert c["rows_compared"] == 4 and not c["rows_size_mismatch"], (name, c.get("violations"))
        assert c["time_per_image_s_mean"] and c["time_per_image_s_mean"] > 0, name
    # save_latents: the latent cosine distance is measured (0 for the bit-identical re-run).
    assert configs["determinism"]["latent_cos_dist_mean"] == 0.0
    assert configs["reuse-drift"]["latent_cos_dist_mean"] is not None

    budget = {b["role"]: b for b in pq.read_table(sweep_dir / "budget.parquet").to_pylist()}
    # On one CPU the reference re-run must be bit-identical.
    assert budget["determinism"]["bitwise_rows"] == 4 and budget["determinism"]["psnr_min"] == math.inf
    assert "recompute 4/4" in budget["reuse_drift"]["note"]
    assert budget["reuse_drift"]["rows_used"] >= 1
    # A seed change with temperature 0.7 moves the CoT.
    assert budget["ar_diversity"]["cot_similarity_mean"] < 1.0

    rows = pq.read_table(sweep_dir / "rows.parquet").to_pylist()
    kv = {r["kv_path"] for r in rows if r["config"] == "reuse-s8"}
    assert kv == {"reuse"}
    assert (sweep_dir / "report.html").stat().st_size > 10_000
