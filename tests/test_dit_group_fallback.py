"""The DiT step's fallback from a pipeline group to row by row is said and counted (issue 34: it
was silent). Tiny model, CPU, one process: the group path is the pipeline schedule's, entered here
by a group size of 2 and failing by an injected error."""

from __future__ import annotations

import pytest

from components.data.runs import RunLayout

from .step_config import step_config


@pytest.mark.slow
def test_a_failed_pipeline_group_is_said_counted_and_its_rows_still_come_out(tmp_path, monkeypatch, capfd):
    from components.ar.run import run as run_ar
    from components.data.sample import write_sample_generate_dataset
    from components.dit.run import run as run_dit
    from components.runtime import pipeline_schedule
    from components.shard.run import run as run_shard

    dataset = write_sample_generate_dataset(str(tmp_path / "gen.parquet"), n=2, seed=5)
    out = str(tmp_path / "out")
    run_shard(dataset, out, "g", 1, "generate")
    run_ar(step_config(out, "g", max_new_tokens=4), 0)

    def group_fails(dit, requests):
        raise RuntimeError("stage 1: the group's hand-off failed (injected)")

    monkeypatch.setattr(pipeline_schedule, "rows_in_flight", lambda model: 2)
    monkeypatch.setattr(pipeline_schedule, "denoise_rows", group_fails)
    capfd.readouterr()
    result = run_dit(step_config(out, "g", steps=1), 0)
    err = capfd.readouterr().err
    assert "dit: 2 rows denoised together through the pipeline stages failed (RuntimeError: stage 1: the " \
           "group's hand-off failed (injected)); denoising them one by one" in err, err
    assert result["group_fallbacks"] == 1 and result["kernel_fallbacks"] >= 1, result
    layout = RunLayout.open(out, "g")
    assert layout.read_json(layout.step_timing_key(0, "dit"))["group_fallbacks"] == 1
    rows = layout.read_rows(0).to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["kernel_fallbacks"] >= 1  # the group's first row carries it
