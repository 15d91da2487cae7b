"""The evaluation step over an S3 output (real SeaweedFS server on loopback)."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from components.data.objectstore import open_object_store
from components.evaluate.__main__ import main as evaluate_main
from tests.fixtures_s3 import s3_env, s3_prefix, seaweedfs  # noqa: F401  (pytest fixtures)
from tests.fixtures_sweep import fake_rows, write_run


def _upload(local_root: Path, run_id: str, uri: str) -> None:
    store = open_object_store(uri)
    for path in sorted((local_root / run_id).rglob("*")):
        if path.is_file():
            store.put_file(path.relative_to(local_root).as_posix(), path)


@pytest.mark.servers
def test_evaluate_step_reads_and_writes_s3(tmp_path: Path, s3_prefix: str) -> None:  # noqa: F811
    write_run(tmp_path, "ref", fake_rows({"seed": 42}))
    write_run(tmp_path, "recompute", fake_rows({"seed": 42, "kv_reuse": False}))
    _upload(tmp_path, "ref", s3_prefix)
    _upload(tmp_path, "recompute", s3_prefix)

    assert evaluate_main(["--output", s3_prefix, "--ref-run", "ref", "--run", "recompute", "--psnr-min", "30"]) == 0
    store = open_object_store(s3_prefix)
    rows = pq.read_table(io.BytesIO(store.get_bytes("recompute/metrics.parquet"))).to_pylist()
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert all(r["eval_status"] == "ok" and 44 < r["psnr"] < 52 for r in rows)
    summary = pq.read_table(io.BytesIO(store.get_bytes("recompute/metrics_config.parquet"))).to_pylist()[0]
    assert summary["passed"] is True and summary["rows_compared"] == 4
    assert not store.exists("ref/metrics.parquet")
