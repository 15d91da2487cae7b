"""SIGTERM, what a pod gets on eviction and a workflow step at its deadline, stops `ardit` as Ctrl-C
does (issue 35): what is committed stays, the command that resumes is printed, exit code 143, and the
rank processes stop with it (a terminal's Ctrl-C reaches them too; a SIGTERM reaches only `ardit`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEP_TIMEOUT_S = 600

pytestmark = pytest.mark.slow


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing workers (rank processes) whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigterm_stops_a_job_as_ctrl_c_does_with_exit_143(tmp_path):
    from components.data.datasets import write_parquet_bytes

    rows = [{"id": f"r{n}", "prompt": f"a red fox, picture {n}", "seed": n, "size": "auto"} for n in range(2)]
    (tmp_path / "gen.parquet").write_bytes(write_parquet_bytes(pa.Table.from_pylist(rows)))
    out = tmp_path / "out"
    ardit = [sys.executable, "-m", "pipeline.cli"]
    cmd = [*ardit, "generate", str(tmp_path / "gen.parquet"), "-o", str(out), "--num-shards", "2", "--tp", "2",
           "--steps", "1", "--max-new-tokens", "2", "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    try:
        started = proc.stdout.readline()  # "run RUN: generate DATASET -> OUT/RUN"
        resume = proc.stdout.readline()  # "resume with: PYTHON -m pipeline.cli ... --run-id RUN"
        assert started.startswith("run generate-"), started + proc.stderr.read()
        run_id = started.split()[1].rstrip(":")
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not (out / run_id / "shards" / "0" / "_COMMITTED").exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ranks = _spawned_children(proc.pid)
        assert len(ranks) == 2, ranks  # the --tp 2 rank pool, busy with shard 1
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=STEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stdout + stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("terminated (SIGTERM): committed 1 of 2 shard(s)"), stderr
    assert last.endswith(f"resume with: {resume.split(': ', 1)[1].strip()}"), (last, resume)
    assert shlex.split(resume.split(": ", 1)[1])[-2:] == ["--run-id", run_id]
    assert all(_gone(pid) for pid in ranks), [p for p in ranks if not _gone(p)]  # no orphaned ranks


def test_sigterm_before_any_work_exits_143(tmp_path):
    """During the checks: one line, exit 143, nothing started."""
    code = ("import os, signal, sys; from pipeline.cli import main; "
            "import components.preflight as p; real = p.check_dataset; "
            "p.check_dataset = lambda *a: (os.kill(os.getpid(), signal.SIGTERM), real(*a))[1]; "
            "sys.exit(main(sys.argv[1:]))")
    from components.data.sample import write_sample_edit_dataset

    data = write_sample_edit_dataset(str(tmp_path / "e.parquet"), n=1, size=64)
    proc = subprocess.run([sys.executable, "-c", code, "edit", data, "-o", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 143, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("terminated (SIGTERM): nothing was committed; resume with: "), proc.stderr
    assert "run " not in proc.stdout and not (tmp_path / "out").exists()


def test_sigterm_stops_a_tensor_parallel_step_program_with_exit_143(tmp_path):
    """`python -m components.ar --tp 2` (a KFP / Argo step) on SIGTERM: what its shard has committed,
    how to resume, exit 143, and its rank processes stopped with it. It died silently before."""
    from components.data.sample import write_sample_edit_dataset
    from components.shard.run import run as run_shard
    from components.models import model_validators

    data = write_sample_edit_dataset(str(tmp_path / "e.parquet"), n=2)
    out = str(tmp_path / "out")
    count, supported, budget = model_validators("tiny")
    run_shard(data, out, "term", 1, "edit", count_tokens=count, is_supported_size=supported, max_prompt_tokens=budget)
    cmd = [sys.executable, "-m", "components.ar", "--output", out, "--run-id", "term", "--shard", "0",
           "--model", "tiny", "--device", "cpu", "--tp", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(ranks := _spawned_children(proc.pid)) < 2:  # the step's two ranks, loading the model
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=STEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stdout + stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        "python -m components.ar: terminated (SIGTERM): shard 0 of run term is not committed; 0 of its 2 row(s) "
        "are recorded and kept; run the same command again to resume"), stderr
    assert all(_gone(pid) for pid in ranks), [p for p in ranks if not _gone(p)]  # no orphaned ranks


def test_sigterm_stops_a_one_process_step_program_with_exit_143():
    """A step program without ranks (a DiT at TP 1, the shard and summary steps): the same line."""
    code = ("import os, signal, sys, time; from components.step_program import step_main; "
            "sys.exit(step_main('python -m components.dit', "
            "lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(60), 0)[-1]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("python -m components.dit: terminated (SIGTERM): committed rows are kept; run the "
                                   "same command again to resume"), proc.stderr
