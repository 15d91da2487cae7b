"""Step programs on pipeline-parallel ranks (CPU, gloo), through real jobs on the embedded stores.

- a job at --pipeline-parallel-size 2 gives the one-process images (>= 60 dB) with KV reused, and
  so do AR at PP2 -> DiT at TP1 and AR at TP1 -> DiT at PP2 (the KV payload is layout independent);
- a killed stage fails the DiT step cleanly (RankFailed naming the rank, nothing committed) and a
  re-run resumes;
- the step program takes --pp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from components.ar.budget import kept_budget
from components.ar.run import run as ar_run
from components.data.runs import RunLayout
from components.dit.run import run as dit_run
from components.errors import ConfigError
from components.runtime.dispatch import run_step
from components.runtime.ranks import RankFailed

from . import oom_targets, parallel_targets
from .step_config import step_config
from .test_engine_helpers import psnr
from .test_steps_parallel import AR, GEN, _image, _rows, _shard


def _job(dataset: str, output: str, run_id: str, ar: dict, dit: dict) -> None:
    _shard(dataset, output, run_id)
    run_step(ar_run, {"config": step_config(output, run_id, **AR, **ar), "shard": 0})
    run_step(dit_run, {"config": step_config(output, run_id, **GEN, **dit), "shard": 0})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from components.data.sample import write_sample_edit_dataset

    return str(write_sample_edit_dataset(tmp_path_factory.mktemp("data") / "edit.parquet", n=2))


@pytest.fixture(scope="module")
def baseline(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs"))
    _job(dataset, out, "tp1", {}, {})
    return out


PP2 = {"pipeline_parallel_size": 2}


@pytest.mark.slow
@pytest.mark.parametrize("ar,dit", [(PP2, PP2), (PP2, {}), ({}, PP2)], ids=["pp2-pp2", "pp2-tp1", "tp1-pp2"])
def test_pipeline_steps_match_one_process(dataset, baseline, tmp_path, ar, dit):
    out = str(tmp_path)
    _job(dataset, out, "pp", ar, dit)
    ref, got = _rows(baseline, "tp1"), _rows(out, "pp")
    assert set(got) == set(ref) and all(r["status"] == "ok" for r in got.values())
    for row_id, row in got.items():
        assert row["kv_path"] == "reuse", row["kv_reason"]
        assert row["cot_text"] == ref[row_id]["cot_text"]
        assert psnr(_image(out, "pp", row), _image(baseline, "tp1", ref[row_id])) >= 60
    kv_dir = os.path.join(out, "pp", "_kv")  # the embedded KV store: every part consumed
    assert not os.path.exists(kv_dir) or not any(files for _, _, files in os.walk(kv_dir))


@pytest.mark.timeout(300)  # without the fix the stages hang (gloo's receive outlasted ARDIT_RANK_TIMEOUT_S)
def test_a_stage_that_fails_mid_step_restarts_the_ranks_with_half_the_batch(dataset, baseline, tmp_path,
                                                                              monkeypatch, capfd):
    """An OOM on one stage only, inside a forward: that stage alone cannot start the batch again (the
    other stage waits in the forward's hand-off; it hung so before). The stage leaves the halved
    budget in the run and the step fails, naming the stage; the step starts its ranks again from that
    budget (it failed every retry with the same batch before), and completes."""
    out = str(tmp_path)
    _shard(dataset, out, "oom")
    monkeypatch.setenv("ARDIT_RANK_TIMEOUT_S", "90")  # a hang would end as a collective timeout, not hold CI
    capfd.readouterr()
    run_step(oom_targets.ar_out_of_memory_in_a_forward_once,
             {"config": step_config(out, "oom", **AR, **PP2), "shard": 0, "marker": str(tmp_path / "oom-fired")},
             restart_from=kept_budget)
    err = capfd.readouterr().err
    assert "rank 0 of 2 failed: torch.OutOfMemoryError: CUDA out of memory (injected on stage 0); starting the " \
           "ranks again with at most 1 AR row(s) in flight (restart 1 of at most 6)" in err, err
    layout = RunLayout.open(out, "oom")
    budget = layout.read_json(layout.settings_key("ar_budget"))
    assert budget["max_rows"] == 1 and budget["pipeline_parallel_size"] == 2, budget  # 2 rows were in flight
    record = layout.read_json(layout.step_timing_key(0, "ar"))
    assert record["budget_from_run"]["max_rows"] == 1 and record["scheduler"]["pool_rows"] == 1, record
    run_step(dit_run, {"config": step_config(out, "oom", **GEN, **PP2), "shard": 0})
    rows = _rows(out, "oom")
    assert sorted(rows) == sorted(_rows(baseline, "tp1")) and all(r["status"] == "ok" for r in rows.values())


def test_an_oom_at_one_row_in_flight_fails_the_step_without_a_restart(dataset, tmp_path, monkeypatch, capfd):
    """One row in flight and no K/V budget (the CPU): nothing left to halve, so no budget is kept and
    the step fails at once (no restart that would run into the same OOM)."""
    out = str(tmp_path)
    _shard(dataset, out, "oom1")
    monkeypatch.setenv("ARDIT_RANK_TIMEOUT_S", "90")
    capfd.readouterr()
    with pytest.raises(RankFailed, match=r"rank 0 of 2 failed: torch.OutOfMemoryError: CUDA out of memory \(injected"):
        run_step(parallel_targets.ar_out_of_memory_on_stage0,
                 {"config": step_config(out, "oom1", **AR, **PP2, batch_size=1), "shard": 0}, restart_from=kept_budget)
    assert "starting the ranks again" not in capfd.readouterr().err
    layout = RunLayout.open(out, "oom1")
    assert layout.read_json(layout.settings_key("ar_budget")) is None


@pytest.mark.slow
def test_a_killed_stage_fails_the_step_and_a_rerun_resumes(dataset, baseline, tmp_path):
    out = str(tmp_path)
    _shard(dataset, out, "kill")
    ar, dit = ({"config": step_config(out, "kill", **gen, **PP2), "shard": 0} for gen in (AR, GEN))
    run_step(ar_run, ar)
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed: exited with code -9 \(killed or crashed\)"):
        run_step(parallel_targets.dit_killing_stage1, dit)
    layout = RunLayout.open(out, "kill")
    assert not layout.is_committed(0)
    run_step(dit_run, dit)
    assert layout.is_committed(0)
    rows = _rows(out, "kill")
    assert sorted(rows) == sorted(_rows(baseline, "tp1")) and all(r["status"] == "ok" for r in rows.values())


def test_pipeline_options_are_checked_before_any_work(tmp_path):
    config = step_config(tmp_path, "x")
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 3: the model has 2 decoder layers"):
        run_step(dit_run, {"config": config.replace(pipeline_parallel_size=3), "shard": 0})
    with pytest.raises(ConfigError, match="--step-cache 0.1: does not combine with --pipeline-parallel-size"):
        dit_run(config.replace(step_cache=0.1, pipeline_parallel_size=2), 0)


@pytest.mark.slow
def test_the_dit_step_program_runs_at_pp2(dataset, tmp_path):
    out = str(tmp_path)
    _shard(dataset, out, "cli")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    common = ["--output", out, "--run-id", "cli", "--shard", "0", "--model", "tiny", "--device", "cpu", "--pp", "2"]
    for module, extra in (("components.ar", ["--max-new-tokens", "6", "--greedy"]), ("components.dit", ["--steps", "2"])):
        done = subprocess.run([sys.executable, "-m", module, *common, *extra], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rows"] == 2 and RunLayout.open(out, "cli").is_committed(0)
    assert all(r["kv_path"] == "reuse" for r in _rows(out, "cli").values())
