"""Step programs on tensor-parallel ranks (CPU, gloo), through real jobs on the embedded stores.

- a whole job at --tensor-parallel-size 2 gives the one-process images (>= 60 dB) with KV reused;
- the AR at TP2 feeds a DiT at TP1 (head parts of one payload), and the AR at TP1 a DiT at TP2;
- a killed rank fails the DiT step with a clear error and commits nothing; a re-run resumes and
  every row ends exactly once.
"""

from __future__ import annotations

import pytest

from components.ar.run import run as ar_run
from components.data.runs import RunLayout
from components.dit.run import run as dit_run
from components.models import model_validators
from components.runtime.dispatch import run_step
from components.runtime.ranks import RankFailed

from . import oom_targets, parallel_targets
from .step_config import step_config
from .test_engine_helpers import psnr

GEN = dict(steps=2, guidance=5.0, flow_shift=3.0)
AR = dict(bot_task="think_recaption", system_prompt="en_unified", max_new_tokens=6, temperature=0.0, top_k=0,
          top_p=1.0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from components.data.sample import write_sample_edit_dataset

    return str(write_sample_edit_dataset(tmp_path_factory.mktemp("data") / "edit.parquet", n=2))


def _shard(dataset: str, output: str, run_id: str) -> None:
    from components.shard.run import run as run_shard

    count, supported, budget = model_validators("tiny")
    run_shard(dataset, output, run_id, 1, "edit", count_tokens=count, is_supported_size=supported,
              max_prompt_tokens=budget)


def _job(dataset: str, output: str, run_id: str, ar_tp: int, dit_tp: int, **dit_extra) -> None:
    _shard(dataset, output, run_id)
    run_step(ar_run, {"config": step_config(output, run_id, **AR, tensor_parallel_size=ar_tp), "shard": 0})
    run_step(dit_run, {"config": step_config(output, run_id, **GEN, tensor_parallel_size=dit_tp, **dit_extra),
                       "shard": 0})


def _rows(output: str, run_id: str) -> dict[str, dict]:
    return {r["id"]: r for r in RunLayout.open(output, run_id).read_rows(0).to_pylist()}


def _image(output: str, run_id: str, row: dict):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(RunLayout.open(output, run_id).store.get_bytes(row["image_key"]))).convert("RGB")


@pytest.fixture(scope="module")
def baseline(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs"))
    _job(dataset, out, "tp1", 1, 1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ar_tp,dit_tp", [(2, 2), (2, 1), (1, 2)])
def test_parallel_steps_match_one_process(dataset, baseline, tmp_path, ar_tp, dit_tp):
    out = str(tmp_path)
    _job(dataset, out, "tp", ar_tp, dit_tp)
    ref, got = _rows(baseline, "tp1"), _rows(out, "tp")
    assert set(got) == set(ref) and all(r["status"] == "ok" for r in got.values())
    for row_id, row in got.items():
        assert row["kv_path"] == "reuse", row["kv_reason"]
        assert row["cot_text"] == ref[row_id]["cot_text"]
        assert psnr(_image(out, "tp", row), _image(baseline, "tp1", ref[row_id])) >= 60
    import os

    kv_dir = os.path.join(out, "tp", "_kv")  # the embedded KV store: every payload consumed
    assert not os.path.exists(kv_dir) or not any(files for _, _, files in os.walk(kv_dir))


@pytest.mark.slow
def test_a_killed_rank_fails_the_step_and_a_rerun_resumes(dataset, baseline, tmp_path):
    out = str(tmp_path)
    _shard(dataset, out, "kill")
    ar, dit = ({"config": step_config(out, "kill", **gen, tensor_parallel_size=2), "shard": 0} for gen in (AR, GEN))
    run_step(ar_run, ar)
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed: exited with code -9 \(killed or crashed\)"):
        run_step(parallel_targets.dit_killing_rank1, dit)
    layout = RunLayout.open(out, "kill")
    assert not layout.is_committed(0)
    run_step(dit_run, dit)
    assert layout.is_committed(0)
    rows = _rows(out, "kill")
    assert sorted(rows) == sorted(_rows(baseline, "tp1")) and all(r["status"] == "ok" for r in rows.values())


@pytest.mark.slow
def test_a_tensor_parallel_job_shares_its_ranks_across_shards(dataset, tmp_path):
    """`ardit edit --tp 2` over 2 shards: one rank pool for the whole job (each rank loads the engine
    once), every row ok, the same images as the single-process job."""
    from components.jobconfig import JobConfig
    from pipeline.local import run_job

    job = JobConfig(dataset=dataset, output=str(tmp_path), run_id="tp1", kind="edit", num_shards=2, model="tiny",
                    device="cpu", seed=0, **AR, **GEN)
    ref = run_job(job, progress=False)
    got = run_job(job.replace(run_id="tp2", tensor_parallel_size=2), progress=False)
    assert got["rows_ok"] == ref["rows_ok"] == 2
    rows1 = {**_rows_of(str(tmp_path), "tp1")}
    for row_id, row in _rows_of(str(tmp_path), "tp2").items():
        assert row["kv_path"] == "reuse" and row["cot_text"] == rows1[row_id]["cot_text"]
        assert psnr(_image(str(tmp_path), "tp2", row), _image(str(tmp_path), "tp1", rows1[row_id])) >= 60


def _rows_of(output: str, run_id: str) -> dict[str, dict]:
    layout = RunLayout.open(output, run_id)
    return {r["id"]: r for k in range(2) for r in layout.read_rows(k).to_pylist()}


# ------------------------------------------------------------------ out of memory on one rank
@pytest.mark.parametrize("ranks", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_an_oom_on_one_rank_halves_the_batch_on_every_rank_and_the_step_completes(dataset, tmp_path, ranks):
    """Rank 1 (only) runs out of memory allocating the 2-row K/V pool: the ranks agree, all halve to
    one row and go on; no row fails, the DiT reuses every row's K/V, and the run keeps the budget
    that worked for its resume."""
    out = str(tmp_path)
    _shard(dataset, out, "oom")
    run_step(oom_targets.ar_out_of_memory_allocating,
             {"config": step_config(out, "oom", **AR, **ranks), "shard": 0, "bad_rank": 1})
    layout = RunLayout.open(out, "oom")
    scheduler = layout.read_json(layout.step_timing_key(0, "ar"))["scheduler"]
    assert scheduler["oom_retries"] == 1 and scheduler["pool_rows"] == 1, scheduler
    assert "OutOfMemoryError allocating a K/V pool of 2 row(s)" in scheduler["events"][0]
    budget = layout.read_json(layout.settings_key("ar_budget"))
    assert budget["max_rows"] == 1 and budget["tensor_parallel_size"] == ranks.get("tensor_parallel_size", 1)
    run_step(dit_run, {"config": step_config(out, "oom", **GEN), "shard": 0})
    rows = _rows(out, "oom")
    assert len(rows) == 2 and all(r["status"] == "ok" and r["kv_path"] == "reuse" for r in rows.values()), rows
