"""One object-store suite, run against the local backend and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import hashlib
import os
import sys
import uuid

import pytest

from components.data.objectstore import (
    LocalObjectStore,
    ObjectNotFoundError,
    ObjectStore,
    S3ObjectStore,
    check_key,
    open_object_store,
)
from tests.fixtures_s3 import s3_env, s3_prefix, seaweedfs  # noqa: F401  (pytest fixtures)

MiB = 1024 * 1024


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.servers)])
def store(request: pytest.FixtureRequest, tmp_path) -> ObjectStore:
    if request.param == "local":
        return open_object_store(str(tmp_path / "store"))
    prefix = request.getfixturevalue("s3_prefix")
    # Small multipart sizes so a 20 MB object really goes through multipart upload / ranged GETs.
    return open_object_store(prefix, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)


def test_put_get_exists_delete(store: ObjectStore) -> None:
    assert not store.exists("a/b.txt")
    store.put_bytes("a/b.txt", b"hello")
    assert store.exists("a/b.txt")
    assert store.get_bytes("a/b.txt") == b"hello"
    store.put_bytes("a/b.txt", b"replaced")  # overwrite
    assert store.get_bytes("a/b.txt") == b"replaced"
    store.put_text("a/c.json", '{"x": 1}')
    assert store.get_text("a/c.json") == '{"x": 1}'
    store.delete("a/b.txt")
    assert not store.exists("a/b.txt")
    store.delete("a/b.txt")  # deleting a missing key is fine
    with pytest.raises(ObjectNotFoundError, match="b.txt"):
        store.get_bytes("a/b.txt")
    assert store.get_bytes("a/c.json")  # the neighbour is untouched


def test_empty_object(store: ObjectStore) -> None:
    store.put_bytes("empty", b"")
    assert store.exists("empty")
    assert store.get_bytes("empty") == b""


def test_list_is_a_string_prefix_and_sorted(store: ObjectStore) -> None:
    for key in ["run/shards/1/x", "run/shards/0/b", "run/shards/0/a", "run/shards/10/z", "other/k"]:
        store.put_bytes(key, key.encode())
    assert store.list("run/shards/0/") == ["run/shards/0/a", "run/shards/0/b"]
    assert store.list("run/shards/1") == ["run/shards/1/x", "run/shards/10/z"]
    assert store.list("run/shards/1/") == ["run/shards/1/x"]
    assert store.list("") == sorted(["run/shards/1/x", "run/shards/0/b", "run/shards/0/a", "run/shards/10/z",
                                     "other/k"])
    assert store.list("nothing/") == []


def test_delete_prefix(store: ObjectStore) -> None:
    for i in range(7):
        store.put_bytes(f"run1/shards/{i % 2}/f{i}", b"x")
    store.put_bytes("run10/keep", b"y")
    assert store.delete_prefix("run1/shards/0/") == 4
    assert store.list("run1/") == ["run1/shards/1/f1", "run1/shards/1/f3", "run1/shards/1/f5"]
    assert store.delete_prefix("run1/") == 3
    assert store.list("") == ["run10/keep"]
    with pytest.raises(ValueError, match="non-empty prefix"):
        store.delete_prefix("")


def test_files_round_trip(store: ObjectStore, tmp_path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1000))
    store.put_file("files/src.bin", src)
    dest = tmp_path / "dest.bin"
    store.get_file("files/src.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    with pytest.raises(ObjectNotFoundError, match="no object .*files/missing.bin"):
        store.get_file("files/missing.bin", tmp_path / "never.bin")
    assert not (tmp_path / "never.bin").exists()


def test_large_object(store: ObjectStore) -> None:
    data = os.urandom(20 * MiB + 12345)
    store.put_bytes("big/blob", data)
    back = store.get_bytes("big/blob")
    assert len(back) == len(data)
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()


def test_child_store_sees_the_same_objects(store: ObjectStore) -> None:
    store.put_bytes("runA/inputs/0.parquet", b"p")
    child = store.child("runA")
    assert child.list("") == ["inputs/0.parquet"]
    assert child.get_bytes("inputs/0.parquet") == b"p"
    child.put_bytes("summary.json", b"{}")
    assert store.exists("runA/summary.json")
    assert store.url("runA/summary.json") == child.url("summary.json")


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a//b", "a/./b", "a\\b", "x/.ardit-tmp-1"])
def test_bad_keys_are_refused(store: ObjectStore, bad: str) -> None:
    with pytest.raises(ValueError, match="^object key "):
        store.put_bytes(bad, b"x")


def test_open_object_store_factory(tmp_path) -> None:
    assert isinstance(open_object_store(str(tmp_path)), LocalObjectStore)
    local = open_object_store(f"file://{tmp_path}/x")
    assert isinstance(local, LocalObjectStore) and local.root == (tmp_path / "x").resolve()
    s3 = open_object_store("s3://bucket/some/prefix/", endpoint_url="http://127.0.0.1:1")
    assert isinstance(s3, S3ObjectStore)
    assert (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    assert s3.url("k/v") == "s3://bucket/some/prefix/k/v"
    with pytest.raises(ValueError, match="no bucket"):
        open_object_store("s3:///nobucket")
    with pytest.raises(ValueError, match="unsupported"):
        open_object_store("gs://bucket/x")
    assert check_key("a/b-c_d.png") == "a/b-c_d.png"


def test_local_backend_needs_no_boto3(tmp_path) -> None:
    """The local path must work where boto3 is not installed: importing it must not load boto3."""
    import subprocess

    code = (
        "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
        "from components.data.objectstore import open_object_store\n"
        f"s = open_object_store({str(tmp_path)!r}); s.put_bytes('k', b'v'); assert s.get_bytes('k') == b'v'\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_local_write_is_atomic_when_interrupted(tmp_path) -> None:
    """A write that fails midway leaves the old object intact and no visible temp file."""
    store = LocalObjectStore(tmp_path)
    store.put_bytes("k", b"old")

    class Boom(Exception):
        pass

    def failing_write(f):  # writes half the data, then dies
        f.write(b"new-half")
        raise Boom("died half-way")

    with pytest.raises(Boom, match="died half-way"):
        store._atomic_write("k", failing_write)
    assert store.get_bytes("k") == b"old"
    assert store.list("") == ["k"]
    assert [p.name for p in tmp_path.iterdir()] == ["k"]


@pytest.mark.servers
def test_s3_store_reads_env_settings(s3_env) -> None:
    store = S3ObjectStore(s3_env.bucket, f"env-{uuid.uuid4().hex[:8]}")
    assert store.endpoint_url == s3_env.endpoint
    store.put_bytes("x", b"1")
    assert store.get_bytes("x") == b"1"
    # And the object is where a plain boto3 client would look for it.
    obj = s3_env.client().get_object(Bucket=s3_env.bucket, Key=f"{store.prefix}/x")
    assert obj["Body"].read() == b"1"


@pytest.mark.servers
def test_s3_multipart_really_used(s3_prefix, s3_env) -> None:
    """A 20 MB put with a 5 MB threshold is a multipart upload (the ETag has a part count)."""
    store = open_object_store(s3_prefix, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    store.put_bytes("mp/blob", os.urandom(20 * MiB))
    head = s3_env.client().head_object(Bucket=s3_env.bucket, Key=f"{store.prefix}/mp/blob")
    assert head["ContentLength"] == 20 * MiB
    assert head["ETag"].strip('"').endswith("-4")


def test_size_ranges_and_reader(store: ObjectStore) -> None:
    data = bytes(range(256)) * 40
    store.put_bytes("r/blob", data)
    assert store.size("r/blob") == len(data)
    assert store.get_range("r/blob", 10, 5) == data[10:15]
    assert store.get_range("r/blob", len(data) - 3, 100) == data[-3:]
    with store.open_reader("r/blob") as f:
        f.seek(-8, os.SEEK_END)
        assert f.read(8) == data[-8:]
        f.seek(100)
        assert f.read(4) == data[100:104] and f.tell() == 104
        f.seek(0)
        assert f.read() == data
    with pytest.raises(ObjectNotFoundError, match="no object .*r/missing"):
        store.size("r/missing")
    with pytest.raises(ObjectNotFoundError, match="no object .*r/missing"):
        store.open_reader("r/missing")


def test_content_id_follows_content(store: ObjectStore) -> None:
    store.put_bytes("c/a", b"one")
    first = store.content_id("c/a")
    store.put_bytes("c/a", b"one")
    assert store.content_id("c/a") == first
    store.put_bytes("c/a", b"two")
    assert store.content_id("c/a") != first


def test_parquet_read_through_range_reader(store: ObjectStore) -> None:
    """pyarrow reads a footer and single row groups through open_reader."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"x": list(range(1000))}), buf, row_group_size=100)
    store.put_bytes("p/t.parquet", buf.getvalue())
    with store.open_reader("p/t.parquet") as f:
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_rows == 1000 and pf.metadata.num_row_groups == 10
        assert pf.read_row_group(7).column("x").to_pylist() == list(range(700, 800))


def test_split_uri_keeps_a_file_at_the_root_at_the_root():
    """`/x.parquet` lives in `/`: it was split as if in the working directory, so a dataset at the
    root was looked for (and could be found) under the directory the CLI ran in."""
    from components.data.objectstore import split_uri

    assert split_uri("/x.parquet") == ("/", "x.parquet")
    assert split_uri("x.parquet") == (".", "x.parquet")
    assert split_uri("/d/x.parquet") == ("/d", "x.parquet")
    assert split_uri("s3://b/a/x.parquet") == ("s3://b/a", "x.parquet")


def test_a_killed_writes_temp_file_is_swept_at_the_next_step(tmp_path) -> None:
    """A writer killed between its temp file and the rename leaves the temp file (invisible to
    list, but on the disk); the shard's next DiT step sweeps its shard's directory of them."""
    store = open_object_store(str(tmp_path / "store"))
    store.put_bytes("run/shards/0/images/a.png", b"whole")
    images = tmp_path / "store" / "run" / "shards" / "0" / "images"
    (images / ".ardit-tmp-killed").write_bytes(b"half")
    (tmp_path / "store" / "run" / "shards" / "1").mkdir(parents=True)
    (tmp_path / "store" / "run" / "shards" / "1" / ".ardit-tmp-other").write_bytes(b"x")
    assert store.list("run/shards/0/") == ["run/shards/0/images/a.png"]
    assert store.sweep_partial_writes("run/shards/0/") == 1
    assert sorted(p.name for p in images.iterdir()) == ["a.png"]
    assert (tmp_path / "store" / "run" / "shards" / "1" / ".ardit-tmp-other").exists()  # another shard's: kept
    assert store.sweep_partial_writes("run/shards/9/") == 0
