"""The segment holders' readiness probe against real Mooncake servers (loopback only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.probes import segment_registered
from tests.fixtures_mooncake import mooncake_servers  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.servers
def test_holder_is_ready_only_when_the_master_lists_its_segment(mooncake_servers, tmp_path):  # noqa: F811
    state = mooncake_servers.state
    ok, why = segment_registered(state.admin_url, state.host)
    assert ok, why
    ok, why = segment_registered(state.admin_url, "127.0.0.2")  # a holder the master does not know
    assert not ok and "no segment of 127.0.0.2" in why
    # the probe command as the StatefulSet runs it: env only, exit 0 / 1
    env = {"POD_IP": state.host, "MC_MASTER_ADDR": f"{state.host}:{state.master_port}",
           "MC_MASTER_ADMIN": state.admin_url, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    probe = [sys.executable, "-m", "pipeline.probes", "segment-registered"]
    assert subprocess.run(probe, env=env, capture_output=True, check=False).returncode == 0
    assert subprocess.run(probe, env=env | {"POD_IP": "127.0.0.2"}, capture_output=True, check=False).returncode == 1


def test_probe_without_a_master_is_not_ready():
    from tests.test_orchestration import _closed_port

    ok, why = segment_registered(f"http://127.0.0.1:{_closed_port()}", "127.0.0.1", timeout=1)
    assert not ok and "unreachable" in why
