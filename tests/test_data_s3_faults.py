"""S3 fault handling against a real SeaweedFS: transient errors are retried, permanent ones are clear.

Faults are injected with a botocore `before-send` hook: for chosen operations it answers with an
HTTP 503 SlowDown / 500 InternalError response instead of sending the request, a set number of
times. The retry logic under test is botocore's own (configured by S3ObjectStore); the successful
attempts go to the real server, and the results are checked there.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading

import pytest

from components.data.objectstore import ObjectStoreError, S3ObjectStore, open_object_store
from tests.fixtures_s3 import FlakyS3Proxy, free_ports, s3_env, s3_prefix, seaweedfs  # noqa: F401  (fixtures)

pytestmark = pytest.mark.servers
MiB = 1024 * 1024


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_: object):
        yield self.data


class FaultInjector:
    """Fails the first `failures` requests of `operation` (all of them when failures is None)."""

    def __init__(self, operation: str, failures: int | None, status: int = 503, code: str = "SlowDown",
                 skip: int = 0):
        self.operation, self.failures, self.status, self.code, self.skip = operation, failures, status, code, skip
        self.calls = 0
        self.injected = 0
        self._lock = threading.Lock()  # s3transfer sends parts from several threads

    def __call__(self, request, event_name: str, **_: object):
        from botocore.awsrequest import AWSResponse

        if not event_name.endswith(f".{self.operation}"):
            return None
        with self._lock:
            self.calls += 1
            if self.calls <= self.skip:
                return None
            if self.failures is not None and self.injected >= self.failures:
                return None
            self.injected += 1
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{self.code}</Code>'
                f"<Message>injected fault</Message></Error>").encode()
        return AWSResponse(request.url, self.status, {"Content-Type": "application/xml"}, _Body(body))


def _store(prefix: str, injector: FaultInjector | None = None, **kw) -> S3ObjectStore:
    store = open_object_store(prefix, **kw)
    assert isinstance(store, S3ObjectStore)
    if injector is not None:
        store.client.meta.events.register("before-send.s3", injector)
    return store


@pytest.mark.parametrize("mode", ["standard", "adaptive"])
def test_put_retried_through_503s(s3_prefix, s3_env, mode) -> None:
    inj = FaultInjector("PutObject", failures=2)
    store = _store(s3_prefix, inj, retry_mode=mode, max_attempts=5)
    store.put_bytes("flaky/put.bin", b"payload")
    assert (inj.injected, inj.calls) == (2, 3)  # two faults, then the real request
    got = s3_env.client().get_object(Bucket=s3_env.bucket, Key=f"{store.prefix}/flaky/put.bin")
    assert got["Body"].read() == b"payload"


class OutageInjector(FaultInjector):
    """Every request of `operation` fails with a 500 InternalError for `seconds` from the first one
    (a gateway restarting): botocore's own backoff for a 5xx is well under a second."""

    def __init__(self, operation: str, seconds: float):
        super().__init__(operation, None, status=500, code="InternalError")
        self.seconds, self.start = seconds, None

    def __call__(self, request, event_name: str, **kw: object):
        import time

        if event_name.endswith(f".{self.operation}"):
            self.start = self.start or time.monotonic()
            if time.monotonic() - self.start >= self.seconds:
                self.failures = self.injected  # the outage is over
        return super().__call__(request, event_name, **kw)


def test_a_three_second_outage_is_waited_out_and_said(s3_prefix, s3_env, capfd) -> None:
    """It failed the job before: 5 attempts in about half a second. Now the rounds of attempts wait
    2, 4, 8 s between them, and the success says how many attempts failed."""
    inj = OutageInjector("PutObject", seconds=3)
    store = _store(s3_prefix, inj)
    store.put_bytes("blip/put.bin", b"payload")
    assert inj.injected >= 6 and inj.calls == inj.injected + 1, (inj.injected, inj.calls)
    err = capfd.readouterr().err
    assert f"S3 put {store.url('blip/put.bin')}: succeeded after {inj.injected} failed attempt(s)" in err, err
    got = s3_env.client().get_object(Bucket=s3_env.bucket, Key=f"{store.prefix}/blip/put.bin")
    assert got["Body"].read() == b"payload"


def test_an_outage_that_lasts_fails_saying_how_many_attempts_failed(s3_prefix) -> None:
    inj = FaultInjector("GetObject", failures=None, status=500, code="InternalError")
    _store(s3_prefix).put_bytes("dead/get.bin", b"x")
    store = _store(s3_prefix, inj, max_attempts=10)  # two rounds of 5, about 2 s apart
    with pytest.raises(ObjectStoreError, match=r"InternalError \(HTTP 500\).* after 10 attempt\(s\) over \d+ s"):
        store.get_bytes("dead/get.bin")
    assert inj.calls == 10


def test_get_and_list_retried_through_5xx(s3_prefix) -> None:
    _store(s3_prefix).put_bytes("flaky/get.bin", b"abc" * 1000)
    get_faults = FaultInjector("GetObject", failures=2, status=500, code="InternalError")
    store = _store(s3_prefix, get_faults)
    assert store.get_bytes("flaky/get.bin") == b"abc" * 1000
    assert get_faults.injected == 2

    list_faults = FaultInjector("ListObjectsV2", failures=1, status=503, code="SlowDown")
    store = _store(s3_prefix, list_faults)
    assert store.list("flaky/") == ["flaky/get.bin"]
    assert list_faults.injected == 1 and list_faults.calls == 2


def test_multipart_part_retried(s3_prefix, s3_env) -> None:
    """The 2nd part of a 4-part upload fails twice; the upload still completes, bytes intact."""
    data = os.urandom(20 * MiB)
    inj = FaultInjector("UploadPart", failures=2, skip=1)
    store = _store(s3_prefix, inj, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2)
    store.put_bytes("flaky/multipart.bin", data)
    assert inj.injected == 2 and inj.calls == 4 + 2
    back = _store(s3_prefix, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB).get_bytes(
        "flaky/multipart.bin")
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()


def test_a_multipart_put_and_a_get_retried_after_a_round_send_and_read_whole_bytes(s3_prefix) -> None:
    """A retry after botocore's round starts the transfer again from the first byte: the upload
    reads its data afresh (a reused reader sent nothing of it again), the download into a fresh buffer."""
    data = os.urandom(12 * MiB)
    parts = FaultInjector("UploadPart", failures=6, status=500, code="InternalError", skip=1)
    store = _store(s3_prefix, parts, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=1)
    store.put_bytes("again/multipart.bin", data)
    assert parts.injected == 6
    gets = FaultInjector("GetObject", failures=6, status=500, code="InternalError", skip=1)
    reader = _store(s3_prefix, gets, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=1)
    back = reader.get_bytes("again/multipart.bin")
    assert gets.injected == 6 and len(back) == len(data)
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()


def test_permanent_503_gives_clear_error(s3_prefix) -> None:
    inj = FaultInjector("PutObject", failures=None)
    store = _store(s3_prefix, inj, max_attempts=3)
    with pytest.raises(ObjectStoreError, match="SlowDown") as err:
        store.put_bytes("dead/put.bin", b"x")
    msg = str(err.value)
    assert "SlowDown" in msg and "HTTP 503" in msg and "3 attempt(s)" in msg
    assert store.url("dead/put.bin") in msg
    assert inj.calls == 3  # exactly max_attempts tries, then give up
    assert not _store(s3_prefix).exists("dead/put.bin")


def test_permanent_multipart_failure_leaves_no_object(s3_prefix, s3_env) -> None:
    inj = FaultInjector("UploadPart", failures=None)
    store = _store(s3_prefix, inj, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_attempts=2)
    with pytest.raises(ObjectStoreError, match="SlowDown"):
        store.put_bytes("dead/multipart.bin", os.urandom(12 * MiB))
    assert not _store(s3_prefix).exists("dead/multipart.bin")
    # s3transfer aborted the multipart upload: nothing left half-done on the server.
    uploads = s3_env.client().list_multipart_uploads(Bucket=s3_env.bucket, Prefix=f"{store.prefix}/dead/")
    assert not uploads.get("Uploads")


def test_bad_credentials_fail_fast_and_clearly(s3_prefix, s3_env, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = _store(s3_prefix, max_attempts=5)
    with pytest.raises(ObjectStoreError, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId") as err:
        store.put_bytes("auth/x", b"x")
    msg = str(err.value)
    assert "SignatureDoesNotMatch" in msg or "AccessDenied" in msg or "InvalidAccessKeyId" in msg
    assert "1 attempt(s)" in msg  # an auth error is not retried


def test_missing_bucket_is_a_clear_error(s3_env) -> None:
    # (SeaweedFS creates a bucket on first PUT, so a read shows the error.)
    store = open_object_store("s3://no-such-bucket-ardit/x")
    with pytest.raises(ObjectStoreError, match="bucket 'no-such-bucket-ardit' does not exist.*aws s3 mb"):
        store.list("")


def test_unreachable_endpoint_is_a_clear_error(s3_env) -> None:
    (port,) = free_ports(1)  # nothing listens there
    store = S3ObjectStore(s3_env.bucket, "x", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2)
    with pytest.raises(ObjectStoreError, match=f"127.0.0.1:{port}"):
        store.get_bytes("k")


KILL_MID_UPLOAD = """
import os, signal, sys
from components.data.objectstore import open_object_store
store = open_object_store(sys.argv[1], multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=1)
store.put_bytes("killed/old.bin", b"previous version")
parts = []
def die_on_third_part(request, **_):
    parts.append(1)
    if len(parts) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
store.client.meta.events.register("before-send.s3.UploadPart", die_on_third_part)
store.put_bytes("killed/old.bin", os.urandom(20 << 20))  # overwrite, killed after two parts
"""


def test_process_killed_mid_multipart_upload_leaves_no_object(s3_prefix) -> None:
    """A writer SIGKILLed after two of four parts of an overwrite: readers still see the old
    version whole, never a mix or a truncated object (real server, real multipart upload)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", KILL_MID_UPLOAD, s3_prefix], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    store = _store(s3_prefix)
    assert store.list("killed/") == ["killed/old.bin"]
    assert store.get_bytes("killed/old.bin") == b"previous version"


# ------------------------------------------------ streaming faults, missing bucket, credentials


def _every_other_get_body_fails(method: str, path: str, n: int) -> str | None:
    """GETs 1, 3, 5, ... are cut short or reset (alternately); 2, 4, 6, ... go through."""
    if method != "GET" or n % 2 == 0:
        return None
    return "cut" if n % 4 == 1 else "reset"


def test_ranged_reads_retry_cut_bodies_and_resets(s3_prefix, s3_env) -> None:
    """botocore retries a request, not the body read after it: a body cut short or a connection
    reset while reading it is retried by S3ObjectStore.get_range (issue 13: a dataset read from
    s3:// failed the whole job on one dropped connection)."""
    data = os.urandom(3 * MiB)
    _store(s3_prefix).put_bytes("stream/blob.bin", data)
    prefix = s3_prefix.split("/", 3)[3]
    with FlakyS3Proxy(s3_env.endpoint, methods=(), body_fault=_every_other_get_body_fails) as proxy:
        store = S3ObjectStore(s3_env.bucket, prefix, endpoint_url=proxy.url, max_attempts=5)
        for start, length in [(0, 100), (1000, 2 * MiB), (3 * MiB - 10, 10)]:
            assert store.get_range("stream/blob.bin", start, length) == data[start:start + length]
        assert proxy.injected.get("cut", 0) >= 1 and proxy.injected.get("reset", 0) >= 1, proxy.injected
        once = S3ObjectStore(s3_env.bucket, prefix, endpoint_url=proxy.url, max_attempts=1)
        proxy.body_faults.clear()  # the next GET is cut: with one attempt, a clear error, not bad bytes
        with pytest.raises(ObjectStoreError, match="while reading the body|failed"):
            once.get_range("stream/blob.bin", 0, MiB)


def test_dataset_read_from_s3_survives_streaming_faults(s3_prefix, s3_env, monkeypatch) -> None:
    import pyarrow as pa

    from components.data.datasets import read_dataset, write_parquet_bytes

    rows = [{"id": f"r{i}", "prompt": f"prompt {i} " + "x" * 2000} for i in range(40)]
    _store(s3_prefix).put_bytes("ds/part-0.parquet", write_parquet_bytes(pa.Table.from_pylist(rows)))
    with FlakyS3Proxy(s3_env.endpoint, methods=(), body_fault=_every_other_get_body_fails) as proxy:
        monkeypatch.setenv("ARDIT_S3_ENDPOINT", proxy.url)
        source = read_dataset(f"{s3_prefix}/ds")
        assert list(source.iter_rows(batch_size=8)) == rows
    assert sum(proxy.injected.values()) >= 2, proxy.injected


def test_failed_list_names_the_prefix(s3_prefix) -> None:
    inj = FaultInjector("ListObjectsV2", failures=None)
    store = _store(s3_prefix, inj, max_attempts=2)
    with pytest.raises(ObjectStoreError, match="run7/shards/0/rows") as err:
        store.list("run7/shards/0/rows/")
    assert f"{s3_prefix}/run7/shards/0/rows" in str(err.value), str(err.value)


def test_missing_bucket_is_one_line_before_any_work(s3_env, tmp_path, capfd) -> None:
    """Used to surface as a raw S3UploadFailedError on the first write."""
    from components.data.sample import write_sample_edit_dataset
    from components.errors import ConfigError
    from components.preflight import check_output
    from pipeline.cli import main

    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-ardit' does not exist"):
        check_output("s3://no-such-bucket-ardit/out")
    dataset = write_sample_edit_dataset(str(tmp_path / "d.parquet"), n=1, size=64)
    code = main(["edit", dataset, "-o", "s3://no-such-bucket-ardit/out"])
    err = capfd.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err, err
    client = s3_env.client()
    assert "no-such-bucket-ardit" not in [b["Name"] for b in client.list_buckets()["Buckets"]]


def test_s3_outage_at_job_start_exits_1_not_2(s3_prefix, s3_env, tmp_path, monkeypatch, capfd) -> None:
    """An S3 outage during the output check is retryable (exit 1), not a configuration error (exit 2,
    which orchestrators never retry); the same check passes once the outage is over."""
    from components.data.sample import write_sample_edit_dataset
    from components.errors import ConfigError
    from components.preflight import check_output
    from pipeline.cli import main

    dataset = write_sample_edit_dataset(str(tmp_path / "d.parquet"), n=1, size=64)
    monkeypatch.setenv("ARDIT_S3_MAX_ATTEMPTS", "2")
    with FlakyS3Proxy(s3_env.endpoint, always=lambda method, path: True) as proxy:
        monkeypatch.setenv("ARDIT_S3_ENDPOINT", proxy.url)
        with pytest.raises(ObjectStoreError, match="run the same command again") as err:
            check_output(f"{s3_prefix}/out")
        assert not isinstance(err.value, ConfigError) and "run the same command again" in str(err.value)
        capfd.readouterr()
        code = main(["edit", dataset, "-o", f"{s3_prefix}/out"])
        stderr = capfd.readouterr().err
        assert code == 1 and "503" in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert sum(proxy.injected.values()) >= 4, proxy.injected
    monkeypatch.delenv("ARDIT_S3_ENDPOINT")
    check_output(f"{s3_prefix}/out")  # the outage is over: the same check passes


def test_image_uri_read_retries_transient_failures_and_fails_the_step_if_they_persist(
        s3_prefix, s3_env, tmp_path, monkeypatch, capfd) -> None:
    """A transient failure reading an image_uri is retried; one that persists fails the shard step
    retryably (exit 1, no manifest) instead of becoming a permanent error row; a missing object
    stays an error row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from components.data import datasets
    from components.data.objectstore import TransientStorageError
    from components.data.runs import RunLayout
    from components.shard.__main__ import main as shard_main

    png = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(png, format="PNG")
    _store(s3_prefix).put_bytes("imgs/a.png", png.getvalue())
    rows = [{"id": "a", "instruction": "make it blue", "image_uri": f"{s3_prefix}/imgs/a.png"},
            {"id": "gone", "instruction": "make it red", "image_uri": f"{s3_prefix}/imgs/nope.png"}]
    dataset = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), dataset)
    monkeypatch.setattr(datasets, "IMAGE_READ_BACKOFF_S", 0.0)
    monkeypatch.setenv("ARDIT_S3_MAX_ATTEMPTS", "2")  # botocore gives up after 2: the fetcher's retry must help
    left = {"faults": 3}

    def image_fails(method: str, path: str, persist: bool = False) -> bool:
        if not path.split("?")[0].endswith("/imgs/a.png") or (left["faults"] <= 0 and not persist):
            return False
        left["faults"] -= 1
        return True

    with FlakyS3Proxy(s3_env.endpoint, always=image_fails) as proxy:
        monkeypatch.setenv("ARDIT_S3_ENDPOINT", proxy.url)
        valid, errors = datasets.validate_dataset(datasets.read_dataset(str(dataset)), "edit")
        assert [j.id for j in valid] == ["a"] and valid[0].image == png.getvalue()
        assert [j.id for j in errors] == ["gone"] and "does not exist" in errors[0].error
        assert sum(proxy.injected.values()) == 3, proxy.injected
    with FlakyS3Proxy(s3_env.endpoint, always=lambda m, p: image_fails(m, p, persist=True)) as proxy:
        monkeypatch.setenv("ARDIT_S3_ENDPOINT", proxy.url)
        with pytest.raises(TransientStorageError, match="could not be read after 3 tries"):
            datasets.validate_dataset(datasets.read_dataset(str(dataset)), "edit")
        capfd.readouterr()
        code = shard_main(["--dataset", str(dataset), "--output", str(tmp_path / "out"), "--run-id", "r1",
                           "--num-shards", "1", "--kind", "edit"])
        assert code == 1, capfd.readouterr().err
    layout = RunLayout.open(str(tmp_path / "out"), "r1")
    assert layout.read_json(layout.manifest_key) is None  # nothing committed


def test_summary_step_s3_outage_exits_1_not_2(s3_prefix, s3_env) -> None:
    """The summary step, too: an S3 outage is retried by the orchestrator (exit 1), not final (2)."""
    import subprocess
    import sys
    from pathlib import Path

    with FlakyS3Proxy(s3_env.endpoint, always=lambda method, path: True) as proxy:
        env = dict(os.environ, ARDIT_S3_ENDPOINT=proxy.url, ARDIT_S3_MAX_ATTEMPTS="2")
        proc = subprocess.run([sys.executable, "-m", "components.summary", "--output", f"{s3_prefix}/out",
                               "--run-id", "r1"], cwd=Path(__file__).resolve().parents[1], env=env,
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "503" in proc.stderr, (proc.returncode, proc.stderr[-2000:])


def test_refused_credentials_name_the_credentials(s3_prefix, monkeypatch) -> None:
    from components.errors import ConfigError
    from components.preflight import check_output

    check_output(f"{s3_prefix}/out")  # the right ones work (and leave no probe object behind)
    assert _store(s3_prefix).list("out") == []
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY") as err:
        check_output(f"{s3_prefix}/out")
    msg = str(err.value)
    assert "AWS_SECRET_ACCESS_KEY" in msg and "credentials" in msg and s3_prefix.split("/")[2] in msg, msg

