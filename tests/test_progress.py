"""Progress lines in logs (components/progress.py): the in-step ETA counts from the first finished
rows, whose wait holds the step's compiles and the first batch's prefill."""

from __future__ import annotations

import io

from components import progress as progress_module
from components.progress import LogProgress


def test_the_eta_counts_from_the_first_finished_rows(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    log = LogProgress(stream=out, interval_s=30)
    task = log.add_task("AR  shard 0", 32)
    clock[0] += 51  # the first row after 51 s (compiles, the batch's prefill) ...
    log.advance(task)
    clock[0] += 5  # ... then 20 more in 5 s
    for _ in range(20):
        log.advance(task)
    clock[0] += 30
    log.advance(task)  # 22 done: 21 rows in 35 s since the first
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("AR  shard 0: 1/32 rows, the first after 51 s"), lines
    assert lines[1].endswith("AR  shard 0: 22/32 rows, 0.60 rows/s, ETA 17 s"), lines  # from the start: 37 s
    clock[0] += 10
    log.finish(task)
    assert out.getvalue().splitlines()[-1].endswith("AR  shard 0: 22/32 rows in 2 min (0.23 rows/s)")


def test_the_job_eta_takes_the_latest_step_of_each_kind(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    log = LogProgress(stream=out, job_steps=40)
    for label, seconds in (("AR  shard 0", 118), ("DiT shard 0", 62), ("AR  shard 1", 30), ("DiT shard 1", 40)):
        task = log.add_task(label, 16)
        clock[0] += seconds
        log.advance(task, 16)
        log.finish(task)
    # 36 steps left at (30 + 40) / 2 s each, not at the mean of all four (the compiling first ones in it)
    assert out.getvalue().splitlines()[-1].endswith("job: 4/40 shard steps, ETA 21 min"), out.getvalue()
    replicas = LogProgress(stream=io.StringIO(), job_steps=40, replicas=4)
    replicas.latest_s = {"AR": 30.0, "DiT": 40.0}
    replicas.steps_done = 3
    assert replicas._job().endswith("ETA 5 min")  # 36 x 35 s over 4 copies at once


def test_a_lost_replica_is_said_and_its_redone_steps_are_counted():
    """Issue 35: a replica killed in a shard's DiT step gave the shard back; the AR step it had
    finished ran again on another replica and the job read `5/4 shard steps`. The loss is a line of
    its own, and the job's total grows by the steps that run again."""
    out = io.StringIO()
    log = LogProgress(stream=out, job_steps=4, replicas=2)
    for label in ("AR  shard 0", "AR  shard 1"):
        task = log.add_task(label, 2)
        log.advance(task, 2)
        log.finish(task)
    log.redo("data-parallel replica 1: RankFailed: killed; shard 1 goes back to the queue", 1)
    for label in ("DiT shard 0", "AR  shard 1", "DiT shard 1"):
        task = log.add_task(label, 2)
        log.advance(task, 2)
        log.finish(task)
    lines = out.getvalue().splitlines()
    assert any(line.endswith("replica 1: RankFailed: killed; shard 1 goes back to the queue") for line in lines)
    assert "job: 5/5 shard steps" in lines[-1], lines


def test_a_rank_that_died_is_the_root_cause_not_its_neighbours_errors():
    """Issue 35: of 9 killed pipeline stages, one was reported as another rank's unrelated
    AttributeError (a neighbour failing on what the killed stage never sent)."""
    from components.runtime.ranks import _root_cause

    outcome = {0: ("error", "AttributeError: 'NoneType' object has no attribute 'shape'"),
               1: ("error", "exited with code -9 (killed or crashed)"),
               2: ("error", "RankLost: a tensor-parallel collective failed (RuntimeError: gloo: Connection closed)")}
    assert _root_cause(outcome) == (1, "exited with code -9 (killed or crashed)")
    del outcome[1]
    assert _root_cause(outcome)[0] == 0  # without a dead rank: the one that raised on its own
