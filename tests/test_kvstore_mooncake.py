"""Mooncake-only behaviour with real servers: pinning when full, bounded waits, server CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from components.kvstore import StoreError, open_store
from components.kvstore.servers import _alive, free_port
from tests.fixtures_mooncake import require_loopback_only, start_servers
from tests.test_kvstore_payload import assert_same, make_kv

pytestmark = pytest.mark.servers
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_servers(tmp_path):
    """Own servers with a 48 MB segment (tests that fill or freeze the store)."""
    srv = start_servers(tmp_path / "mc", segment="48MB")
    try:
        yield srv
    finally:
        srv.stop()


def test_full_store_fails_the_put_and_evicts_nothing(small_servers):
    """Hard-pinned payloads are never evicted: when full, the put fails loudly, earlier
    payloads stay readable, and deleting consumed ones makes room again."""
    s = open_store(small_servers.url + "&part=4MB&pin=hard")
    kv = make_kv(
        torch.bfloat16, layers=8, tokens=1024, heads=4, head_dim=64
    )  # 8 MiB of tensors
    put = []
    with pytest.raises(StoreError, match="store full") as e:
        for i in range(20):  # 20 x 8 MiB into 48 MB
            s.put(f"full/0/{i}", kv)
            put.append(f"full/0/{i}")
    assert 3 <= len(put) < 6, (len(put), str(e.value))
    assert s.keys("full") == put  # the failed put left nothing behind
    assert not [k for k in s.raw_keys() if k.startswith(f"full/0/{len(put)}")]
    for k in put:
        assert_same(kv, s.get(k).kv)
    s.delete(put[0])
    s.put("full/0/again", kv)
    assert s.get("full/0/again").ok
    assert s.delete_prefix("full") == len(put)
    assert s.raw_keys() == []
    s.close()


def test_hung_segment_holder_gives_timeout_not_a_silent_wait(small_servers):
    """A frozen holder (SIGSTOP) makes the transfer hang: get returns 'timeout' after the
    configured bound, and the store works again once the holder resumes."""
    s = open_store(small_servers.url + "&timeout=3")
    kv = make_kv(torch.bfloat16, layers=4, tokens=512, heads=4, head_dim=64)
    s.put("hang/0/0", kv)
    holder = small_servers.state.pids["holder"]
    os.kill(holder, signal.SIGSTOP)
    try:
        r = s.get("hang/0/0")
    finally:
        os.kill(holder, signal.SIGCONT)
    assert r.kv is None and r.code == "timeout", r.reason
    for _ in range(50):  # the abandoned transfer finishes once the holder runs again
        r = s.get("hang/0/0")
        if r.ok:
            break
        time.sleep(0.2)
    assert r.ok, r.reason
    assert_same(kv, r.kv)
    s.delete_prefix("hang")
    s.close()


def test_cli_up_status_down_from_another_process(tmp_path):
    require_loopback_only()
    state = tmp_path / "state"
    ports = [free_port() for _ in range(4)]
    def cli(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
        """`ardit store ARGS --state-dir STATE` in a separate process."""
        return subprocess.run(
            [sys.executable, "-c", "from components.kvstore.cli import app; app()", *args, "--state-dir", str(state)],
            cwd=ROOT, check=False, capture_output=True, text=True, timeout=timeout,
        )

    def cli_url(*args: str) -> subprocess.CompletedProcess:  # keys / clean take no --state-dir
        return subprocess.run([sys.executable, "-c", "from components.kvstore.cli import app; app()", *args],
                              cwd=ROOT, check=False, capture_output=True, text=True, timeout=60)

    ports_args = ["--master-port", str(ports[0]), "--metadata-port", str(ports[1]),
                  "--admin-port", str(ports[2]), "--holder-port", str(ports[3])]
    up = cli("up", "--segment", "64MB", *ports_args, timeout=120)
    pids = {}
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        url = up.stdout.strip().splitlines()[-1]
        assert url.startswith(f"mooncake://127.0.0.1:{ports[0]}?")
        pids = json.loads((state / "servers.json").read_text())["pids"]
        assert set(pids) == {"master", "metadata", "holder"} and all(
            _alive(p) for p in pids.values()
        )
        st = cli("status")
        assert st.returncode == 0 and json.loads(st.stdout)["running"], st.stdout
        for name, pid in pids.items():  # nothing listens beyond loopback, the segment holder included
            assert listening(pid) and all(a in LOOPBACK for a, _ in listening(pid)), (name, listening(pid))
        with open_store(url) as s:  # the servers work
            s.put("cli/0/0", make_kv())
            assert s.get("cli/0/0").ok
        keys = cli_url("keys", url, "--prefix", "cl")  # any prefix, not only whole path segments
        assert (keys.returncode, keys.stdout, keys.stderr) == (0, "cli/0/0\n", ""), keys
        clean = cli_url("clean", url, "--run", "cli")
        assert (clean.returncode, clean.stderr) == (0, ""), clean  # no Mooncake log lines
        assert "deleted 1 payload(s)" in clean.stdout
        again = cli("up")
        assert again.returncode != 0 and "already running" in (
            again.stderr + again.stdout
        )
    finally:
        down = cli("down")
        for p in pids.values():  # never leave a server behind, even if `down` is broken
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
    assert pids and not any(_alive(p) for p in pids.values())
    assert not (state / "servers.json").exists()
    assert cli("status").returncode == 1


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on, from /proc."""
    import socket

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = f[1].split(":")
            raw = bytes.fromhex(addr_hex)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


def test_payloads_are_a_lease_and_old_ones_expire(small_servers):
    """Soft pin with a TTL instead of a hard pin forever: the AR step's housekeeping deletes the
    payloads a failed run left behind once they are older than the TTL, and only those."""
    from components.ar.run import _BackgroundPuts

    s = open_store(small_servers.url + "&pin_ttl=1s")
    kv = make_kv()
    s.put("orphan/0/0", kv)
    assert s.ttl_s == 1.0 and not s._rcfg.with_hard_pin and s._rcfg.soft_pin_ttl_ms == 1000
    time.sleep(1.5)
    s.put("fresh/0/0", kv)
    puts = _BackgroundPuts(s)
    puts.expire_orphans()
    puts.pool.shutdown(wait=True)
    assert s.keys() == ["fresh/0/0"]
    assert [k for k in s.raw_keys() if k.startswith("orphan")] == []  # its parts too
    s.delete_prefix("fresh")
    s.close()


def test_dead_servers_give_unreachable_at_once(small_servers):
    """Holder killed: its data is gone ('unreachable', later 'missing'); master killed: every get
    says 'unreachable', health is not ok, puts raise."""
    s = open_store(small_servers.url + "&timeout=20")
    kv = make_kv(torch.bfloat16, layers=2, tokens=256, heads=4, head_dim=64)
    s.put("dead/0/0", kv)
    os.kill(small_servers.state.pids["holder"], signal.SIGKILL)
    r = s.get("dead/0/0")
    assert (
        r.kv is None and r.code in ("unreachable", "missing") and "dead/0/0" in r.reason
    ), r.reason
    os.kill(small_servers.state.pids["master"], signal.SIGKILL)
    r = s.get("dead/0/0")
    assert r.kv is None and r.code == "unreachable", r.reason
    assert not s.health().ok
    with pytest.raises(StoreError, match="dead/0/1"):
        s.put("dead/0/1", kv)
    fresh = open_store(small_servers.url)
    assert fresh.get("dead/0/0").code == "unreachable"
