"""One store suite, run against the local backend (no servers) and a real Mooncake store
(`servers`: master + metadata server + segment holder on 127.0.0.1, loopback-only namespace)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from components.kvstore import GetResult, open_store
from tests.fixtures_mooncake import mooncake_servers, mooncake_url  # noqa: F401
from tests.step_config import step_config
from tests.test_kvstore_payload import assert_same, make_kv

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(
    params=[
        "local",
        pytest.param("mooncake", marks=pytest.mark.servers),
        pytest.param("mooncake-batch", marks=pytest.mark.servers),
    ]
)
def store_url(request, tmp_path):
    if request.param == "local":
        return f"local://{tmp_path}/kv"
    # small parts so tiny tensors still make multi-part payloads; batch: one call each way
    n = 1 if request.param == "mooncake-batch" else 3
    return (
        request.getfixturevalue("mooncake_url")
        + f"&part=1MB&buffer=1MB&timeout=20&put_streams={n}&get_groups={n}"
    )


@pytest.fixture
def store(store_url):
    s = open_store(store_url)
    yield s
    s.close()


@pytest.fixture
def run():
    return f"t{uuid.uuid4().hex[:10]}"


def raw_keys(store) -> list[str]:
    """Everything the backend holds (for mooncake: part objects too)."""
    return store.raw_keys() if hasattr(store, "raw_keys") else store.keys()


def ours(store, run) -> list[str]:
    return [k for k in raw_keys(store) if k.startswith(run)]


def run_py(code: str, *args: str) -> str:
    """Run `code` in a fresh Python process (its own mooncake client) and return its stdout."""
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, (
        f"child failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    )
    return p.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_get_roundtrip(store, run, dtype):
    kv = make_kv(
        dtype, layers=4, tokens=300, heads=4, head_dim=64
    )  # ~0.6-1.2 MB: 1-2 parts
    key = f"{run}/0/5"
    assert not store.exists(key)
    n = store.put(key, kv)
    assert n > kv.nbytes() and store.exists(key)
    r = store.get(key, "tiny", "cfg1")
    assert r.ok and r.reason == "ok"
    assert_same(kv, r.kv)
    assert store.keys(run) == [key]
    assert store.delete(key) and not store.exists(key)
    assert ours(store, run) == []


@pytest.mark.slow  # two fresh Python processes importing torch
def test_producer_exits_then_another_process_gets_identical_bytes(store_url, run):
    """AR-like producer puts and exits; a DiT-like consumer process reads the same bytes."""
    key = f"{run}/3/7"
    producer = """
        import sys, torch
        from components.kvstore import open_store
        from tests.test_kvstore_payload import make_kv
        s = open_store(sys.argv[1])
        kv = make_kv(torch.bfloat16, layers=5, tokens=900, heads=4, head_dim=64, seed=7)  # ~4.6 MB
        s.put(sys.argv[2], kv)
        print("put", s.keys(sys.argv[2].split("/")[0]))
    """
    consumer = """
        import hashlib, sys, torch
        from components.kvstore import open_store
        from tests.test_kvstore_payload import make_kv, assert_same
        s = open_store(sys.argv[1])
        r = s.get(sys.argv[2], "tiny", "cfg1")
        assert r.ok, r.reason
        assert_same(make_kv(torch.bfloat16, layers=5, tokens=900, heads=4, head_dim=64, seed=7), r.kv)
        print(hashlib.sha256(s.get_bytes(sys.argv[2])).hexdigest())
    """
    assert run_py(producer, store_url, key) == f"put ['{key}']"
    digest = run_py(consumer, store_url, key)
    with open_store(store_url) as s:  # a third process's view: same bytes
        assert hashlib.sha256(s.get_bytes(key)).hexdigest() == digest
        assert s.delete_prefix(run) == 1
        assert ours(s, run) == []


def test_growing_payloads_reuse_and_grow_the_buffer(store, run):
    """Payloads bigger than the transfer buffer (1 MB for mooncake here) make it grow;
    smaller ones after that reuse it. Every one reads back intact."""
    kvs = [
        make_kv(torch.bfloat16, layers=2, tokens=t, heads=4, head_dim=64, seed=t)
        for t in (100, 1500, 300, 4000)
    ]
    for i, kv in enumerate(kvs):
        store.put(f"{run}/0/{i}", kv)
    for i, kv in enumerate(kvs):
        assert_same(kv, store.get(f"{run}/0/{i}", "tiny", "cfg1").kv)
    assert store.delete_prefix(run) == len(kvs) and ours(store, run) == []


def test_missing_key_is_absent_with_reason(store, run):
    r = store.get(f"{run}/0/0")
    assert (
        isinstance(r, GetResult)
        and r.kv is None
        and r.code == "missing"
        and f"{run}/0/0" in r.reason
    )
    assert store.get_bytes(f"{run}/0/0") is None
    assert not store.delete(f"{run}/0/0")


@pytest.mark.servers
def test_a_missing_part_is_absent_with_a_reason_that_reads(mooncake_url, run):
    """One part of a multi-part payload gone (evicted): the reason names it. It read "no part 0/1 of
    for 'key'" before."""
    store = open_store(mooncake_url + "&part=1MB&buffer=1MB&timeout=20")
    try:
        key = f"{run}/0/0"
        store.put(key, make_kv(torch.bfloat16, layers=3, tokens=2000, heads=4, head_dim=64))  # ~6 MB: parts
        parts = sorted((k for k in store.raw_keys() if k.startswith(f"{key}#")), key=lambda k: int(k.rsplit(".", 1)[1]))
        assert len(parts) >= 2, parts
        store._remove_regex("^" + re.escape(parts[1]) + "$")
        r = store.get(key, "tiny", "cfg1")
        assert r.kv is None and r.code == "missing", r.reason
        assert f"no part 2/{len(parts)} for {key!r} in the store" in r.reason, r.reason
    finally:
        store.delete_prefix(run)
        store.close()


@pytest.mark.servers
def test_close_waits_for_a_get_call_left_in_flight_before_tearing_the_client_down(mooncake_url, run):
    """A get whose first part group is missing returns at once while later groups are still inside
    the client. Closing the store then must not tear the client down under them: that killed the
    whole test process with SIGSEGV in CI. Here later groups are held a second inside the call; the
    child process keeps a regression from taking the suite down with it."""
    child = """
        import re, sys, threading, time, torch
        from components.kvstore import open_store
        from tests.test_kvstore_payload import make_kv
        url, run = sys.argv[1], sys.argv[2]
        store = open_store(url + "&part=1MB&buffer=1MB&timeout=20&get_groups=3")
        key = f"{run}/0/0"
        store.put(key, make_kv(torch.bfloat16, layers=3, tokens=2000, heads=4, head_dim=64))  # ~6 MB
        parts = sorted((k for k in store.raw_keys() if k.startswith(key + "#")), key=lambda k: int(k.rsplit(".", 1)[1]))
        store._remove_regex("^" + re.escape(parts[0]) + "$")
        events, real = [], store._ms

        class SlowClient:  # the real client; groups without the missing part take a second longer
            def __getattr__(self, name):
                return getattr(real, name)

            def batch_get_into(self, keys, ptrs, sizes):
                if parts[0] not in keys:
                    time.sleep(1.0)
                rcs = real.batch_get_into(keys, ptrs, sizes)
                events.append("get")
                return rcs

            def close(self):
                events.append("close")
                return real.close()

        store._ms = SlowClient()
        r = store.get(key, "tiny", "cfg1")
        assert r.kv is None and r.code == "missing" and "no part 1/" in r.reason, r.reason
        store.close()
        cleanup = open_store(url)
        cleanup.delete_prefix(run)
        cleanup.close()
        print(",".join(events))
    """
    assert run_py(child, mooncake_url, run) == "get,get,get,close"


def test_corrupted_payload_is_absent_with_reason(store, run):
    kv = make_kv(torch.bfloat16, layers=3, tokens=400, heads=4, head_dim=64)
    store.put(f"{run}/0/0", kv)
    good = bytearray(store.get_bytes(f"{run}/0/0"))
    bad = bytearray(good)
    bad[-100] ^= 0x01  # one bit in the last V tensor
    store.put(f"{run}/0/1", bytes(bad))
    r = store.get(f"{run}/0/1", "tiny", "cfg1")
    assert r.kv is None and r.code == "checksum_mismatch" and "v.2" in r.reason
    hdr = bytearray(good)
    hdr[80] ^= 0x01  # inside the JSON header
    with pytest.raises(ValueError, match="not a KV payload"):
        store.put(f"{run}/0/2", bytes(hdr))
    store.put(f"{run}/0/2", bytes(hdr), check=False)
    r = store.get(f"{run}/0/2")
    assert r.kv is None and r.code == "corrupt" and "header_corrupt" in r.reason
    assert store.get(f"{run}/0/0").ok  # the intact one still reads
    assert store.delete_prefix(run) == 3 and ours(store, run) == []


def test_wrong_model_or_config_is_absent_with_reason(store, run):
    store.put(f"{run}/0/0", make_kv(model_id="tiny", config_hash="cfg1"))
    r = store.get(f"{run}/0/0", expect_model_id="hunyuan-image-3")
    assert r.kv is None and r.code == "model_mismatch" and "'tiny'" in r.reason
    r = store.get(f"{run}/0/0", "tiny", "cfg2")
    assert r.kv is None and r.code == "config_mismatch"
    assert store.get(f"{run}/0/0", "tiny", "cfg1").ok
    store.delete_prefix(run)


def test_replace_keeps_only_the_new_payload(store, run):
    key = f"{run}/1/1"
    store.put(key, make_kv(tokens=500, heads=4, head_dim=64, seed=1))
    new = make_kv(tokens=200, heads=4, head_dim=64, seed=2)
    store.put(key, new)
    assert_same(new, store.get(key).kv)
    store.delete(key)
    assert ours(store, run) == []


def test_run_cleanup_leaves_no_keys_and_spares_other_runs(store, run):
    other = run + "x"  # shares the string prefix, not the run
    kv = make_kv()
    for shard in range(2):
        for row in range(3):
            store.put(f"{run}/{shard}/{row}", kv)
    store.put(f"{other}/0/0", kv)
    assert store.exists_many([f"{run}/0/0", f"{run}/9/9", f"{other}/0/0"]) == [
        True,
        False,
        True,
    ]
    assert len(store.keys(run + "/")) == 6
    assert store.delete(f"{run}/0/0")  # what the DiT does after committing an image
    assert store.delete_prefix(run) == 5  # run-level cleanup
    assert ours(store, run + "/") == [] and store.keys(run + "/") == []
    assert store.keys(run) == [f"{other}/0/0"]  # keys() matches any string prefix
    assert store.keys(other) == [f"{other}/0/0"]
    store.delete_prefix(other)
    assert ours(store, other) == []


def test_expire_removes_only_old_payloads(store, run):
    store.put(f"{run}/0/0", make_kv())
    store.put(f"{run}/0/1", make_kv())
    assert store.expire(3600) == 0 and len(store.keys(run)) == 2
    with pytest.raises(ValueError, match="older_than_s"):
        store.expire(-1)
    assert store.expire(0) >= 2
    assert ours(store, run) == []


def test_health(store):
    h = store.health()
    assert h.ok, h.detail


def test_local_temp_files_never_show_as_keys(tmp_path, run):
    """Local only: a crashed writer's temp file is not a key and is expired with the orphans."""
    s = open_store(str(tmp_path))
    d = tmp_path / run / "0"
    d.mkdir(parents=True)
    tmp = d / ".tmp-1.kv.123.abcd"
    tmp.write_bytes(b"partial")
    os.utime(tmp, (1, 1))
    assert s.keys() == [] and s.get(f"{run}/0/1").code == "missing"
    s.expire(60)
    assert not tmp.exists() and not (tmp_path / run).exists()


def _orphan_a_part(store, run) -> str:
    """What a put killed half-way leaves: data but no payload (mooncake: parts without their
    header object; local: a writer's temp file). Returns the payload key it was for."""
    key = f"{run}/0/killed"
    if hasattr(store, "_remove_regex"):
        store.put(key, make_kv())
        store._remove_regex(f"^{key}$")  # the header goes, the parts stay
    else:
        part = store.root / run / "0" / ".tmp-killed.kv.1.abcd"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(b"partial")
    return key


def test_store_keys_lists_orphaned_parts_and_gc_removes_them(store_url, store, run):
    """`ardit store keys` shows what a killed put left (it used to list payloads only) and
    `ardit store gc` removes it with the payloads older than the TTL, without a later job."""
    from typer.testing import CliRunner

    from components.kvstore.cli import app

    store.put(f"{run}/0/0", make_kv())
    killed = _orphan_a_part(store, run)
    listed = CliRunner().invoke(app, ["keys", store_url, "--prefix", run])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.strip().splitlines()
    assert lines[0] == f"{run}/0/0" and len(lines) >= 2, lines
    assert all("orphaned part" in line for line in lines[1:]), lines
    assert all(line.startswith(f"{run}/0/") for line in lines[1:]) and (
        any(line.startswith(killed + "#") for line in lines[1:]) or "killed" in lines[1]), lines
    kept = CliRunner().invoke(app, ["gc", store_url])  # the default TTL (hours): everything here is fresh
    assert kept.exit_code == 0 and store.keys(run) == [f"{run}/0/0"], kept.output
    gone = CliRunner().invoke(app, ["gc", store_url, "--older-than", "0s"])
    assert gone.exit_code == 0 and "expired" in gone.output, gone.output
    assert store.keys(run) == [] and store.orphaned_parts(run) == [] and ours(store, run) == []
    bad = CliRunner().invoke(app, ["gc", store_url, "--older-than", "soon"])
    assert bad.exit_code == 2 and "not a duration" in bad.output


def test_local_store_has_a_ttl_and_the_dit_step_expires_orphans_at_start(tmp_path, run):
    """The default local store used to keep a killed run's payloads forever: they now expire after
    its TTL (24 h, or ?ttl=), at every AR/DiT step start."""
    from types import SimpleNamespace

    from components.dit.run import _KVReader

    assert open_store(str(tmp_path)).ttl_s == 24 * 3600
    store = open_store(f"local://{tmp_path}?ttl=1h")
    assert store.ttl_s == 3600
    store.put(f"{run}/0/old", make_kv())
    store.put(f"{run}/0/new", make_kv())
    os.utime(store._path(f"{run}/0/old"), (1, 1))
    engine = SimpleNamespace(config=SimpleNamespace(num_key_value_heads=2, num_hidden_layers=2), parallel=None,
                             model=SimpleNamespace(device="cpu", stage_layers=range(2)))
    reader = _KVReader(store, engine, kv_reuse=True)
    reader.close()
    assert store.keys(run) == [f"{run}/0/new"]
    with pytest.raises(ValueError, match="only ttl"):
        open_store(f"local://{tmp_path}?tll=1h")


def test_local_store_refuses_a_put_that_would_fill_its_disk(tmp_path, run, monkeypatch):
    """The embedded store keeps MIN_FREE_BYTES free (a tenth of the free space on a small disk): a
    put that would eat into them fails (the row's DiT recomputes) and leaves nothing behind; one
    that fits is stored; `?min_free=` sets the reserve."""
    import shutil

    from components.kvstore import local
    from components.kvstore.base import StoreError

    real = shutil.disk_usage
    free = {"now": 100 << 30}
    monkeypatch.setattr(local.shutil, "disk_usage", lambda path: real(path)._replace(free=free["now"]))
    s = open_store(str(tmp_path))
    assert s.min_free_bytes == local.MIN_FREE_BYTES
    kv = make_kv()
    free["now"] = local.MIN_FREE_BYTES + 1000
    with pytest.raises(StoreError, match=r"GiB free on the disk of .*--kv-store local:///a/bigger/disk"):
        s.put(f"{run}/0/big", kv)
    assert s.keys() == [] and not [p for p in tmp_path.rglob("*") if p.is_file()]
    free["now"] = 2 * local.MIN_FREE_BYTES
    assert s.put(f"{run}/0/fits", kv) > 0 and s.get(f"{run}/0/fits").ok
    free["now"] = 300 << 20  # a small disk: a tenth of it is kept free, small payloads still go in
    small = open_store(str(tmp_path / "small"))
    assert small.min_free_bytes == 30 << 20 and small.put(f"{run}/0/small", kv) > 0
    assert open_store(f"local://{tmp_path}/set?min_free=20G").min_free_bytes == 20 << 30
    with pytest.raises(ValueError, match="min_free"):
        open_store(f"local://{tmp_path}/bad?min_free=lots")


def test_a_full_kv_disk_makes_rows_recompute_not_fail(tmp_path):
    """A job whose embedded store has no room: every row still ends ok, recomputed, saying why."""
    from components.data.runs import RunLayout
    from components.data.sample import write_sample_edit_dataset
    from components.jobconfig import JobConfig
    from pipeline.local import run_job

    dataset = write_sample_edit_dataset(tmp_path / "edit.parquet", n=2)
    summary = run_job(JobConfig(dataset=str(dataset), output=str(tmp_path / "out"), run_id="full", num_shards=1,
                                model="tiny", device="cpu", steps=2, max_new_tokens=4, temperature=0.0,
                                kv_store=f"local://{tmp_path}/kv?min_free=1000000G"),  # no disk has that much free
                      progress=False)
    assert summary["rows_failed"] == 0 and summary["rows_ok"] == 2
    rows = RunLayout.open(str(tmp_path / "out"), "full").read_rows(0).to_pylist()
    assert [r["kv_path"] for r in rows] == ["recompute"] * 2
    assert all("keeps" in r["kv_reason"] and "GiB free" in r["kv_reason"] for r in rows), rows[0]["kv_reason"]


def test_a_rows_layer_parts_are_deleted_in_one_query_and_their_deletes(store, run):
    """An AR at PP stores one part per decoder layer; the DiT's per-row delete finds them with one
    batch existence query (Mooncake: batch_is_exist) and removes them, part objects too."""
    from components.kvparts import delete_heads, put_heads, slice_kv

    kv = make_kv(layers=4, heads=2)
    for stage in (range(0, 2), range(2, 4)):
        put_heads(store, f"{run}/0/row", slice_kv(kv, 0, 2, stage), 0, 2, layers=stage, total_layers=4)
    put_heads(store, f"{run}/0/other", kv, 0, 2)
    assert store.keys(f"{run}/0/row") == [f"{run}/0/row.l{j}" for j in range(4)]
    assert delete_heads(store, f"{run}/0/row", 2, total_layers=4) == 4
    assert ours(store, run) and all(k.startswith(f"{run}/0/other") for k in ours(store, run))  # spared


# ------------------------------------------------ the embedded stores of killed runs (never resumed)
def _age(directory: Path, seconds: float) -> None:
    """Every file under `directory` as if written `seconds` ago."""
    import time

    then = time.time() - seconds
    for p in directory.rglob("*"):
        if p.is_file():
            os.utime(p, (then, then))


@pytest.mark.slow
def test_a_killed_runs_embedded_kv_expires_at_the_next_job_under_the_same_output(tmp_path):
    """Run `dead` put its rows' K/V into <out>/dead/_kv and was killed before its DiT step; nothing
    ever opened that directory again. The next run's AR step under the same output root expires it
    once older than the TTL (a younger run's K/V stays)."""
    from components.ar.run import run as run_ar
    from components.data.sample import write_sample_generate_dataset
    from components.shard.run import run as run_shard

    dataset = write_sample_generate_dataset(str(tmp_path / "gen.parquet"), n=2, seed=3)
    out = str(tmp_path / "out")
    for run_id in ("dead", "young", "next"):
        run_shard(dataset, out, run_id, 1, "generate")
    for run_id in ("dead", "young"):
        run_ar(step_config(out, run_id, max_new_tokens=4), 0)
    dead, young = Path(out, "dead", "_kv"), Path(out, "young", "_kv")
    assert len(list(dead.rglob("*.kv"))) == 2 and len(list(young.rglob("*.kv"))) == 2
    _age(dead, 25 * 3600)  # the embedded store's TTL is 24 h
    _age(young, 23 * 3600)
    run_ar(step_config(out, "next", max_new_tokens=4), 0)
    assert not dead.exists()  # its payloads expired, and the emptied store directory went too
    assert len(list(young.rglob("*.kv"))) == 2
    assert len(list(Path(out, "next", "_kv").rglob("*.kv"))) == 2  # its own, for its DiT step


def test_store_gc_on_an_output_root_expires_every_runs_embedded_kv(tmp_path):
    """`ardit store gc OUTPUT` reaches the embedded stores of every run under it (<out>/<run>/_kv),
    and leaves the runs' other files alone."""
    from typer.testing import CliRunner

    from components.kvstore.cli import app
    from components.kvstore.local import LocalStore

    out = tmp_path / "out"
    for run_id in ("a", "b"):
        LocalStore(out / run_id / "_kv").put(f"{run_id}/0/r0", make_kv(torch.bfloat16))
        (out / run_id / "summary.json").write_text("{}")
    _age(out / "a", 25 * 3600)
    result = CliRunner().invoke(app, ["gc", f"local://{out}"])
    assert result.exit_code == 0 and "expired 1 payload(s)" in result.output, result.output
    assert not list((out / "a").rglob("*.kv")) and (out / "a" / "summary.json").exists()
    assert len(list((out / "b").rglob("*.kv"))) == 1
