"""pipeline.launch: how every step container starts (variables, empty options, model/PVC rule, retries)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.launch import drop_empty_options, expand, step_argv

REPO = Path(__file__).resolve().parents[1]


def test_expand_like_kubernetes():
    env = {"MC_MASTER_ADDR": "m:50051", "MC_DEVICE": ""}
    assert expand("mooncake://$(MC_MASTER_ADDR)?device=$(MC_DEVICE)", env) == "mooncake://m:50051?device="
    assert expand("$(UNSET) stays", env) == "$(UNSET) stays"
    assert expand("$$(MC_MASTER_ADDR) escaped", env) == "$(MC_MASTER_ADDR) escaped"


def test_empty_options_are_dropped_and_nothing_else():
    argv = ["--model", "tiny", "--quantization", "", "--steps", "", "--guidance", "7.5", "--flag", "positional"]
    assert drop_empty_options(argv) == ["--model", "tiny", "--guidance", "7.5", "--flag", "positional"]
    assert step_argv(["--kv-store", "$(KV)", "--q", "$(EMPTY)"], env={"KV": "local:///x", "EMPTY": ""}) == [
        "--kv-store", "local:///x"]


def _launch(tmp_path: Path, options: list[str], script: str, *args: str, timeout: float = 60):
    child = tmp_path / "child.py"
    child.write_text(script)
    return subprocess.run([sys.executable, "-m", "pipeline.launch", *options, "--", sys.executable, str(child), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout, check=False)


# A child that counts its attempts in a file and exits with the code listed for that attempt.
_COUNTING = """
import pathlib, sys
counter = pathlib.Path(sys.argv[1])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
codes = [int(c) for c in sys.argv[2].split(",")]
print("argv", sys.argv[3:])
sys.exit(codes[min(n, len(codes) - 1)])
"""


def _retry_opts(retries: int = 3, never: str = "2") -> list[str]:
    return ["--retries", str(retries), "--backoff", "0", "--no-retry-exit-codes", never]


def test_retries_failures_then_succeeds(tmp_path):
    done = _launch(tmp_path, _retry_opts(), _COUNTING, str(tmp_path / "n"), "1,1,0", "--x", "", "--y", "v")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "n").read_text() == "3"
    assert "attempt 1 exited 1; retrying" in done.stderr
    assert "argv ['--y', 'v']" in done.stdout  # the empty option never reached the step


def test_never_retries_a_usage_error(tmp_path):
    done = _launch(tmp_path, _retry_opts(), _COUNTING, str(tmp_path / "n"), "2,0")
    assert done.returncode == 2 and (tmp_path / "n").read_text() == "1"
    done = _launch(tmp_path, _retry_opts(never="1,2"), _COUNTING, str(tmp_path / "m"), "1,0")
    assert done.returncode == 1 and (tmp_path / "m").read_text() == "1"  # the sweep's failed gate


def test_gives_up_after_the_retry_limit(tmp_path):
    done = _launch(tmp_path, _retry_opts(retries=2), _COUNTING, str(tmp_path / "n"), "1")
    assert done.returncode == 1 and (tmp_path / "n").read_text() == "3"


def test_a_hung_attempt_is_killed_and_retried(tmp_path):
    script = ("import pathlib, sys, time\np = pathlib.Path(sys.argv[1])\nfirst = not p.exists()\np.write_text('x')\n"
              "time.sleep(600 if first else 0)\n")
    done = _launch(tmp_path, [*_retry_opts(retries=1), "--attempt-timeout", "2"], script, str(tmp_path / "n"))
    assert done.returncode == 0 and "exceeded 2 s" in done.stderr


def test_signal_death_reads_as_128_plus_signal(tmp_path):
    # (OOM kill: retried like any failure, reported as the shell and Kubernetes would report it)
    done = _launch(tmp_path, ["--attempt-timeout", "60"], "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert done.returncode == 137


def test_without_retries_the_step_replaces_the_launcher(tmp_path):
    done = _launch(tmp_path, [], "import os, sys\nprint(os.getpid())\nsys.exit(3)\n")
    assert done.returncode == 3


@pytest.mark.parametrize("pvc,model,ok", [("", "tiny", True), ("w", "/weights", True), ("w", "/weights/ckpt", True),
                                          ("w", "tiny", False), ("", "/weights", False)])
def test_model_and_weights_pvc_are_checked_before_the_step_runs(tmp_path, pvc, model, ok):
    done = _launch(tmp_path, ["--weights-pvc", pvc], "print('step ran')\n", "--model", model)
    if ok:
        assert done.returncode == 0 and "step ran" in done.stdout
    else:
        assert done.returncode == 2 and "step ran" not in done.stdout
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: ")


def test_launcher_usage_error_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pipeline.launch", "python", "-m", "x"], capture_output=True,
                          text=True, cwd=REPO, check=False)
    assert done.returncode != 0 and "expected: OPTIONS -- python -m MODULE ARGS" in done.stderr


def test_not_after_stops_attempts_at_the_run_deadline(tmp_path):
    """--not-after (a scheduled KFP run's deadline): past it no attempt starts; a running one is
    stopped at it, without a retry after; an empty value means none; a bad one is a usage error."""
    import time

    counter = tmp_path / "n"
    past = str(time.time() - 1)
    done = _launch(tmp_path, [*_retry_opts(), "--not-after", past], _COUNTING, str(counter), "0")
    assert done.returncode == 124 and "deadline" in done.stderr and not counter.exists()
    soon = str(time.time() + 2)
    sleeper = "import time; time.sleep(120)"
    done = _launch(tmp_path, [*_retry_opts(), "--not-after", soon], sleeper)
    assert done.returncode == 124 and "retrying" not in done.stderr
    done = _launch(tmp_path, ["--not-after", ""], _COUNTING, str(counter), "0")
    assert done.returncode == 0 and counter.read_text() == "1"
    done = _launch(tmp_path, ["--not-after", "tomorrow"], _COUNTING, str(counter), "0")
    assert done.returncode == 2 and "not a Unix time" in done.stderr
