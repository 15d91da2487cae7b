"""KV transfer hidden behind compute (issue 12 item 5), with the tiny model on CPU.

- the DiT step prefetches row k+1's KV while row k denoises: every row still gets its own KV
  (checked against the payloads the AR step stored, which differ from row to row), even when the
  store is slow enough that the prefetch really overlaps;
- a prefetch that fails, and a store that is gone, make that row recompute with the reason;
  the shard commits;
- the AR step's background puts: every ok row ends with its key and size, and a failing AR step
  deletes what it already put.
"""

from __future__ import annotations

import threading
import time

import pyarrow.parquet as pq
import pytest

from components.kvstore.local import LocalStore

from .step_config import step_config

STEPS = 1
TOKENS = 2


class RecordingStore(LocalStore):
    """A real local store that records (thread, key) of every get, can be slowed down and can
    fail the get of chosen keys."""

    def __init__(self, root, delay_s: float = 0.0, fail: set[str] | None = None):
        super().__init__(root)
        self.delay_s, self.fail = delay_s, fail or set()
        self.gets: list[tuple[str, str]] = []

    def get(self, key, expect_model_id=None, expect_config_hash=None, device=None):
        self.gets.append((threading.current_thread().name, key))
        time.sleep(self.delay_s)
        if key in self.fail:
            raise RuntimeError(f"injected failure reading {key}")
        return super().get(key, expect_model_id, expect_config_hash, device)


@pytest.fixture(scope="module")
def ar_once(tmp_path_factory):
    """A 4-row generate run, sharded, with its AR step done through the local KV store."""
    from components.ar.run import run as run_ar
    from components.data.sample import write_sample_generate_dataset
    from components.shard.run import run as run_shard

    base = tmp_path_factory.mktemp("ar")
    dataset = write_sample_generate_dataset(str(base / "gen.parquet"), n=4, seed=2)
    output, run_id = str(base / "out"), "ov"
    run_shard(dataset, output, run_id, 1, "generate")
    result = run_ar(step_config(output, run_id, max_new_tokens=TOKENS, batch_size=2), 0)
    assert result["errors"] == 0
    return output, run_id


@pytest.fixture
def ar_done(ar_once, tmp_path):
    """A fresh copy of that run (KV payloads included) for one test's DiT step to consume."""
    import shutil

    output, run_id = ar_once
    shutil.copytree(output, tmp_path / "out")
    return str(tmp_path / "out"), run_id


def _payloads(output: str, run_id: str) -> dict[str, list[int]]:
    """{row id: token ids of its stored KV} straight from the store, before the DiT consumes them."""
    from components.data.ar_outputs import read_ar_rows
    from components.data.runs import RunLayout
    from components.kvstore import open_store
    from components.run_kv import default_kv_store

    store = open_store(default_kv_store(output, run_id))
    rows = read_ar_rows(RunLayout.open(output, run_id), 0)
    return {rid: store.get(r["kv_key"]).kv.token_ids for rid, r in rows.items()}


def _run_dit(monkeypatch, output, run_id, store, **kw):
    """The DiT step with `store` as its KV store, recording the KV each row's request carried."""
    import components.dit.run as dit
    from components.models import load_engine

    monkeypatch.setattr(dit, "open_kv_store", lambda url: store)
    engine = load_engine("tiny", None, "cpu", None, 0)
    seen: dict[str, list[int] | None] = {}
    real = type(engine.dit).__call__

    def recording(self, request):
        seen[request.ar.id] = None if request.prompt_kv is None else list(request.prompt_kv.token_ids)
        return real(self, request)

    monkeypatch.setattr(type(engine.dit), "__call__", recording)
    result = dit.run(step_config(output, run_id, steps=STEPS), 0, **kw)
    return result, seen


def test_ar_puts_in_the_background_and_records_each_row(ar_done):
    from components.data.ar_outputs import read_ar_rows
    from components.data.runs import RunLayout

    output, run_id = ar_done
    rows = read_ar_rows(RunLayout.open(output, run_id), 0)
    assert len(rows) == 4
    for rid, r in rows.items():
        assert r["status"] == "ok" and r["kv_error"] is None and r["kv_bytes"] > 0 and r["kv_put_s"] >= 0
        assert r["kv_key"] == f"{run_id}/0/{rid}"


@pytest.mark.parametrize("delay_s", [0.3])  # slower than nothing: the prefetch really overlaps
def test_prefetch_gives_each_row_its_own_kv(ar_done, monkeypatch, tmp_path, delay_s):
    from components.run_kv import default_kv_store

    output, run_id = ar_done
    expected = _payloads(output, run_id)
    assert len({tuple(v) for v in expected.values()}) == 4  # the rows' KVs differ: a swap would show
    store = RecordingStore(default_kv_store(output, run_id).removeprefix("local://"), delay_s=delay_s)
    result, seen = _run_dit(monkeypatch, output, run_id, store)
    assert seen == expected
    assert [k for _, k in store.gets] == [f"{run_id}/0/{rid}" for rid in expected]  # in order, once each
    assert all(name.startswith("kv-io") for name, _ in store.gets)  # fetched off the denoising thread
    assert result["rows"] == 4 and result["ok"] == 4
    table = pq.read_table(f"{output}/{run_id}/shards/0/rows.parquet").to_pylist()
    assert [r["kv_path"] for r in table] == ["reuse"] * 4
    assert all(r["kv_wait_s"] is not None and r["kv_wait_s"] >= 0 for r in table)
    assert result["kv_wait_s"] == pytest.approx(sum(r["kv_wait_s"] for r in table), abs=1e-3)
    assert store.keys() == []  # consumed payloads deleted


def test_failed_prefetch_is_a_recompute_with_the_reason(ar_done, monkeypatch):
    from components.run_kv import default_kv_store, kv_key

    output, run_id = ar_done
    ids = list(_payloads(output, run_id))
    bad = kv_key(run_id, 0, ids[1])
    store = RecordingStore(default_kv_store(output, run_id).removeprefix("local://"), fail={bad})
    _, seen = _run_dit(monkeypatch, output, run_id, store)
    assert seen[ids[1]] is None and all(seen[i] is not None for i in ids if i != ids[1])
    table = {r["id"]: r for r in pq.read_table(f"{output}/{run_id}/shards/0/rows.parquet").to_pylist()}
    assert all(r["status"] == "ok" for r in table.values())
    assert table[ids[1]]["kv_path"] == "recompute"
    assert "KV prefetch failed: RuntimeError: injected failure" in table[ids[1]]["kv_reason"]
    assert [table[i]["kv_path"] for i in ids if i != ids[1]] == ["reuse"] * 3


def test_unreachable_store_means_recompute_not_a_crash(ar_done, monkeypatch):
    """issue 13: with nothing listening at the KV store, the DiT step used to crash in
    store.delete after one row. Now every row recomputes with the reason and the shard commits."""
    pytest.importorskip("mooncake.store")
    from components.kvstore import open_store

    output, run_id = ar_done
    store = open_store("mooncake://127.0.0.1:1?connect_timeout=0.5")
    result, seen = _run_dit(monkeypatch, output, run_id, store)
    assert result["sha256"] and all(v is None for v in seen.values())
    table = pq.read_table(f"{output}/{run_id}/shards/0/rows.parquet").to_pylist()
    assert [r["kv_path"] for r in table] == ["recompute"] * 4
    assert all("unreachable" in r["kv_reason"] for r in table), [r["kv_reason"] for r in table]
    assert result["kv_deletes_failed"] >= 4  # deletes were tried, failed quietly, and did not sink the rows


def test_failing_ar_step_deletes_what_it_put(tmp_path, monkeypatch):
    from components.ar import run as ar_run
    from components.data.sample import write_sample_generate_dataset
    from components.engine.ar import ARGenerator
    from components.kvstore import open_store
    from components.shard.run import run as run_shard
    from components.run_kv import default_kv_store

    dataset = write_sample_generate_dataset(str(tmp_path / "gen.parquet"), n=3, seed=4)
    output, run_id = str(tmp_path / "out"), "fail"
    run_shard(dataset, output, run_id, 1, "generate")
    real_finish, real_put = ARGenerator.finish_row, ar_run._BackgroundPuts._put
    finished, put = [], []

    def second_row_dies(self, row, b, cache):
        finished.append(row.request.id)
        if len(finished) == 2:
            raise KeyboardInterrupt  # as Ctrl-C (or a kill signal turned into an exception) would
        return real_finish(self, row, b, cache)

    def recorded_put(self, key, kv):
        put.append(key)
        return real_put(self, key, kv)

    monkeypatch.setattr(ARGenerator, "finish_row", second_row_dies)
    monkeypatch.setattr(ar_run._BackgroundPuts, "_put", recorded_put)
    store = open_store(default_kv_store(output, run_id))
    with pytest.raises(KeyboardInterrupt, match="^$"):  # as Ctrl-C: no message
        ar_run.run(step_config(output, run_id, max_new_tokens=TOKENS, batch_size=2), 0)
    assert len(finished) == 2 and len(put) == 1  # the first row was put, then the step died
    assert store.keys() == []  # ... and deleted what it had put on its way out
    assert not (tmp_path / "out" / run_id / "shards" / "0" / "ar.parquet").exists()


class EventStore(RecordingStore):
    """A RecordingStore that logs ("get", row id) when each get starts, into a shared event list."""

    def __init__(self, root, events: list, started: dict[str, threading.Event]):
        super().__init__(root)
        self.events, self.started = events, started

    def get(self, key, expect_model_id=None, expect_config_hash=None, device=None):
        rid = key.rsplit("/", 1)[-1]
        self.events.append(("get", rid))
        self.started.setdefault(rid, threading.Event()).set()
        return super().get(key, expect_model_id, expect_config_hash, device)


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_overlap_by_the_order_of_events(ar_done, monkeypatch, prefetch):
    """Row k+1's KV get starts before row k's denoising ends: checked by the order of events, not by
    time. Each denoise waits (bounded) for the next row's get to start before it ends, so with the
    prefetch the order is certain, and without it (the control) the get can only come later."""
    import components.dit.run as dit
    from components.models import load_engine
    from components.run_kv import default_kv_store

    output, run_id = ar_done
    ids = list(_payloads(output, run_id))
    events: list[tuple[str, str]] = []
    started: dict[str, threading.Event] = {}
    store = EventStore(default_kv_store(output, run_id).removeprefix("local://"), events, started)
    monkeypatch.setattr(dit, "open_kv_store", lambda url: store)
    engine = load_engine("tiny", None, "cpu", None, 0)
    real = type(engine.dit).__call__

    def denoise(self, request):
        rid = request.ar.id
        events.append(("denoise-start", rid))
        out = real(self, request)
        following = ids.index(rid) + 1
        if following < len(ids):  # bounded: without the prefetch that get only starts after this returns
            started.setdefault(ids[following], threading.Event()).wait(timeout=5 if prefetch else 0.5)
        events.append(("denoise-end", rid))
        return out

    monkeypatch.setattr(type(engine.dit), "__call__", denoise)
    result = dit.run(step_config(output, run_id, steps=STEPS), 0, prefetch=prefetch)
    assert result["ok"] == 4
    overlapped = [events.index(("get", ids[k + 1])) < events.index(("denoise-end", ids[k]))
                  for k in range(len(ids) - 1)]
    assert overlapped == [prefetch] * 3, events
    assert [e for e in events if e[0] == "get"] == [("get", i) for i in ids]  # each row's own KV, once, in order


def test_a_job_with_no_kv_reuse_recomputes_every_row(tmp_path):
    """`ardit generate --no-kv-reuse` (run_job kv_reuse=False), a real job: the AR stores no K/V and
    every row's DiT recomputes the prefix because reuse is off, not for any other reason."""
    import json

    from components.data.sample import write_sample_generate_dataset
    from components.jobconfig import JobConfig
    from pipeline.local import run_job

    dataset = write_sample_generate_dataset(str(tmp_path / "gen.parquet"), n=3, seed=5)
    output = tmp_path / "out"
    summary = run_job(JobConfig(dataset=dataset, output=str(output), run_id="nr", kind="generate", num_shards=1,
                                steps=STEPS, max_new_tokens=TOKENS, kv_reuse=False, device="cpu"), progress=False)
    assert summary["rows_ok"] == 3
    rows = pq.read_table(output / "nr" / "shards" / "0" / "rows.parquet").to_pylist()
    assert [(r["kv_path"], r["kv_reason"]) for r in rows] == [("recompute", "reuse disabled")] * 3
    ar = pq.read_table(output / "nr" / "shards" / "0" / "ar.parquet").to_pylist()
    assert [r["kv_key"] for r in ar] == [None] * 3  # nothing was put
    assert json.loads((output / "nr" / "summary.json").read_text())["kv_paths"] == {"recompute": 3}


class SlowDeletes(LocalStore):
    """A real local store whose deletes take `delay_s` each."""

    def __init__(self, root, delay_s: float):
        super().__init__(root)
        self.delay_s = delay_s

    def delete_prefix(self, prefix):
        time.sleep(self.delay_s)
        return super().delete_prefix(prefix)


def test_a_long_close_after_the_last_row_is_said_by_part(ar_done, monkeypatch, capfd):
    """The seconds a DiT step spends after its last row (commit, KV deletes, compile cache) are
    outside its step record; when they are long the log says which part took them."""
    import components.dit.run as dit
    from components.run_kv import default_kv_store

    output, run_id = ar_done
    monkeypatch.setattr(dit, "TAIL_SAID_S", 0.4)
    store = SlowDeletes(default_kv_store(output, run_id).removeprefix("local://"), delay_s=0.5)
    result, _ = _run_dit(monkeypatch, output, run_id, store)
    assert result["ok"] == 4
    (line,) = [ln for ln in capfd.readouterr().err.splitlines() if "after its last row" in ln]
    parts = dict(p.rsplit(" ", 2)[:2] for p in line.split("(", 1)[1].rstrip(")").split(", "))
    assert list(parts) == ["commit", "KV deletes and store close", "compile cache"]
    assert float(parts["KV deletes and store close"]) >= 0.5
    assert line.startswith("DiT shard 0: ")


class RecordingDeletes(LocalStore):
    """A real local store that records its deletes and what its prefix deletes still found."""

    def __init__(self, root):
        super().__init__(root)
        self.deleted: list[str] = []
        self.left_for_prefix: list[int] = []

    def delete(self, key):
        removed = super().delete(key)
        if removed:
            self.deleted.append(key)
        return removed

    def delete_prefix(self, prefix):
        n = super().delete_prefix(prefix)
        self.left_for_prefix.append(n)
        return n


def test_each_row_s_kv_parts_are_deleted_behind_the_loop(ar_done, monkeypatch):
    """An AR at PP stores a part per decoder layer. The DiT deletes a row's parts once the row is
    done, while the next rows denoise; the shard's prefix delete at commit finds nothing left (on
    2 x H100 it deleted 1 024 parts after the last row: 7 s a shard)."""
    from components.data.ar_outputs import read_ar_rows
    from components.data.runs import RunLayout
    from components.kvparts import layer_key, put_heads, slice_kv
    from components.run_kv import default_kv_store

    output, run_id = ar_done
    store = RecordingDeletes(default_kv_store(output, run_id).removeprefix("local://"))
    parts = {}
    for rid, row in read_ar_rows(RunLayout.open(output, run_id), 0).items():  # as two pipeline stages wrote it
        kv = store.get(row["kv_key"]).kv
        heads, layers = kv.keys[0].shape[1], kv.num_layers
        store.delete(row["kv_key"])
        for stage in (range(0, layers // 2), range(layers // 2, layers)):
            put_heads(store, row["kv_key"], slice_kv(kv, 0, heads, stage), 0, heads, layers=stage,
                      total_layers=layers)
        parts[rid] = [layer_key(row["kv_key"], j) for j in range(layers)]
    store.deleted.clear()

    result, seen = _run_dit(monkeypatch, output, run_id, store)
    assert result["ok"] == 4 and all(v is not None for v in seen.values())  # every row reused its parts
    assert sorted(store.deleted) == sorted(k for keys in parts.values() for k in keys)
    assert store.left_for_prefix == [0] and store.keys() == []
