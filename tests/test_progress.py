"""Progress lines in logs (components/progress.py): the in-step ETA counts from the first finished
rows, whose wait holds the step's compiles and the first batch's prefill."""

from __future__ import annotations

import io

from components import progress as progress_module
from components.progress import LogProgress


def test_the_eta_counts_from_the_first_finished_rows(monkeypatch):
    clock = [progress_module.time.monotonic()]  # a task's start is read from the real clock
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
