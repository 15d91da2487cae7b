"""Data-parallel replicas of a local job (`ardit edit --dp N`), on the CPU: each replica is a
process of its own (a RankPool of one rank) fed shards through a work queue by a parent thread.

- 4 shards at --dp 2 give the --dp 1 images (>= 60 dB fp32) and the same CoT; both replicas took
  shards (summary: `replica` per shard); each replica loaded its engine once for its AR and DiT
  steps, and the one-process job loaded it once too;
- a replica killed (SIGKILL) in its first DiT step gives its shard back: another replica finishes
  it, every row ends exactly once;
- when every replica dies the job fails (exit 1, one line saying to re-run), nothing is wrongly
  committed, and the same command resumes and completes.
"""

from __future__ import annotations

import io
import os

import pytest

from components.data.runs import RunLayout
from components.jobconfig import JobConfig

from . import parallel_targets
from .test_engine_helpers import psnr

pytestmark = pytest.mark.slow

JOB = dict(kind="edit", num_shards=4, model="tiny", device="cpu", seed=0, steps=2, guidance=5.0, max_new_tokens=4,
           temperature=0.0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from components.data.sample import write_sample_edit_dataset

    return str(write_sample_edit_dataset(tmp_path_factory.mktemp("data") / "edit.parquet", n=4))


def _rows(output: str, run_id: str) -> dict[str, dict]:
    layout = RunLayout.open(output, run_id)
    return {r["id"]: r for k in range(JOB["num_shards"]) for r in layout.read_rows(k).to_pylist()}


def _image(output: str, run_id: str, row: dict):
    from PIL import Image

    data = RunLayout.open(output, run_id).store.get_bytes(row["image_key"])
    return Image.open(io.BytesIO(data)).convert("RGB")


def _targets(monkeypatch, ar: str | None = None, dit: str | None = None) -> None:
    from pipeline import local

    targets = dict(local.STEP_TARGETS)
    targets.update({k: getattr(parallel_targets, v) for k, v in (("ar", ar), ("dit", dit)) if v})
    monkeypatch.setattr(local, "STEP_TARGETS", targets)


def test_two_replicas_match_one_and_each_loads_its_engine_once(dataset, tmp_path, monkeypatch):
    from components import models
    from components.engine import Engine
    from pipeline.local import run_job

    out = str(tmp_path / "runs")
    loads = []
    plain = Engine.load.__func__
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **kw: loads.append(1) or plain(cls, *a, **kw)))
    models._cached_engine.cache_clear()
    one = run_job(JobConfig(dataset=dataset, output=out, run_id="dp1", data_parallel_size=1, **JOB), progress=False)
    assert len(loads) == 1  # the one-process job: AR and DiT of all 4 shards share one engine
    assert {s.get("replica") for s in one["shards"]} == {0}

    log = tmp_path / "loads.log"
    monkeypatch.setenv("ARDIT_TEST_LOAD_LOG", str(log))
    _targets(monkeypatch, ar="ar_counting_loads", dit="dit_counting_loads")
    two = run_job(JobConfig(dataset=dataset, output=out, run_id="dp2", data_parallel_size=2, **JOB), progress=False)
    assert two["rows_ok"] == one["rows_ok"] == 4 and two["complete"]
    assert two["data_parallel"] == {"replicas": 2, "failed": []}
    assert one["close_s"] is None and two["close_s"] >= 0  # the replicas' ranks stopping, after the last commit
    assert sorted({s["replica"] for s in two["shards"]}) == [0, 1]  # both replicas did work
    # each replica's time split adds up to the wall time; the job's sums the replicas' (issue 35:
    # it summed their overlapping steps, exceeded wall_s and left `other` null)
    by_replica = two["time_split_by_replica_s"]
    assert sorted(by_replica) == ["0", "1"] and "time_split_by_replica_s" not in one
    for split in by_replica.values():
        assert split["other"] is not None and sum(split.values()) == pytest.approx(two["wall_s"], rel=0.01)
    assert sum(two["time_split_s"].values()) == pytest.approx(2 * two["wall_s"], rel=0.01)
    assert one["time_split_s"]["other"] is not None
    pids = log.read_text().split()
    assert len(pids) == 2 and len(set(pids)) == 2 and str(os.getpid()) not in pids  # one load per replica

    ref = _rows(out, "dp1")
    for row_id, row in _rows(out, "dp2").items():
        assert row["status"] == "ok" and row["cot_text"] == ref[row_id]["cot_text"]
        assert psnr(_image(out, "dp2", row), _image(out, "dp1", ref[row_id])) >= 60


def test_a_killed_replica_gives_its_shard_to_another(dataset, tmp_path, monkeypatch, capfd):
    from pipeline.cli import _print_summary
    from pipeline.local import run_job

    out = str(tmp_path / "runs")
    monkeypatch.setenv("ARDIT_TEST_KILL_FLAG", str(tmp_path / "killed"))
    _targets(monkeypatch, dit="dit_killed_once")
    summary = run_job(JobConfig(dataset=dataset, output=out, run_id="kill", data_parallel_size=2, **JOB),
                      progress="log")
    assert (tmp_path / "killed").exists()
    (failure,) = summary["data_parallel"]["failed"]
    assert "killed or crashed" in failure["error"]
    # issue 35: said on the terminal when it happens, and the job's step count stays right
    log = capfd.readouterr().err.splitlines()
    said = [line for line in log if f"data-parallel replica {failure['replica']}: RankFailed" in line]
    assert len(said) == 1 and f"shard {failure['shard']} goes back to the queue" in said[0], log
    steps = [line.split("job: ")[1].split(" shard steps")[0] for line in log if "job: " in line]
    done, total = map(int, steps[-1].split("/"))
    assert done == total >= 8, log  # 4 shards x (AR, DiT), plus what the lost replica's shard ran again
    _print_summary(summary, out, "kill")  # and at the end, though the job ends well
    printed = capfd.readouterr()
    assert f"a data-parallel replica was lost on shard {failure['shard']}" in printed.err
    assert "replica 0" in printed.out and "replica 1" in printed.out and "{" not in printed.out
    assert summary["complete"] and summary["rows_ok"] == 4 and summary["rows_failed"] == 0
    by_shard = {s["shard"]: s["replica"] for s in summary["shards"]}
    assert by_shard[failure["shard"]] != failure["replica"]  # redone by the replica left
    rows = _rows(out, "kill")
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows.values())


def test_when_every_replica_dies_the_job_fails_and_a_rerun_resumes(dataset, tmp_path, monkeypatch, capfd):
    from pipeline import cli

    out = str(tmp_path / "runs")
    args = ["edit", dataset, "-o", out, "--run-id", "dead", "--num-shards", "4", "--model", "tiny", "--device", "cpu",
            "--dp", "2", "--steps", "2", "--guidance", "5", "--max-new-tokens", "4", "--greedy"]
    with monkeypatch.context() as m:
        _targets(m, dit="dit_always_killed")
        assert cli.main(args) == 1
    err = [line for line in capfd.readouterr().err.splitlines() if "error" in line]  # besides progress lines
    assert len(err) == 1 and err[0].startswith("ardit: error: ReplicasFailed: every data-parallel replica failed")
    assert "shard(s) [0, 1, 2, 3] were not committed: run the same command again to resume" in err[0]
    layout = RunLayout.open(out, "dead")
    assert not any(layout.is_committed(k) for k in range(4))
    assert cli.main(args) == 0  # the same command resumes
    assert all(layout.is_committed(k) for k in range(4))
    rows = _rows(out, "dead")
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows.values())


def test_more_replicas_than_shards_is_said(dataset, tmp_path, capfd):
    """Issue 35: `--dp 3` on the CPU silently ran 2 copies (as many as there were shards)."""
    from pipeline import cli

    out = str(tmp_path / "runs")
    assert cli.main(["edit", dataset, "-o", out, "--num-shards", "1", "--dp", "2", "--device", "cpu", "--steps", "1",
                     "--max-new-tokens", "2", "--greedy"]) == 0
    err = capfd.readouterr().err
    assert "--data-parallel-size 2: 1 shard(s) to run, so 1 model copy (--num-shards 2 or more gives each one " \
        "work;" in err, err
