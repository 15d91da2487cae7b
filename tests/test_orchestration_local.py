"""`ardit run-local`: the batch_edit pipeline through kfp.local with the real step programs."""

from __future__ import annotations

import json
import os

import pytest


@pytest.mark.slow
def test_run_local_edits_every_row(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli_orchestration import app

    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["run-local", "--output", str(out), "--run-id", "t1", "--num-shards", "2",
                                      "--steps", "2"])
    assert result.exit_code == 0, result.output
    brief = json.loads(result.output.strip().splitlines()[-1])
    assert brief["run_id"] == "t1" and brief["complete"] is True
    assert brief["rows_ok"] + brief["rows_failed"] == brief["rows_total"] == 4
    assert brief["rows_ok"] > 0
    summary = json.loads((out / "t1" / "summary.json").read_text())
    assert summary["shards_committed"] == [0, 1]
    assert len(list((out / "t1" / "shards").glob("*/images/*.png"))) == brief["rows_ok"]


_OFFLINE_TASK = """
from kfp import dsl, local
local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root={root!r})

@dsl.component(base_image="python:3.11")
def double(x: int) -> int:
    return 2 * x

assert double(x=21).output == 42
"""


def test_kfp_local_tasks_need_no_network(tmp_path):
    """Each kfp.local task pip-installs kfp --no-deps first; with kfp installed that must work offline
    (run in a network namespace with no interfaces up, where possible)."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare") or subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False).returncode:
        pytest.skip("cannot create a network namespace here (needs root or user namespaces)")
    script = tmp_path / "offline_task.py"  # kfp reads a component's source, so not `python -c`
    script.write_text(_OFFLINE_TASK.format(root=str(tmp_path / "root")))
    done = subprocess.run(["unshare", "-n", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=False,
                          env={**os.environ, "TMPDIR": str(tmp_path)})  # kfp.local's workspace: not /tmp
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
