"""Shard step: deterministic split, coverage, error rows carried, idempotent re-run, conflicts, S3."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from components.data.objectstore import open_object_store
from components.data.runs import RunLayout
from components.data.sample import write_sample_edit_dataset, write_sample_generate_dataset
from components.shard import ShardConflictError, run
from tests.fixtures_s3 import s3_env, s3_prefix, seaweedfs  # noqa: F401  (pytest fixtures)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _mixed_dataset(path) -> str:
    good = _png()
    rows = [{"id": f"r{i:02d}", "instruction": "make it red", "image": good} for i in range(11)]
    rows[3]["image"] = b"\x89PNG broken"
    rows[7]["instruction"] = ""
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _all_inputs(layout: RunLayout, n: int):
    return [layout.read_inputs(k) for k in range(n)]


def test_shards_cover_every_row_once_and_carry_errors(tmp_path) -> None:
    ds = _mixed_dataset(tmp_path / "ds.parquet")
    manifest = run(ds, str(tmp_path / "out"), "run1", 4, "edit")
    layout = RunLayout.open(str(tmp_path / "out"), "run1")
    shards = _all_inputs(layout, 4)
    ids = [j.id for s in shards for j in s]
    assert sorted(ids) == [f"r{i:02d}" for i in range(11)] and len(set(ids)) == 11
    assert [len(s) for s in shards] == [e["rows"] for e in manifest["shards"]] == [2, 3, 3, 3]
    errors = {j.id: j.error for s in shards for j in s if not j.ok}
    assert set(errors) == {"r03", "r07"}
    assert "image is not a decodable image" in errors["r03"]
    assert errors["r07"] == "instruction is missing or empty"
    assert (manifest["num_rows"], manifest["num_valid"], manifest["num_errors"]) == (11, 9, 2)
    assert manifest["kind"] == "edit" and manifest["num_shards"] == 4 and manifest["dataset"] == ds
    # the error column is in the shard file itself
    table = pq.read_table(tmp_path / "out" / "run1" / "inputs" / "1.parquet")
    assert "error" in table.column_names and table.column("error").null_count == 2


def test_sharding_is_deterministic_across_runs(tmp_path) -> None:
    ds = _mixed_dataset(tmp_path / "ds.parquet")
    run(ds, str(tmp_path / "a"), "x", 3, "edit")
    run(ds, str(tmp_path / "b"), "y", 3, "edit")
    for k in range(3):
        a = (tmp_path / "a" / "x" / "inputs" / f"{k}.parquet").read_bytes()
        b = (tmp_path / "b" / "y" / "inputs" / f"{k}.parquet").read_bytes()
        assert pq.read_table(io.BytesIO(a)).equals(pq.read_table(io.BytesIO(b)))


def test_rerun_is_a_noop_and_conflicts_are_errors(tmp_path) -> None:
    ds = _mixed_dataset(tmp_path / "ds.parquet")
    out = str(tmp_path / "out")
    first = run(ds, out, "run1", 2, "edit")
    shard_file = tmp_path / "out" / "run1" / "inputs" / "0.parquet"
    mtime = shard_file.stat().st_mtime_ns
    assert run(ds, out, "run1", 2, "edit") == first  # same manifest, nothing rewritten
    assert shard_file.stat().st_mtime_ns == mtime

    with pytest.raises(ShardConflictError, match="num_shards: existing 2 vs requested 3"):
        run(ds, out, "run1", 3, "edit")
    other = write_sample_edit_dataset(str(tmp_path / "other.parquet"), n=3, size=32)
    with pytest.raises(ShardConflictError, match="dataset"):
        run(other, out, "run1", 2, "edit")
    # the same path with changed contents is a different dataset too
    _mixed_dataset(tmp_path / "ds.parquet")  # identical rewrite: still the same bytes
    assert run(ds, out, "run1", 2, "edit") == first
    pq.write_table(pa.Table.from_pylist([{"id": "new", "instruction": "x", "image": _png()}]), tmp_path / "ds.parquet")
    with pytest.raises(ShardConflictError, match="dataset_fingerprint"):
        run(ds, out, "run1", 2, "edit")


def test_interrupted_shard_step_is_redone(tmp_path) -> None:
    """Shard files without a manifest (killed before the end) are simply rewritten."""
    ds = write_sample_generate_dataset(str(tmp_path / "g.parquet"), n=5)
    out = tmp_path / "out"
    (out / "run1" / "inputs").mkdir(parents=True)
    (out / "run1" / "inputs" / "0.parquet").write_bytes(b"half-written garbage from a dead attempt")
    manifest = run(ds, str(out), "run1", 2, "generate")
    layout = RunLayout.open(str(out), "run1")
    assert [len(layout.read_inputs(k)) for k in range(2)] == [2, 3] and manifest["num_valid"] == 5


def test_more_shards_than_rows_gives_empty_shards(tmp_path) -> None:
    ds = write_sample_generate_dataset(str(tmp_path / "g.parquet"), n=2)
    manifest = run(ds, str(tmp_path / "out"), "r", 4, "generate")
    assert [e["rows"] for e in manifest["shards"]] == [0, 1, 0, 1]
    assert RunLayout.open(str(tmp_path / "out"), "r").read_inputs(0) == []


def test_large_dataset_streams_over_many_files_and_row_groups(tmp_path) -> None:
    """1300 rows in 3 files with small row groups: shards are contiguous and complete."""
    d = tmp_path / "big"
    d.mkdir()
    counter = 0
    for f, n in enumerate((500, 300, 500)):
        rows = [{"id": f"g{counter + i:05d}", "prompt": f"prompt {counter + i}"} for i in range(n)]
        counter += n
        pq.write_table(pa.Table.from_pylist(rows), d / f"part-{f}.parquet", row_group_size=128)
    manifest = run(str(d), str(tmp_path / "out"), "big", 3, "generate")
    layout = RunLayout.open(str(tmp_path / "out"), "big")
    shards = _all_inputs(layout, 3)
    assert [len(s) for s in shards] == [433, 433, 434]
    assert [j.id for s in shards for j in s] == [f"g{i:05d}" for i in range(1300)]
    assert [(e["first_row"], e["last_row"]) for e in manifest["shards"]] == [(0, 432), (433, 865), (866, 1299)]
    assert pq.ParquetFile(tmp_path / "out/big/inputs/2.parquet").metadata.num_row_groups > 1


def test_cli(tmp_path) -> None:
    ds = _mixed_dataset(tmp_path / "ds.parquet")
    cmd = [sys.executable, "-m", "components.shard", "--dataset", ds, "--output", str(tmp_path / "out"),
           "--run-id", "cli", "--num-shards", "2", "--kind", "edit"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    brief = json.loads(out.stdout)
    assert (brief["num_rows"], brief["num_errors"]) == (11, 2)
    assert json.loads((tmp_path / "out" / "cli" / "inputs" / "manifest.json").read_text())["num_shards"] == 2
    bad = subprocess.run([c if c != "cli" else "cli2" for c in cmd[:-1]] + ["generate"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "no 'prompt' column" in bad.stderr
    missing = subprocess.run([str(tmp_path / "nope.parquet") if c == ds else c for c in cmd],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.parquet" in missing.stderr


@pytest.mark.servers
def test_s3_dataset_and_output(s3_prefix, tmp_path) -> None:
    """Dataset on S3 (images by s3:// URI and by relative key), shards written to S3."""
    store = open_object_store(s3_prefix)
    store.put_bytes("data/images/a.png", _png())
    rows = [
        {"id": "abs", "instruction": "i", "image_uri": f"{s3_prefix}/data/images/a.png"},
        {"id": "rel", "instruction": "i", "image_uri": "images/a.png"},
        {"id": "gone", "instruction": "i", "image_uri": f"{s3_prefix}/data/images/missing.png"},
    ]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    store.put_bytes("data/part-0.parquet", buf.getvalue())

    manifest = run(f"{s3_prefix}/data", f"{s3_prefix}/out", "s3run", 2, "edit")
    assert (manifest["num_valid"], manifest["num_errors"]) == (2, 1)
    layout = RunLayout.open(f"{s3_prefix}/out", "s3run")
    jobs = [j for k in range(2) for j in layout.read_inputs(k)]
    assert {j.id: j.ok for j in jobs} == {"abs": True, "rel": True, "gone": False}
    assert next(j for j in jobs if j.id == "rel").image == _png()
    assert "does not exist" in next(j for j in jobs if j.id == "gone").error
    assert store.exists("out/s3run/inputs/manifest.json")
    assert run(f"{s3_prefix}/data", f"{s3_prefix}/out", "s3run", 2, "edit") == manifest
