"""The test harness itself: tests that start servers are never dropped quietly under CI."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.fixtures_mooncake import require_loopback_only

ROOT = Path(__file__).resolve().parents[1]


def _fake_checkout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of tests/run.sh beside a stub .venv (pip, python and pytest that only echo) and an
    `id` that says "not root": the script's own decisions, without installing anything."""
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "run.sh", tmp_path / "tests" / "run.sh")
    bin_dir, venv = tmp_path / "stubs", tmp_path / ".venv" / "bin"
    bin_dir.mkdir()
    venv.mkdir(parents=True)
    for name in ("pip", "python"):
        (venv / name).write_text("#!/bin/sh\nexit 0\n")
    (venv / "pytest").write_text('#!/bin/sh\necho "pytest $*"\n')
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")
    for stub in (*venv.iterdir(), bin_dir / "id"):
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return tmp_path / "tests" / "run.sh", env


def test_run_sh_without_a_namespace_fails_under_ci_and_skips_with_a_note_locally(tmp_path):
    script, env = _fake_checkout(tmp_path)
    ci = subprocess.run(["bash", str(script), "-q"], env={**env, "CI": "true"}, capture_output=True, text=True,
                        timeout=60, check=False)
    assert ci.returncode == 2, ci.stdout + ci.stderr
    assert "CI=true but no private network namespace" in ci.stderr and "pytest" not in ci.stdout
    local = subprocess.run(["bash", str(script), "-q"], env=env, capture_output=True, text=True, timeout=60,
                           check=False)
    assert local.returncode == 0, local.stderr
    assert local.stdout.strip() == "pytest -p no:cacheprovider -m not servers -q"
    assert "skipping tests that start servers" in local.stderr


def test_server_fixtures_fail_under_ci_outside_a_loopback_namespace(monkeypatch):
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="loopback-only network namespace"):
        require_loopback_only()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_loopback_only()
