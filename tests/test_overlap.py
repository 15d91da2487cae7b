"""AR and DiT overlapped on one engine (components/overlap/run.py, `--overlap`), the rows handed over
in memory (components/runtime/handoff.py), tiny model on the CPU:

- the handoff's gate: a first wave, at most `lead` rows ahead, a whole wave once the DiT is down
  to `low` waiting rows; it blocks an idle AR instead of letting it spin; a stopped DiT stops it;
- the overlapped job gives the sequential job's tokens and images (bitwise with
  --batch-invariant), every reused K/V handed over in memory and counted as reuse;
- a job killed mid-overlap keeps the rows it wrote, and the same command completes it;
- a failure on either side stops the other, the rows written stay, and a resume completes;
- --overlap is checked before any work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from components.runtime.handoff import Cancelled, Handoff

ROOT = Path(__file__).resolve().parents[1]


# -- the handoff ----------------------------------------------------------------------------------
def test_the_first_wave_is_small_so_the_dit_starts_early():
    h = Handoff(head_rows=2, low_rows=1, lead_rows=4)
    assert h.admit(0) and h.admit(1) and not h.admit(2)


def test_the_ar_stays_within_its_lead_and_refills_a_whole_wave_at_low_water():
    h = Handoff(head_rows=2, low_rows=1, lead_rows=4)
    for i in range(2):
        h.put({"id": f"r{i}"})
    assert h.take()["id"] == "r0"  # the DiT has started: rows may join the wave in flight
    assert h.admit(1) and h.admit(2) and not h.admit(3)  # 1 waiting + 3 in flight = the lead
    h.put({"id": "r2"})
    h.put({"id": "r3"})
    h.put({"id": "r4"})
    # nothing in flight, 4 waiting: an idle AR waits for the DiT to get down to `low`
    admitted = []
    t = threading.Thread(target=lambda: admitted.append(h.admit(0)))
    t.start()
    time.sleep(0.3)
    assert not admitted  # blocked, not spinning
    for _ in range(3):
        h.take()
    t.join(timeout=5)
    assert admitted == [True] and h.held_s > 0.2


def test_a_stopped_dit_stops_the_ar_at_its_gate_and_at_its_next_row():
    h = Handoff(head_rows=1, low_rows=0, lead_rows=1)
    h.put({"id": "r0"})
    h.cancel()
    with pytest.raises(Cancelled):
        h.admit(0)
    with pytest.raises(Cancelled):
        h.put({"id": "r1"})


def test_take_gives_every_row_then_none_once_the_ar_finished():
    h = Handoff()
    h.put({"id": "a"})
    threading.Timer(0.2, h.finish).start()
    assert h.take()["id"] == "a" and h.take() is None and h.waited_s >= 0.15


def test_the_handoff_refuses_sizes_that_cannot_work():
    with pytest.raises(ValueError, match="head"):
        Handoff(head_rows=0)
    with pytest.raises(ValueError, match="low"):
        Handoff(head_rows=2, low_rows=8, lead_rows=8)


# -- whole jobs -----------------------------------------------------------------------------------
def _job(dataset: str, out: str, run_id: str, overlap: str, **extra):
    from components.jobconfig import JobConfig
    from pipeline.local import run_job

    config = JobConfig(dataset=dataset, output=out, run_id=run_id, num_shards=2, model="tiny", device="cpu",
                       steps=2, guidance=5.0, max_new_tokens=6, temperature=0.0, overlap=overlap, **extra)
    return run_job(config, progress=False)


def _outputs(out: str, run_id: str) -> dict[str, tuple]:
    """Per row: its CoT tokens and image bytes, and how its K/V came."""
    rows = {}
    for path in sorted(Path(out, run_id, "shards").glob("*/rows.parquet")):
        for r in pq.read_table(path).to_pylist():
            image = Path(out, r["image_key"]).read_bytes() if r["status"] == "ok" else None
            rows[r["id"]] = (r["generated_ids"], image, r["kv_path"], r.get("kv_store"), r["status"])
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from components.data.sample import write_sample_edit_dataset

    root = tmp_path_factory.mktemp("overlap")
    return str(write_sample_edit_dataset(root / "edit.parquet", n=10, size=64)), root


def test_the_overlapped_job_gives_the_sequential_jobs_rows_bitwise(dataset):
    data, root = dataset
    out = str(root / "runs")
    # 5 rows a shard: the head wave (4) and a row joining later, so the AR's batches differ from the
    # sequential step's; --batch-invariant makes each row's numbers its own
    seq = _job(data, out, "seq", "off", batch_invariant=True)
    ovl = _job(data, out, "ovl", "on", batch_invariant=True)
    a, b = _outputs(out, "seq"), _outputs(out, "ovl")
    assert len(a) == 10 and a.keys() == b.keys()
    assert all(a[k][:2] == b[k][:2] for k in a), "tokens and images differ between the schedules"
    assert {v[2:] for v in b.values()} == {("reuse", "memory", "ok")}  # handed over in memory, counted as reuse
    assert (seq["shards_overlapped"], ovl["shards_overlapped"]) == (0, 2)
    assert ovl["kv_paths"] == {"reuse": 10} and ovl["kv_stores"] == {"memory": 10}
    record = json.loads(Path(out, "ovl", "shards", "0", "steps", "overlap.json").read_text())
    assert record["handoff"]["rows"] == 5 and record["load_s"] >= 0
    assert not list(Path(out, "ovl").glob("_kv*"))  # no K/V went through a directory


def test_without_batch_invariance_the_overlapped_rows_are_the_same_greedy_tokens(dataset):
    data, root = dataset
    out = str(root / "runs")
    _job(data, out, "seq-b", "off")
    _job(data, out, "ovl-b", "on")
    a, b = _outputs(out, "seq-b"), _outputs(out, "ovl-b")
    assert all(a[k][0] == b[k][0] for k in a)  # float32 on the CPU: the batches' rounding does not flip a token


def _events(data: str, out: str, run_id: str, overlap: str, monkeypatch) -> tuple[list, dict[str, int]]:
    """The order in which rows finish their AR and start their DiT (each DiT row slowed down, so an
    AR that may run ahead does), and each row's shard."""
    import components.dit.run as dit_run
    from components.engine import ar_scheduler

    events: list[tuple[str, str]] = []
    finish, denoise = ar_scheduler.ARScheduler._finish, dit_run._denoise_retrying_oom

    def finish_logged(self, seq):
        finish(self, seq)
        events.append(("ar", seq.request.id))

    def denoise_logged(engine, request):
        events.append(("dit", request.ar.id))
        time.sleep(0.3)
        return denoise(engine, request)

    monkeypatch.setattr(ar_scheduler.ARScheduler, "_finish", finish_logged)
    monkeypatch.setattr(dit_run, "_denoise_retrying_oom", denoise_logged)
    _job(data, out, run_id, overlap)
    monkeypatch.undo()
    shard_of = {r["id"]: int(p.parent.name) for p in Path(out, run_id, "shards").glob("*/rows.parquet")
                for r in pq.read_table(p).to_pylist()}
    return events, shard_of


def _next_shard_ar_before_last_dit(events, shard_of) -> bool:
    last_dit = max(i for i, (kind, row) in enumerate(events) if kind == "dit" and shard_of[row] == 0)
    return any(kind == "ar" and shard_of[row] == 1 for kind, row in events[:last_dit])


def test_the_next_shards_ar_runs_while_the_dit_finishes_this_one(dataset, monkeypatch):
    """One overlapped copy chains its shards: the AR of shard 1 starts when the AR of shard 0 ends,
    not when shard 0 commits, so the DiT finds shard 1's first rows ready. Control: in turn (off),
    no row of shard 1 finishes its AR before shard 0's last DiT row."""
    data, root = dataset
    out = str(root / "runs")
    events, shard_of = _events(data, out, "chain", "on", monkeypatch)
    assert sorted(set(shard_of.values())) == [0, 1] and len(shard_of) == 10
    assert _next_shard_ar_before_last_dit(events, shard_of), events
    record = json.loads(Path(out, "chain", "shards", "1", "steps", "overlap.json").read_text())
    assert record["handoff"]["rows"] == 5 and record["load_s"] == 0.0  # one load for the chain
    events, shard_of = _events(data, out, "chain-off", "off", monkeypatch)
    assert not _next_shard_ar_before_last_dit(events, shard_of), events
    a, b = _outputs(out, "chain"), _outputs(out, "chain-off")
    assert all(a[k][0] == b[k][0] for k in a)  # the same greedy tokens either way


def test_a_chained_shards_ar_keeps_the_budget_the_first_measured(dataset, monkeypatch):
    """Measured beside the previous shard's DiT, the free GPU memory is short by what that DiT holds,
    which the DiT's reserve already set aside: the chained AR would run a smaller batch. Each
    measurement here comes out smaller (as on the GPU); the second shard's AR must keep the first's.
    Control: sequential steps (no chain) measure each time."""
    from components.engine import ar_scheduler

    real = ar_scheduler.Admission.for_model.__func__
    budgets = iter([6 << 30, 5 << 30, 4 << 30, 3 << 30])

    def shrinking(cls, model, *args, **kwargs):
        admission = real(cls, model, *args, **kwargs)
        admission.kv_budget_bytes = next(budgets)  # the CPU has no byte limit: as a GPU would measure
        return admission

    monkeypatch.setattr(ar_scheduler.Admission, "for_model", classmethod(shrinking))
    data, root = dataset
    out = str(root / "runs")
    for run_id, overlap in (("budget-chain", "on"), ("budget-seq", "off")):
        _job(data, out, run_id, overlap)
    kept = [json.loads(Path(out, r, "shards", str(s), "steps", "ar.json").read_text())["scheduler"]["kv_budget_bytes"]
            for r in ("budget-chain", "budget-seq") for s in (0, 1)]
    assert kept == [6 << 30, 6 << 30, 4 << 30, 3 << 30]  # (the chained AR measured 5 and kept 6)


def test_a_chained_shards_ar_fills_its_pool_from_its_first_wave(dataset, monkeypatch):
    """The first shard's AR admits a small head wave (4 rows) so that the idle DiT starts soon; a
    chained shard's AR starts while the DiT still denoises the shard before, so it admits a whole
    wave at once (all 5 of its rows here) instead of running 4 rows for a whole CoT first. Control:
    the first shard admits no fifth row before one of its rows finished."""
    from components.runtime.handoff import HEAD_ROWS, Handoff

    admitted: list[tuple[int, int, int]] = []  # (handoff, rows in flight, rows finished) of each admission
    real = Handoff.admit

    def admit(self, in_flight):
        ok = real(self, in_flight)
        if ok:
            admitted.append((id(self), in_flight, self.put_count))
        return ok

    monkeypatch.setattr(Handoff, "admit", admit)
    data, root = dataset
    _job(data, str(root / "runs"), "full-wave", "on")
    first, chained = list(dict.fromkeys(h for h, _, _ in admitted))
    before_any_finished = {h: max(n for hh, n, put in admitted if hh == h and put == 0) + 1 for h in (first, chained)}
    assert before_any_finished == {first: HEAD_ROWS, chained: 5}


class Broke(BaseException):
    """A failure the AR scheduler does not recover from (it retries rows after an Exception)."""


def test_an_ar_failure_mid_shard_stops_the_dit_keeps_its_rows_and_a_resume_completes(dataset, monkeypatch):
    from components.engine import ar_scheduler

    data, root = dataset
    out = str(root / "runs")
    finished = []
    real = ar_scheduler.ARScheduler._finish

    def finish(self, seq):
        real(self, seq)
        finished.append(seq.request.id)
        if len(finished) == 3:
            raise Broke("planted: the AR side broke")

    monkeypatch.setattr(ar_scheduler.ARScheduler, "_finish", finish)
    with pytest.raises(Broke, match="planted: the AR side broke"):
        _job(data, out, "arfail", "on")
    rows = [json.loads(p.read_text()) for p in Path(out, "arfail", "shards", "0", "rows").glob("*.json")]
    assert rows and all(r["kv_path"] == "reuse" for r in rows)  # the rows handed over kept their K/V
    written = sorted(p.stem for p in Path(out, "arfail", "shards", "0", "rows").glob("*.json"))
    assert 1 <= len(written) <= 3  # what the DiT took before the AR broke is written
    before = {name: Path(out, "arfail", "shards", "0", "rows", f"{name}.json").read_bytes() for name in written}
    monkeypatch.setattr(ar_scheduler.ARScheduler, "_finish", real)
    summary = _job(data, out, "arfail", "on")
    assert (summary["rows_ok"], summary["rows_failed"], summary["complete"]) == (10, 0, True)
    assert all(Path(out, "arfail", "shards", "0", "rows", f"{n}.json").read_bytes() == b for n, b in before.items())


def test_a_dit_failure_stops_the_ar_and_a_resume_completes(dataset, monkeypatch):
    import components.dit.run as dit_run

    data, root = dataset
    out = str(root / "runs")
    calls = []
    real = dit_run._denoise_retrying_oom

    def denoise(engine, request):
        calls.append(request.ar.id)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as Ctrl-C in the DiT's thread, the job's main thread
        return real(engine, request)

    monkeypatch.setattr(dit_run, "_denoise_retrying_oom", denoise)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        _job(data, out, "ditfail", "on")
    assert time.perf_counter() - t0 < 60
    assert not [t for t in threading.enumerate() if t.name.startswith("ar-shard-") and t.is_alive()]
    monkeypatch.setattr(dit_run, "_denoise_retrying_oom", real)
    summary = _job(data, out, "ditfail", "on")
    assert (summary["rows_ok"], summary["complete"]) == (10, True)


def test_a_job_killed_mid_overlap_keeps_its_rows_and_the_same_command_completes_it(dataset):
    data, root = dataset
    out = str(root / "runs")
    cmd = [sys.executable, "-m", "pipeline.cli", "edit", data, "-o", out, "--run-id", "killed", "--model", "tiny",
           "--device", "cpu", "--num-shards", "1", "--steps", "2", "--max-new-tokens", "6", "--temperature", "0",
           "--overlap", "on"]
    rows_dir = Path(out, "killed", "shards", "0", "rows")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while not list(rows_dir.glob("*.json")):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no row was written"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    kept = {p.name: p.read_bytes() for p in rows_dir.glob("*.json")}
    assert 1 <= len(kept) < 10 and not Path(out, "killed", "shards", "0", "_COMMITTED").exists()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(Path(out, "killed", "summary.json").read_text())
    assert (summary["rows_ok"], summary["rows_failed"], summary["complete"]) == (10, 0, True)
    assert all((rows_dir / name).read_bytes() == data for name, data in kept.items())  # not redone


def test_overlap_is_checked_before_any_work(tmp_path):
    from components.errors import ConfigError
    from components.preflight import check_overlap

    check_overlap("off", 4)
    check_overlap("on", 1)
    check_overlap("auto", 4)  # auto: in turn for a copy of several ranks
    with pytest.raises(ConfigError, match=r"--overlap 'maybe': use one of auto, on, off"):
        check_overlap("maybe", 1)
    with pytest.raises(ConfigError, match=r"--overlap on: a model copy of 2 ranks"):
        check_overlap("on", 2)
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "edit", str(tmp_path / "x.parquet"), "-o",
                           str(tmp_path / "o"), "--overlap", "sometimes"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--overlap 'sometimes'" in proc.stderr and "Traceback" not in proc.stderr


def test_overlap_auto_is_on_for_one_gpu_copies_only():
    from components.jobconfig import JobConfig
    from pipeline.local import overlaps

    base = JobConfig(dataset="d", output="o", run_id="r")
    assert base.overlap == "auto"
    assert overlaps(base, "cuda") and overlaps(base, "cuda:1") and not overlaps(base, "cpu")
    assert not overlaps(base.replace(overlap="off"), "cuda") and overlaps(base.replace(overlap="on"), "cpu")
    assert not overlaps(base.replace(tensor_parallel_size=2), "cuda")
    assert not overlaps(base.replace(overlap="on", pipeline_parallel_size=2), "cuda")
    assert not overlaps(base.replace(overlap="on", ar_from_run="other"), "cuda")


# -- two threads, one process: compiled calls and side streams ------------------------------------
def test_a_compiled_call_never_runs_while_another_thread_traces(monkeypatch):
    """A call that compiles sets torch.fx's process-wide tracing flag while it traces; a compiled
    call of another thread meanwhile raised ("symbolically trace a dynamo-optimized function") and
    sent its shape to the plain path for good. The compiled regions run one thread at a time."""
    import contextlib

    import torch
    import torch.fx._symbolic_trace as fx_trace

    from components.engine import kernels
    from components.engine.kernels import compiled_layers

    def tracing_call(layer, x, cos, sin):  # a first call: it traces (compiles) for a while
        fx_trace._is_fx_tracing_flag = True
        time.sleep(0.2)
        fx_trace._is_fx_tracing_flag = False
        return x, x, x

    def compiled_call(layer, x, out):  # a dynamo-optimized function refuses to run inside a trace
        if fx_trace.is_fx_tracing():
            raise RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function")
        return x

    class Layer:
        @staticmethod
        def cached_attention(q, k, v, mask, cache, index):
            return q

    # a decode step's regions (one token a row) call; a DiT step's (two tokens here) compile
    fake = {"decode": (lambda layer, x, cos, sin: (x, x, x), compiled_call), "step": (tracing_call, lambda l, x, o: x)}
    monkeypatch.setattr(compiled_layers, "regions", lambda layer_type, kind="step": fake[kind])

    def race() -> list[str]:
        errors: list[str] = []
        step, decode = torch.zeros(1, 2, 4), torch.zeros(1, 1, 4)

        def tracer() -> None:
            for _ in range(3):
                compiled_layers.layer_step(Layer(), step, step, step, None, None, 0)

        def caller() -> None:
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                try:
                    compiled_layers.layer_step(Layer(), decode, decode, decode, None, None, 0)
                except RuntimeError as e:
                    errors.append(str(e))
                time.sleep(0.001)
        threads = [threading.Thread(target=tracer), threading.Thread(target=caller)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    assert race() == []
    monkeypatch.setattr(compiled_layers, "COMPILED_CALLS", contextlib.nullcontext())  # the planted bug
    assert any(kernels.NESTED_TRACE in e for e in race())


def test_the_race_if_it_comes_costs_one_plain_call_not_a_fallback_for_good():
    from components.engine import kernels

    kernels.reset_fallbacks()

    def fast():
        raise RuntimeError("Detected that you are using FX to symbolically trace a dynamo-optimized function")

    assert kernels.run_fast("compiled_layers", ("k",), fast, lambda: "plain") == "plain"
    assert kernels.fallbacks() == 0 and kernels.run_fast("compiled_layers", ("k",), lambda: "fast", None) == "fast"
