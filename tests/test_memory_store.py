"""The in-process K/V store (`memory://NAME`, components/kvstore/memory.py): what the AR and DiT
steps of one local job's model copy hand the prompt K/V over through."""

from __future__ import annotations

import uuid

import pytest
import torch

from components.kvstore import open_store
from components.kvstore.base import StoreError
from components.kvstore.memory import MemoryStore, parse_memory_url
from tests.test_kvstore_payload import assert_same, make_kv


@pytest.fixture
def url():
    return f"memory://t{uuid.uuid4().hex[:10]}"


def test_a_put_is_got_back_as_the_same_tensors_and_deletes_free_it(url):
    store = open_store(url)
    kv = make_kv(layers=3, tokens=5)
    size = store.put("run/0/a", kv)
    assert size == kv.nbytes() and store.exists("run/0/a") and store.keys("run/") == ["run/0/a"]
    got = store.get("run/0/a", kv.model_id, kv.config_hash)
    assert got.ok and got.reason == "ok"
    assert_same(got.kv, kv)
    assert store.host_bytes == kv.nbytes()  # a CPU payload is kept on the host, counted
    assert store.delete("run/0/a") and not store.exists("run/0/a") and store.host_bytes == 0
    assert not store.delete("run/0/a")


def test_every_open_of_a_name_in_the_process_is_the_same_store(url):
    first, second = open_store(url), open_store(url)
    assert first is second
    first.put("run/0/a", make_kv())
    assert second.exists("run/0/a")
    assert not open_store(url + "x").exists("run/0/a")  # another name, another store


def test_a_missing_payload_says_it_lives_in_another_process(url):
    got = open_store(url).get("run/0/nope")
    assert not got.ok and got.code == "missing"
    assert "memory of the process that put it" in got.reason


def test_model_and_config_mismatches_have_the_other_backends_reason_codes(url):
    store = open_store(url)
    kv = make_kv()
    store.put("run/0/a", kv)
    assert store.get("run/0/a", expect_model_id="other").code == "model_mismatch"
    got = store.get("run/0/a", kv.model_id, expect_config_hash="0" * 16)
    assert got.code == "config_mismatch" and "expected" in got.reason


def test_prefix_delete_expire_and_health(url):
    store = open_store(url)
    for key in ("run/0/a", "run/0/b", "run/1/a", "other/0/a"):
        store.put(key, make_kv())
    assert store.delete_prefix("run/0") == 2 and store.keys() == ["other/0/a", "run/1/a"]
    assert store.expire(3600) == 0 and store.expire(0) == 2 and store.keys() == []
    health = store.health()
    assert health.ok and "0 payload(s)" in health.detail


def test_a_put_past_the_host_budget_is_refused_and_nothing_is_kept():
    kv = make_kv(layers=2, tokens=8)
    store = MemoryStore("budget", host_budget=kv.nbytes() + 10)
    store.put("run/0/a", kv)
    with pytest.raises(StoreError, match="in-memory K/V store past its"):
        store.put("run/0/b", make_kv(layers=2, tokens=8))
    assert store.keys() == ["run/0/a"] and store.host_bytes == kv.nbytes()
    store.put("run/0/a", make_kv(layers=2, tokens=8))  # replacing a payload frees its own room first
    assert store.host_bytes == kv.nbytes()


def test_encoded_payload_bytes_round_trip(url):
    from components.kvstore.payload import encode_payload

    store = open_store(url)
    kv = make_kv(layers=2, tokens=4)
    store.put("run/0/a", encode_payload(kv).tobytes())
    assert_same(store.get("run/0/a").kv, kv)
    with pytest.raises(ValueError, match="not a KV payload"):
        store.put("run/0/b", b"not a payload")
    data = store.get_bytes("run/0/a")
    store.put("run/0/c", data)
    assert_same(store.get("run/0/c").kv, kv)


def test_urls_parse_with_budgets_and_refuse_the_rest():
    assert parse_memory_url("memory://run-1?device=8G&host=64G&ttl=2h") == (
        "run-1", {"device_budget": 8 << 30, "host_budget": 64 << 30, "ttl_s": 7200.0})
    for bad, why in (("memory://", "needs a name"), ("memory://r?size=1G", "takes only"),
                     ("memory://r?host=lots", "not a size")):
        with pytest.raises(ValueError, match=why):
            parse_memory_url(bad)


def test_the_job_checks_refuse_a_bad_memory_url_in_one_line(tmp_path):
    from components.errors import ConfigError
    from components.preflight import check_kv_url

    check_kv_url("memory://run")
    with pytest.raises(ConfigError, match=r"--kv-store: store url 'memory://r\?x=1': memory:// takes only"):
        check_kv_url("memory://r?x=1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_payloads_go_to_pinned_host_memory_and_back():
    kv = make_kv(layers=2, tokens=8)
    kv.keys = [k.cuda() for k in kv.keys]
    kv.values = [v.cuda() for v in kv.values]
    store = MemoryStore("gpu")
    store.put("run/0/a", kv)
    entry = store.entries["run/0/a"]
    assert not entry.on_device and entry.kv.keys[0].is_pinned()
    got = store.get("run/0/a", device="cuda")
    torch.cuda.synchronize()
    assert got.kv.keys[0].is_cuda and torch.equal(got.kv.keys[1], kv.keys[1])
