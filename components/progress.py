"""Progress of the shard steps: rich bars on a terminal, plain log lines anywhere else.

The AR and DiT steps call `task = progress.add_task(label, total)`, `progress.advance(task, n)`
and `progress.finish(task)` (or `progress.skip(label, why)` when resuming leaves them nothing); a local
job says with `progress.redo(message, steps)` that a data-parallel replica failed and its shard's finished
steps run again. On a TTY that draws rich bars; in CI logs and pods (stderr not a TTY) it writes one
line when a shard step ends, with rows done, rows/s and the ETA of the job, and a line every
`interval_s` while a long step runs.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class _Task:
    label: str
    total: int
    done: int = 0
    # looked up at each call (not bound when the class is made), so a test's clock reaches it too
    t0: float = field(default_factory=lambda: time.monotonic())
    last_log: float = field(default_factory=lambda: time.monotonic())
    first_done_at: float | None = None  # when the first rows finished (after compiles, the first batch)
    first_done: int = 0


class LogProgress:
    """One line per finished shard step (and every `interval_s` within a long one).

    `job_steps`: how many shard steps the whole job has (for the job's ETA); 0 = unknown.
    `replicas`: how many steps run at once (a job's data-parallel model copies)."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 30.0, job_steps: int = 0,
                 replicas: int = 1):
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.job_steps = job_steps
        self.replicas = max(1, replicas)
        self.steps_done = 0
        self.t0 = time.monotonic()
        self.latest_s: dict[str, float] = {}  # the last finished step of each kind (AR, DiT): its seconds

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _line(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=self.stream, flush=True)

    def add_task(self, label: str, total: int) -> _Task:
        return _Task(label, total)

    def advance(self, task: _Task, n: int = 1) -> None:
        task.done += n
        now = time.monotonic()
        first = task.first_done_at is None
        if first:
            task.first_done_at, task.first_done = now, task.done
        if now - task.last_log >= self.interval_s and task.done < task.total:
            task.last_log = now
            # The rate counts from the first finished rows, not the step's start: a step's first rows
            # carry its compiles and, for the AR, the whole first batch's prefill: counted from the
            # start, the ETA was several times too long.
            if first:
                self._line(f"{task.label}: {task.done}/{task.total} rows, the first after {_duration(now - task.t0)}")
                return
            rate = (task.done - task.first_done) / max(now - task.first_done_at, 1e-9)
            eta = (task.total - task.done) / rate if rate > 0 else float("inf")
            self._line(f"{task.label}: {task.done}/{task.total} rows, {rate:.2f} rows/s, ETA {_duration(eta)}")

    def finish(self, task: _Task) -> None:
        elapsed = time.monotonic() - task.t0
        rate = task.done / elapsed if elapsed > 0 else 0.0
        self.latest_s[task.label.split()[0]] = elapsed
        self._line(f"{task.label}: {task.done}/{task.total} rows in {_duration(elapsed)} ({rate:.2f} rows/s)"
                   + self._job())

    def skip(self, label: str, why: str) -> None:
        """A shard step with nothing to do (resume)."""
        self._line(f"{label}: skipped ({why})" + self._job())

    def redo(self, message: str, steps: int) -> None:
        """A data-parallel replica failed: say so, and count the `steps` shard steps it finished for the
        shard it gave back once more in the job's total (they run again on another replica)."""
        self.job_steps += steps if self.job_steps else 0
        self._line(message)

    def _job(self) -> str:
        self.steps_done += 1
        if not self.job_steps:
            return ""
        left = max(0, self.job_steps - self.steps_done)
        if self.latest_s:
            # each step left takes what the last step of each kind took, the AR and DiT in turn: the
            # job's first steps compile (a first shard can take several times the next one), so a
            # mean over every step so far stays high long after the steps have warmed up
            per_step = sum(self.latest_s.values()) / len(self.latest_s)
            eta = left * per_step / self.replicas
        else:  # only skipped steps so far (a resume)
            eta = (time.monotonic() - self.t0) / self.steps_done * left
        return f"; job: {self.steps_done}/{self.job_steps} shard steps, ETA {_duration(eta)}"


class RichProgress:
    """rich bars (label, bar, done/total, elapsed, remaining)."""

    def __init__(self, job_steps: int = 0):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False)

    def __enter__(self) -> RichProgress:
        self.bars.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.__exit__(*exc)

    def add_task(self, label: str, total: int) -> Any:
        return self.bars.add_task(label, total=total)

    def advance(self, task: Any, n: int = 1) -> None:
        self.bars.advance(task, n)

    def finish(self, task: Any) -> None:
        self.bars.refresh()

    def skip(self, label: str, why: str) -> None:
        self.bars.console.print(f"{label}: skipped ({why})")

    def redo(self, message: str, steps: int) -> None:
        self.bars.console.print(message)


class NoProgress:
    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def add_task(self, label: str, total: int) -> None:
        return None

    def advance(self, task: Any, n: int = 1) -> None:
        pass

    def finish(self, task: Any) -> None:
        pass

    def skip(self, label: str, why: str) -> None:
        pass

    def redo(self, message: str, steps: int) -> None:
        pass


class SharedProgress:
    """A progress object that several threads report to (a job's data-parallel replicas): one
    call at a time, so log lines and bars never interleave."""

    def __init__(self, inner: Any):
        self.inner, self.lock = inner, threading.Lock()

    def add_task(self, label: str, total: int) -> Any:
        with self.lock:
            return self.inner.add_task(label, total)

    def advance(self, task: Any, n: int = 1) -> None:
        with self.lock:
            self.inner.advance(task, n)

    def finish(self, task: Any) -> None:
        with self.lock:
            self.inner.finish(task)

    def skip(self, label: str, why: str) -> None:
        with self.lock:
            self.inner.skip(label, why)

    def redo(self, message: str, steps: int) -> None:
        with self.lock:
            self.inner.redo(message, steps)


def make_progress(mode: bool | str = "auto", job_steps: int = 0,
                  replicas: int = 1) -> LogProgress | RichProgress | NoProgress:
    """"auto": rich bars when stderr is a terminal, log lines otherwise; True: the same;
    False: nothing; "log" / "rich": that one."""
    if mode is False or mode == "none":
        return NoProgress()
    if mode == "log" or (mode in (True, "auto") and not sys.stderr.isatty()):
        return LogProgress(job_steps=job_steps, replicas=replicas)
    return RichProgress(job_steps=job_steps)
