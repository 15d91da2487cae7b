"""Run layout and commit protocol: marker last, kill before commit, row-level resume, summary."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import textwrap
from datetime import datetime

import pyarrow.parquet as pq
import pytest
from PIL import Image

from components.data.objectstore import LocalObjectStore, ObjectStore
from components.data.runs import (
    ROWS_SCHEMA,
    CoverageError,
    RunLayout,
    ShardNotReadyError,
    check_coverage,
    row_key,
)
from components.data.sample import write_sample_edit_dataset
from components.shard import run as shard_run
from components.summary import run as summary_run
from tests.fixtures_s3 import s3_env, s3_prefix, seaweedfs  # noqa: F401  (pytest fixtures)


class RecordingStore(LocalObjectStore):
    """A local store that logs the order of writes, and can fail a chosen write."""

    def __init__(self, root, fail_on: str | None = None):
        super().__init__(root)
        self.puts: list[str] = []
        self.fail_on = fail_on

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.fail_on and key.endswith(self.fail_on):
            raise OSError(f"injected failure writing {key}")
        self.puts.append(key)
        super().put_bytes(key, data)


def _sharded(tmp_path, n=6, shards=2, run_id="run1", output=None) -> RunLayout:
    ds = write_sample_edit_dataset(str(tmp_path / "ds.parquet"), n=n, size=32)
    output = output or str(tmp_path / "out")
    shard_run(ds, output, run_id, shards, "edit")
    return RunLayout.open(output, run_id)


def _image(job) -> Image.Image:
    return job.pil_images()[0].transpose(Image.Transpose.FLIP_LEFT_RIGHT)  # "the edit"


def _finish(writer, **metrics) -> None:
    for job in writer.pending():
        writer.record_ok(job.id, _image(job), cot_text=f"cot {job.id}", kv_path="reuse", kv_reason="hit", **metrics)


def test_marker_is_written_last_and_matches_rows(tmp_path) -> None:
    _sharded(tmp_path)
    store = RecordingStore(tmp_path / "out")
    layout = RunLayout(store, "run1")
    writer = layout.shard_writer(0)
    _finish(writer, dit_total_s=2.0)
    marker = writer.commit()
    assert store.puts[-1] == "run1/shards/0/_COMMITTED"
    assert store.puts[-2] == "run1/shards/0/rows.parquet"
    # each row's image is written before its record
    for job in writer.jobs:
        assert store.puts.index(layout.image_key(0, job.id)) < store.puts.index(layout.row_record_key(0, job.id))
    data = store.get_bytes("run1/shards/0/rows.parquet")
    assert marker["sha256"] == hashlib.sha256(data).hexdigest() and marker["rows"] == 3 and marker["ok"] == 3
    assert layout.is_committed(0) and not layout.is_committed(1)
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.names[: len(ROWS_SCHEMA)] == ROWS_SCHEMA.names
    assert table.column("status").to_pylist() == ["ok"] * 3
    # committing again is a no-op
    n_puts = len(store.puts)
    assert writer.commit() == marker and len(store.puts) == n_puts


def test_failed_marker_write_leaves_shard_uncommitted_then_recovers(tmp_path) -> None:
    _sharded(tmp_path)
    layout = RunLayout(RecordingStore(tmp_path / "out", fail_on="_COMMITTED"), "run1")
    writer = layout.shard_writer(0)
    _finish(writer)
    with pytest.raises(OSError, match="injected"):
        writer.commit()
    assert (tmp_path / "out/run1/shards/0/rows.parquet").exists()
    assert not layout.is_committed(0)  # rows.parquet alone does not count
    layout = RunLayout(LocalObjectStore(tmp_path / "out"), "run1")
    assert layout.shard_writer(0).pending() == []  # every row is already done
    layout.shard_writer(0).commit()
    assert layout.is_committed(0)


def test_tampered_rows_file_is_not_committed(tmp_path) -> None:
    layout = _sharded(tmp_path)
    writer = layout.shard_writer(1)
    _finish(writer)
    writer.commit()
    path = tmp_path / "out/run1/shards/1/rows.parquet"
    path.write_bytes(path.read_bytes()[:-10])
    assert not layout.is_committed(1) and layout.is_committed(1, verify=False)
    s = summary_run(str(tmp_path / "out"), "run1")
    assert s["shards"][1]["status"] == "corrupt" and s["shards_uncommitted"] == [1] and s["shards_missing"] == [0]


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from components.data.runs import RunLayout
    layout = RunLayout.open(sys.argv[1], "run1")
    w = layout.shard_writer(0)
    jobs = w.pending()
    for job in jobs[:2]:
        w.record_ok(job.id, job.pil_images()[0], cot_text="first attempt", kv_path="reuse")
    # third row: the PNG is being written when the process dies (half the bytes out)
    store = layout.store
    def half_then_die(f):
        f.write(b"\\x89PNG half")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    store._atomic_write(layout.image_key(0, jobs[2].id), half_then_die)
    """
)


def test_killed_step_leaves_nothing_committed_and_resume_skips_done_rows(tmp_path) -> None:
    layout = _sharded(tmp_path, n=8, shards=2)
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "out")], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()

    assert not layout.is_committed(0)
    assert layout.commit_marker(0) is None and not layout.store.exists(layout.rows_key(0))
    jobs = layout.read_inputs(0)
    assert layout.completed_rows(0) == {jobs[0].id, jobs[1].id}
    # the half-written PNG is invisible: not listed, not "existing"
    assert not layout.store.exists(layout.image_key(0, jobs[2].id))
    assert layout.store.list(layout.shard_prefix(0) + "images/") == [layout.image_key(0, j.id) for j in jobs[:2]]

    writer = layout.shard_writer(0)  # the re-run
    assert [j.id for j in writer.pending()] == [j.id for j in jobs[2:]]
    with pytest.raises(ShardNotReadyError, match="2 row\\(s\\) have no result yet"):
        writer.commit()
    _finish(writer)
    writer.commit()
    rows = layout.read_rows(0).to_pylist()
    assert [r["id"] for r in rows] == [j.id for j in jobs]
    assert [r["cot_text"] for r in rows] == ["first attempt"] * 2 + [f"cot {j.id}" for j in jobs[2:]]
    for r in rows:  # every committed row has its real image
        img = Image.open(io.BytesIO(layout.store.get_bytes(r["image_key"])))
        assert img.size == (r["width"], r["height"]) == (32, 32)


def test_error_rows_from_validation_and_processing(tmp_path) -> None:
    import pyarrow as pa

    good = write_sample_edit_dataset(str(tmp_path / "tmp.parquet"), n=3, size=32)
    rows = pq.read_table(good).to_pylist()
    rows[1]["image"] = b"garbage"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ds.parquet")
    shard_run(str(tmp_path / "ds.parquet"), str(tmp_path / "out"), "r", 1, "edit")
    layout = RunLayout.open(str(tmp_path / "out"), "r")
    writer = layout.shard_writer(0)
    assert [j.id for j in writer.pending()] == ["edit-0000", "edit-0002"]
    writer.record_ok("edit-0000", _image(writer.pending()[0]))
    writer.record_error("edit-0002", "DiT produced NaNs", dit_total_s=0.5)
    with pytest.raises(KeyError, match="edit-0001"):  # a rejected row cannot be recorded
        writer.record_ok("edit-0001", b"")
    marker = writer.commit()
    assert (marker["ok"], marker["failed"]) == (1, 2)
    out = {r["id"]: r for r in layout.read_rows(0).to_pylist()}
    assert out["edit-0001"]["status"] == "error" and "image is not a decodable image" in out["edit-0001"]["error"]
    assert out["edit-0002"]["error"] == "DiT produced NaNs" and out["edit-0002"]["dit_total_s"] == 0.5
    assert out["edit-0000"]["status"] == "ok" and out["edit-0000"]["image_key"].endswith("images/edit-0000.png")
    assert layout.verify() == []


def test_extra_metric_columns_are_kept(tmp_path) -> None:
    import numpy as np

    layout = _sharded(tmp_path, n=2, shards=1)
    writer = layout.shard_writer(0)
    with pytest.raises(TypeError, match="set cannot be stored"):
        writer.record_ok(writer.pending()[0].id, _image(writer.pending()[0]), bad={1, 2})
    _finish(writer, cache_hits=3, psnr_db=31.5, dit_total_s=np.float32(0.5), kv_bytes=np.int64(7))
    writer.commit()
    table = layout.read_rows(0)
    assert table.column("cache_hits").to_pylist() == [3, 3] and table.column("psnr_db").to_pylist() == [31.5, 31.5]
    assert table.column("dit_total_s").to_pylist() == [0.5, 0.5] and table.column("kv_bytes").to_pylist() == [7, 7]


def test_check_coverage() -> None:
    from components.data.datasets import Job

    jobs = [Job(id=f"r{i}", row_index=i, kind="generate", text="p") for i in range(3)]
    check_coverage(jobs, [{"id": f"r{i}", "row_index": i} for i in (2, 0, 1)])
    with pytest.raises(CoverageError, match="row 1 \\('r1'\\) has no output row"):
        check_coverage(jobs, [{"id": "r0", "row_index": 0}, {"id": "r2", "row_index": 2}])
    with pytest.raises(CoverageError, match="has 2 output rows"):
        check_coverage(jobs, [{"id": f"r{i}", "row_index": i} for i in (0, 1, 2, 2)])
    with pytest.raises(CoverageError, match="not an input row"):
        check_coverage(jobs, [{"id": f"r{i}", "row_index": i} for i in range(4)])


def test_row_keys_are_safe_and_distinct() -> None:
    assert row_key("edit-0001") == "edit-0001"
    odd = ["a/b", "a b", "../x", "a_b", "ü", "", "x.tmp", "a" * 300]
    keys = [row_key(i) for i in odd]
    assert len(set(keys)) == len(odd)
    assert all("/" not in k and k and not k.startswith(".") and len(k) <= 128 for k in keys)


def _summary_run(tmp_path, output: str | None = None) -> tuple[RunLayout, dict]:
    """Shard 0 committed with known metrics, shard 1 interrupted, shard 2 never started."""
    layout = _sharded(tmp_path, n=7, shards=3, output=output)
    w = layout.shard_writer(0)
    a, b = w.pending()
    w.record_ok(a.id, _image(a), kv_path="reuse", kv_reason="hit", ar_prefill_s=1.0, ar_decode_s=3.0,
                kv_put_s=0.25, kv_get_s=0.25, dit_total_s=4.0, vae_decode_s=0.5, prompt_tokens=100,
                generated_tokens=40)
    w.record_ok(b.id, _image(b), kv_path="recompute", kv_reason="kv store miss", ar_prefill_s=1.0,
                ar_decode_s=1.0, kv_put_s=0.5, dit_total_s=6.0, prompt_tokens=300, generated_tokens=60)
    w.commit()
    w1 = layout.shard_writer(1)
    j = w1.pending()[0]
    w1.record_ok(j.id, _image(j))
    return layout, summary_run(output or str(tmp_path / "out"), "run1")


def test_summary_counts_what_ran_at_the_edge_of_gpu_memory(tmp_path, capsys) -> None:
    from pipeline.cli import _print_summary

    layout, s = _summary_run(tmp_path)
    assert s["ar_oom_retries"] == s["gpu_alloc_retries"] == 0 and s["shards"][0]["steps"] == {}
    layout.write_json(layout.step_timing_key(0, "ar"), {
        "load_s": 1.0, "wall_s": 9.0, "scheduler": {"mean_batch": 3.5, "oom_retries": 2, "events": ["OOM"]},
        "memory": {"peak_reserved_gib": 79.5, "alloc_retries": 3, "ooms": 2}})
    layout.write_json(layout.step_timing_key(0, "dit"), {"load_s": 0.0, "wall_s": 5.0,
                                                         "memory": {"alloc_retries": 40}})
    s = summary_run(str(tmp_path / "out"), "run1")
    assert s["shards"][0]["steps"]["ar"] == {"wall_s": 9.0, "scheduler": {"mean_batch": 3.5, "oom_retries": 2,
                                                                          "events": ["OOM"]},
                                             "memory": {"peak_reserved_gib": 79.5, "alloc_retries": 3, "ooms": 2}}
    assert (s["ar_oom_retries"], s["gpu_alloc_retries"]) == (2, 43)
    _print_summary(s, str(tmp_path / "out"), "run1")
    out = capsys.readouterr().out
    assert "after 2 OOM(s)" in out and "--gpu-memory-utilization" in out and "retried 43 times" in out
    _print_summary({**s, "ar_oom_retries": 0, "gpu_alloc_retries": 1}, str(tmp_path / "out"), "run1")
    assert "GPU memory" not in capsys.readouterr().out  # one retry is not worth a word


def test_summary_from_real_rows(tmp_path) -> None:
    layout, s = _summary_run(tmp_path)
    assert json.loads((tmp_path / "out/run1/summary.json").read_text()) == s
    assert (s["rows_total"], s["rows_ok"], s["rows_failed"], s["rows_pending"]) == (7, 2, 0, 5)
    assert not s["complete"]
    assert s["shards_committed"] == [0] and s["shards_uncommitted"] == [1] and s["shards_missing"] == [2]
    assert [x["status"] for x in s["shards"]] == ["committed", "uncommitted", "missing"]
    # no step recorded an engine load; the rows' 17.5 s exceed the synthetic wall time: no "other"
    assert s["time_split_s"] == {"load": 0.0, "ar": 6.0, "kv": 1.0, "dit": 10.5, "other": None}
    assert s["time_split_fraction"]["dit"] == pytest.approx(10.5 / 17.5)
    assert s["kv_paths"] == {"reuse": 1, "recompute": 1}
    assert s["means_ok_rows"]["prompt_tokens"] == 200 and s["means_ok_rows"]["kv_get_s"] == 0.25
    # throughput from the manifest's creation to the commit recorded in the marker
    created = datetime.fromisoformat(layout.manifest()["created"])
    committed = datetime.fromisoformat(layout.commit_marker(0)["committed_at"])
    wall = (committed - created).total_seconds()
    assert s["wall_s"] == pytest.approx(wall, rel=1e-3)  # floats are rounded to 4 significant digits
    assert s["images_per_minute"] == pytest.approx(2 / wall * 60, rel=1e-3)
    assert len(repr(s["images_per_minute"])) <= 7


def test_summary_counts_failures_and_completes(tmp_path) -> None:
    layout, _ = _summary_run(tmp_path)
    for k in (1, 2):
        w = layout.shard_writer(k)
        for job in w.pending():
            w.record_error(job.id, "out of memory")
        w.commit()
    s = summary_run(str(tmp_path / "out"), "run1")
    assert s["complete"] and s["rows_pending"] == 0
    assert (s["rows_ok"], s["rows_failed"]) == (3, 4)  # the row done before the interruption stays ok
    assert {e["error"] for e in s["errors"]} == {"out of memory"} and len(s["errors"]) == 4
    assert layout.verify() == []
    # a later attempt may retry rows recorded as errors (shard 2: 3 rows, all errors)
    w = layout.shard_writer(2)
    assert w.pending() == [] and len(w.pending(retry_errors=True)) == 3


def test_summary_cli(tmp_path) -> None:
    _summary_run(tmp_path)
    cmd = [sys.executable, "-m", "components.summary", "--output", str(tmp_path / "out"), "--run-id", "run1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["rows_ok"] == 2
    strict = subprocess.run(cmd + ["--require-complete"], capture_output=True, text=True)
    assert strict.returncode == 3
    missing = subprocess.run(cmd[:-1] + ["nope"], capture_output=True, text=True)
    assert missing.returncode == 2 and "has no manifest" in missing.stderr


@pytest.mark.servers
def test_commit_resume_and_summary_on_s3(tmp_path, s3_prefix) -> None:
    layout, s = _summary_run(tmp_path, output=f"{s3_prefix}/out")
    assert isinstance(layout.store, ObjectStore) and layout.store.url().startswith("s3://")
    assert layout.is_committed(0) and not layout.is_committed(1)
    assert len(layout.completed_rows(1)) == 1
    assert (s["rows_ok"], s["rows_pending"], s["shards_uncommitted"], s["shards_missing"]) == (2, 5, [1], [2])
    w = layout.shard_writer(1)
    assert len(w.pending()) == 1
    _finish(w)
    w.commit()
    assert layout.is_committed(1)
    assert layout.store.exists("run1/summary.json")
