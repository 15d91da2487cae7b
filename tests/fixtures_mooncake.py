"""Real Mooncake servers (master, metadata server, segment holder) on 127.0.0.1 for tests.

Use from a test module:  `from tests.fixtures_mooncake import mooncake_url  # noqa: F401`
and mark the tests `@pytest.mark.servers`. CI runs them in a loopback-only namespace:

    unshare -n bash -c 'ip link set lo up && .venv/bin/pytest -m servers'
"""

from __future__ import annotations

import os
import socket

import pytest

from components.kvstore.servers import MooncakeServers

NETNS_HINT = "unshare -n bash -c 'ip link set lo up && .venv/bin/pytest -m servers ...'"


def require_loopback_only() -> None:
    """Server tests only run where nothing but `lo` exists, so no traffic can leave the host."""
    names = [n for _, n in socket.if_nameindex()]
    if names != ["lo"]:
        why = f"server tests run in a loopback-only network namespace (found {names}): {NETNS_HINT}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}")  # CI must not pass without the servers
        pytest.skip(why)


def start_servers(workdir, segment: str = "512MB") -> MooncakeServers:
    require_loopback_only()
    return MooncakeServers(segment=segment, workdir=workdir).start()


@pytest.fixture(scope="session")
def mooncake_servers(tmp_path_factory):
    """Session-wide servers; stopped by PID in the finalizer even if a test fails."""
    srv = start_servers(tmp_path_factory.mktemp("mooncake"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def mooncake_url(mooncake_servers) -> str:
    """Store URL of the session servers, e.g. for `open_store(url)` or `--kv-store url`."""
    return mooncake_servers.url
