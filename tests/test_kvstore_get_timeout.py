"""A Mooncake get whose data parts hang (the segment holder frozen after the payload's header was
read) ends with 'timeout' after the store's bound, like a hung header read does
(test_kvstore_mooncake.py freezes the holder before the get, so the header read is what times out
there; here it is the wait for the parts). Real servers, loopback only."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from components.kvstore import open_store
from tests.fixtures_mooncake import start_servers
from tests.test_kvstore_payload import assert_same, make_kv

pytestmark = pytest.mark.servers

TIMEOUT_S = 3
RESUME_AFTER_S = 10 * TIMEOUT_S  # a get that ignored the bound gets its data once the holder runs again


@pytest.fixture
def servers(tmp_path):
    srv = start_servers(tmp_path / "mc", segment="48MB")
    try:
        yield srv
    finally:
        srv.stop()


def test_a_get_whose_parts_hang_times_out_at_the_stores_bound(servers):
    s = open_store(servers.url + f"&timeout={TIMEOUT_S}")
    kv = make_kv(torch.bfloat16, layers=4, tokens=512, heads=4, head_dim=64)
    s.put("hang/0/0", kv)
    holder = servers.state.pids["holder"]
    read_header = s._header
    resumed = threading.Event()

    def resume() -> None:
        resumed.set()
        os.kill(holder, signal.SIGCONT)

    watchdog = threading.Timer(RESUME_AFTER_S, resume)

    def header_then_freeze(*args, **kwargs):
        out = read_header(*args, **kwargs)
        os.kill(holder, signal.SIGSTOP)  # the parts now hang in the frozen holder
        watchdog.start()
        return out

    s._header = header_then_freeze
    try:
        r = s.get("hang/0/0")
    finally:
        watchdog.cancel()
        os.kill(holder, signal.SIGCONT)
        s._header = read_header
    assert not resumed.is_set(), "the get returned only after the holder ran again: its wait had no bound"
    assert r.kv is None and r.code == "timeout", r.reason
    assert "no answer in 3 s" in r.reason
    for _ in range(50):  # the abandoned transfer finishes once the holder runs again
        r = s.get("hang/0/0")
        if r.ok:
            break
        time.sleep(0.2)
    assert r.ok, r.reason
    assert_same(kv, r.kv)
    s.delete_prefix("hang")
    s.close()
