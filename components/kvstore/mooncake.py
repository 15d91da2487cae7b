"""KV store backed by a Mooncake distributed store (zero-copy put_from / get_into).

Objects per payload (`key` = `{run}/{shard}/{row}`):

    key                 the payload header (prefix + JSON) followed by a small part index
    key#<tag>.<i>       part i of the tensor region (<tag> = put time in ms + random hex)

Parts are written first, the header last, so a visible header means a complete payload. The
put time in the part names lets `expire` find orphans (even parts whose header never landed)
from the key list alone, without reading anything.

Memory: the step processes contribute no memory (`segment=0`); payloads live in a standalone
`mooncake_client` segment holder, so they outlive the AR process that put them.

Pinning: every object is put with `with_hard_pin=True`. The master never evicts a pinned object,
so an unread payload cannot disappear silently; when the store is full the *put* fails loudly
(-200) instead, and the DiT's `delete` after each committed image frees space. `pin=soft` (evictable
after `--default_kv_soft_pin_ttl`) and `pin=none` exist for stores shared with other users.

Transfers go through one registered buffer per process (grown when a payload is bigger), so
there is no per-request registration and no serialisation copy beyond encoding into it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from components.engine.kvcache import PromptKV
from components.kvstore import base
from components.kvstore.base import (
    GetResult,
    Health,
    KVStore,
    StoreError,
    check_key,
    parse_query,
    parse_size,
    under_prefix,
)
from components.kvstore.payload import (
    PREFIX_SIZE,
    PayloadError,
    as_u8,
    check_identity,
    decode_data,
    encode_into,
    parallel_copy,
    payload_size,
    read_header,
)

# Mooncake error codes we explain (mooncake-store/include/types.h)
_CODES = {
    -200: "NO_AVAILABLE_HANDLE: store full (segments hold only pinned objects); delete consumed payloads or enlarge the segment holder",
    -600: "buffer too small",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -800: "RPC_FAIL: master unreachable",
}
def _explain(rc: int) -> str:
    return f"{rc} ({_CODES.get(rc, 'mooncake error')})"


def _regex_escape(s: str) -> str:
    # ECMAScript-safe escaping for the master's std::regex (Python's re.escape escapes more than needed)
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", s)


def _probe(host: str, port: int, timeout: float, what: str) -> None:
    """Fail in `timeout` s instead of mooncake's setup() retrying a dead master for ~90 s."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise StoreError(f"{what} {host}:{port} unreachable: {e}") from None


def _hostport(addr: str, what: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what}: {addr!r} is not HOST:PORT")
    return host, int(port)


class _Timeout(Exception):
    pass


@dataclass
class MooncakeConfig:
    master: str  # HOST:PORT of mooncake_master's RPC
    metadata: str  # http://HOST:PORT/metadata (or P2PHANDSHAKE); must match the segment holder
    protocol: str = "tcp"  # tcp (dev) | rdma (clusters)
    device: str = ""  # RDMA device names, e.g. "mlx5_0,mlx5_1"; empty = auto
    host: str = ""  # address this process is reachable at; default $ARDIT_KV_HOST, $POD_IP, 127.0.0.1
    segment: int = 0  # memory this process contributes (0: a standalone segment holder holds data)
    local_buffer: int = 16 << 20  # mooncake's own transfer buffer (unused by put_from/get_into)
    buffer: int = 64 << 20  # initial size of our registered transfer buffer (grown on demand)
    part: int = 64 << 20  # tensor region split into parts of this size (batch calls)
    timeout: float = 60.0  # bound on one put/get transfer
    connect_timeout: float = 3.0
    pin: str = "hard"  # hard | soft | none
    admin: str = ""  # master's HTTP admin (metrics) URL, for keys()/expire(); default http://MASTER_HOST:9003

    def __post_init__(self) -> None:
        _hostport(self.master, "mooncake master")
        if self.protocol not in ("tcp", "rdma", "efa", "cxl"):
            raise ValueError(f"mooncake protocol {self.protocol!r}: use tcp or rdma")
        if self.pin not in ("hard", "soft", "none"):
            raise ValueError(f"mooncake pin {self.pin!r}: use hard, soft or none")
        if self.part < 1 << 20:
            raise ValueError(f"mooncake part size {self.part} must be at least 1 MiB")
        if self.timeout <= 0:
            raise ValueError(f"mooncake timeout {self.timeout} must be > 0")
        self.host = self.host or os.environ.get("ARDIT_KV_HOST") or os.environ.get("POD_IP") or "127.0.0.1"
        self.admin = self.admin or f"http://{_hostport(self.master, 'master')[0]}:9003"


_PARAMS = {
    "metadata": str, "protocol": str, "device": str, "host": str, "admin": str, "pin": str,
    "segment": "size", "local_buffer": "size", "buffer": "size", "part": "size",
    "timeout": float, "connect_timeout": float,
}


def config_from_url(url: str) -> MooncakeConfig:
    """mooncake://MASTER_HOST:PORT?metadata=URL&protocol=tcp&device=&segment=0&buffer=256MB&part=64MB
    &timeout=60&pin=hard&admin=http://MASTER_HOST:9003&host=THIS_HOST"""
    u, q = parse_query(url)
    if not u.netloc:
        raise ValueError(f"store url {url!r}: no master HOST:PORT after mooncake://")
    unknown = sorted(set(q) - set(_PARAMS))
    if unknown:
        raise ValueError(f"store url {url!r}: unknown parameter(s) {unknown} (known: {sorted(_PARAMS)})")
    kw: dict[str, Any] = {}
    for k, v in q.items():
        t = _PARAMS[k]
        try:
            kw[k] = parse_size(v, k) if t == "size" else t(v)
        except ValueError as e:
            raise ValueError(f"store url parameter {k}={v!r}: {e}") from None
    host, _ = _hostport(u.netloc, "mooncake master")
    kw.setdefault("metadata", f"http://{host}:8080/metadata")
    return MooncakeConfig(master=u.netloc, **kw)


class _Registered:
    """A numpy buffer registered with the store for zero-copy transfers."""

    def __init__(self, ms: Any, size: int):
        self.arr = np.empty(size, dtype=np.uint8)
        self.ptr = self.arr.ctypes.data
        self.size = size
        rc = ms.register_buffer(self.ptr, size)
        if rc != 0:
            raise StoreError(f"mooncake register_buffer({size} bytes) failed: {_explain(rc)}")


class MooncakeStore(KVStore):
    def __init__(self, cfg: MooncakeConfig, url: str | None = None):
        self.cfg = cfg
        self.url = url or f"mooncake://{cfg.master}"
        self._ms: Any = None
        self._rcfg: Any = None
        self._buf: _Registered | None = None  # tensor region (put: the whole payload)
        self._hbuf: _Registered | None = None  # header object
        self._abandoned: list[Any] = []  # buffers a timed-out transfer may still write into
        self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake")
        self._failed_at = 0.0
        self._failure = ""
        self.last: dict[str, float] = {}  # seconds spent in the phases of the last put/get

    @classmethod
    def from_url(cls, url: str) -> "MooncakeStore":
        return cls(config_from_url(url), url)

    # ------------------------------------------------------------ connection

    def _connect(self) -> Any:
        if self._ms is not None:
            return self._ms
        # don't re-probe a dead store for every row: remember the failure for a few seconds
        if time.monotonic() - self._failed_at < 5.0:
            raise StoreError(self._failure)
        try:
            c = self.cfg
            _probe(*_hostport(c.master, "master"), c.connect_timeout, "mooncake master")
            if c.metadata.startswith("http"):
                netloc = c.metadata.split("//", 1)[1].split("/", 1)[0]
                _probe(*_hostport(netloc, "metadata"), c.connect_timeout, "mooncake metadata server")
            # the transfer engine refuses to start without a LAN address unless told which one to use
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", c.host)
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # lazy: optional wheel

            ms = MooncakeDistributedStore()
            rc = ms.setup(c.host, c.metadata, c.segment, c.local_buffer, c.protocol, c.device, c.master)
            if rc != 0:
                raise StoreError(f"mooncake setup against master {c.master} failed: {_explain(rc)}")
            rcfg = ReplicateConfig()
            rcfg.replica_num = 1
            if c.pin == "hard":
                rcfg.with_hard_pin = True
            elif c.pin == "soft":
                from mooncake.store import SoftPinAction

                rcfg.soft_pin_action = SoftPinAction.ENABLE
        except StoreError as e:
            self._failed_at, self._failure = time.monotonic(), str(e)
            raise
        self._ms, self._rcfg = ms, rcfg
        return ms

    def _call(self, fn: Callable, *args: Any) -> Any:
        """Run one blocking mooncake call with the configured timeout."""
        fut = self._exec.submit(fn, *args)
        try:
            return fut.result(timeout=self.cfg.timeout)
        except FutureTimeout:
            # the call may still be writing into our buffers: never reuse or free them
            self._abandoned += [self._buf, self._hbuf]
            self._buf = self._hbuf = None
            self._exec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake")
            raise _Timeout(f"no answer in {self.cfg.timeout:g} s") from None

    def _ensure(self, which: str, size: int) -> _Registered:
        cur: _Registered | None = getattr(self, which)
        if cur is not None and cur.size >= size:
            return cur
        if cur is not None:
            self._ms.unregister_buffer(cur.ptr)
        floor = self.cfg.buffer if which == "_buf" else 1 << 20
        new = _Registered(self._ms, max(floor, -(-size // (1 << 20)) << 20))
        setattr(self, which, new)
        return new

    # ------------------------------------------------------------ put

    def put(self, key: str, kv: PromptKV | Any, *, check: bool = True) -> int:
        check_key(key)
        ms = self._connect()
        t0 = time.perf_counter()
        if isinstance(kv, PromptKV):
            n = payload_size(kv)
            buf = self._ensure("_buf", n)
            encode_into(kv, buf.arr[:n])
        else:
            src = as_u8(kv)
            n = src.nbytes
            buf = self._ensure("_buf", n)
            parallel_copy(buf.arr[:n], src)
        payload = buf.arr[:n]
        try:
            h = read_header(payload)
            if n < h.total_size:
                raise PayloadError("truncated", f"{n} bytes, payload needs {h.total_size}")
        except PayloadError as e:
            if check:
                raise ValueError(f"put {key!r}: not a KV payload ({e})") from None
            h = None  # unchecked bytes (tests): stored as a header object only, the reader rejects it

        if self.exists(key):  # replacing: drop the old header and its parts first
            self.delete(key)
        t1 = time.perf_counter()
        try:
            if h is None:
                head, part_keys = payload.tobytes(), []
            else:
                tag = f"{int(time.time() * 1000)}-{secrets.token_hex(4)}"
                ps = self.cfg.part
                nparts = max(1, -(-h.data_len // ps))
                part_keys = [f"{key}#{tag}.{i}" for i in range(nparts)]
                ptrs = [buf.ptr + h.data_offset + i * ps for i in range(nparts)]
                sizes = [min(ps, h.data_len - i * ps) for i in range(nparts)]
                rcs = self._call(ms.batch_put_from, part_keys, ptrs, sizes, self._rcfg)
                bad = [(i, rc) for i, rc in enumerate(rcs) if rc != 0]
                if bad:
                    ms.batch_remove(part_keys, True)
                    raise StoreError(f"put {key!r}: part {bad[0][0]} of {nparts} failed: {_explain(bad[0][1])}")
                index = json.dumps({"tag": tag, "part": ps, "parts": nparts}).encode()
                head = payload[: PREFIX_SIZE + h.header_len].tobytes() + index
            hb = self._ensure("_hbuf", len(head))
            hb.arr[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            rc = self._call(ms.put_from, key, hb.ptr, len(head), self._rcfg)
            if rc != 0:
                if part_keys:
                    ms.batch_remove(part_keys, True)
                raise StoreError(f"put {key!r}: header failed: {_explain(rc)}")
        except _Timeout as e:
            raise StoreError(f"put {key!r}: {e}") from None
        self.last = {"encode_s": t1 - t0, "transfer_s": time.perf_counter() - t1}
        return n

    # ------------------------------------------------------------ get

    def _read_header_object(self, ms: Any, key: str) -> tuple[int, _Registered]:
        hb = self._ensure("_hbuf", 1 << 20)
        rc = self._call(ms.get_into, key, hb.ptr, hb.size)
        if rc == -600:  # bigger than our header buffer
            size = ms.get_size(key)
            if size > 0:
                hb = self._ensure("_hbuf", size)
                rc = self._call(ms.get_into, key, hb.ptr, hb.size)
        return rc, hb

    def _absent(self, ms: Any, key: str, rc: int, what: str) -> GetResult:
        if rc == -704:
            return GetResult(None, f"{base.MISSING}: no {what} for {key!r} in the store")
        if ms.health_check() != 0:
            return GetResult(None, f"{base.UNREACHABLE}: master {self.cfg.master} (get {what} {key!r}: {_explain(rc)})")
        return GetResult(None, f"{base.MISSING}: get {what} {key!r} failed: {_explain(rc)}")

    def _fetch(self, key: str, expect_model_id: str | None, expect_config_hash: str | None):
        """-> (header, data view, header view) or a GetResult saying why not."""
        try:
            ms = self._connect()
        except StoreError as e:
            return GetResult(None, f"{base.UNREACHABLE}: {e}")
        try:
            rc, hb = self._read_header_object(ms, key)
            if rc < 0:
                return self._absent(ms, key, rc, "payload")
            head = hb.arr[:rc]
            h = read_header(head)
            check_identity(h, expect_model_id, expect_config_hash)
            try:
                index = json.loads(head[PREFIX_SIZE + h.header_len :].tobytes())
                ps, nparts, tag = int(index["part"]), int(index["parts"]), str(index["tag"])
            except (ValueError, KeyError, TypeError) as e:
                return GetResult(None, f"{base.CORRUPT}: part index of {key!r} unreadable: {e}")
            if nparts != max(1, -(-h.data_len // ps)):
                return GetResult(None, f"{base.CORRUPT}: part index of {key!r} says {nparts} parts of {ps} for {h.data_len} bytes")
            buf = self._ensure("_buf", h.data_len)
            keys = [f"{key}#{tag}.{i}" for i in range(nparts)]
            sizes = [min(ps, h.data_len - i * ps) for i in range(nparts)]
            if nparts == 1:
                rcs = [self._call(ms.get_into, keys[0], buf.ptr, sizes[0])]
            else:
                rcs = self._call(ms.batch_get_into, keys, [buf.ptr + i * ps for i in range(nparts)], sizes)
            for i, (got, want) in enumerate(zip(rcs, sizes)):
                if got < 0:
                    return self._absent(ms, key, got, f"part {i}/{nparts} of")
                if got != want:
                    return GetResult(None, f"{base.CORRUPT}: part {i} of {key!r} has {got} bytes, expected {want}")
            return h, buf.arr[: h.data_len], head
        except PayloadError as e:
            return GetResult(None, base.reason_for(e))
        except _Timeout as e:
            return GetResult(None, f"{base.TIMEOUT}: get {key!r}: {e}")

    def get(self, key, expect_model_id=None, expect_config_hash=None, device=None) -> GetResult:
        check_key(key)
        t0 = time.perf_counter()
        r = self._fetch(key, expect_model_id, expect_config_hash)
        if isinstance(r, GetResult):
            return r
        h, data, _ = r
        t1 = time.perf_counter()
        try:
            # copy out of the reused transfer buffer (straight to the device if one is given)
            kv = decode_data(h, data, copy=True, device=device)
        except PayloadError as e:
            return GetResult(None, base.reason_for(e))
        self.last = {"transfer_s": t1 - t0, "decode_s": time.perf_counter() - t1}
        return GetResult(kv, base.OK)

    def get_bytes(self, key: str) -> bytes | None:
        check_key(key)
        r = self._fetch(key, None, None)
        if isinstance(r, GetResult):
            return None
        h, data, head = r
        pre = head[: PREFIX_SIZE + h.header_len].tobytes()
        return pre + b"\x00" * (h.data_offset - len(pre)) + data.tobytes()

    # ------------------------------------------------------------ exists / delete / list

    def exists(self, key: str) -> bool:
        check_key(key)
        rc = self._connect().is_exist(key)
        if rc < 0:
            raise StoreError(f"exists {key!r}: {_explain(rc)}")
        return rc == 1

    def exists_many(self, keys: list[str]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        rcs = self._connect().batch_is_exist(keys)
        bad = [(k, rc) for k, rc in zip(keys, rcs) if rc < 0]
        if bad:
            raise StoreError(f"exists {bad[0][0]!r}: {_explain(bad[0][1])}")
        return [rc == 1 for rc in rcs]

    def _remove_regex(self, pattern: str) -> int:
        # force: a get/exists leaves a 10 s lease that would otherwise block removal (-706)
        n = self._connect().remove_by_regex(pattern, True)
        if n < 0:
            raise StoreError(f"remove_by_regex {pattern!r}: {_explain(n)}")
        return n

    def delete(self, key: str) -> bool:
        k = _regex_escape(check_key(key))
        n = self._remove_regex(f"^{k}$")  # header first: the payload disappears at once
        self._remove_regex(f"^{k}#.*$")
        return n > 0

    def delete_prefix(self, prefix: str) -> int:
        p = _regex_escape(check_key(prefix))
        n = self._remove_regex(f"^{p}(/[^#]*)?$")  # headers: the number of payloads
        self._remove_regex(f"^{p}([/#].*)?$")  # their parts
        return n

    def _all_keys(self) -> list[str]:
        """Every object key, from the master's admin HTTP endpoint (the client API cannot list)."""
        url = self.cfg.admin.rstrip("/") + "/get_all_keys"
        try:
            with urllib.request.urlopen(url, timeout=self.cfg.connect_timeout + 5) as r:
                text = r.read().decode()
        except OSError as e:
            raise StoreError(f"listing keys needs the master admin endpoint {url}: {e}") from None
        return [k for k in text.splitlines() if k.strip()]

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self._all_keys() if "#" not in k and under_prefix(k, prefix))

    def raw_keys(self) -> list[str]:
        """All objects including parts (tests: nothing of ours may remain)."""
        return sorted(self._all_keys())

    def expire(self, older_than_s: float) -> int:
        """Delete payloads whose parts were put more than `older_than_s` ago (time from the part
        names), including orphaned parts of a put that never wrote its header."""
        if older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        cutoff_ms = (time.time() - older_than_s) * 1000
        old = set()
        for k in self._all_keys():
            base_key, sep, rest = k.rpartition("#")
            if not sep:
                continue
            try:
                ms = int(rest.split("-", 1)[0])
            except ValueError:
                continue  # not one of ours
            if ms < cutoff_ms:
                old.add(base_key)
        for k in old:
            self.delete(k)
        return len(old)

    def health(self) -> Health:
        try:
            ms = self._connect()
        except StoreError as e:
            return Health(False, str(e))
        rc = ms.health_check()
        detail = {0: "ok", 1: "client not initialised", 2: "master unreachable"}.get(rc, f"code {rc}")
        return Health(rc == 0, f"mooncake master {self.cfg.master}: {detail}")

    def close(self) -> None:
        if self._ms is not None:
            for b in (self._buf, self._hbuf):
                if b is not None:
                    self._ms.unregister_buffer(b.ptr)
            self._buf = self._hbuf = None
            self._ms.close()
            self._ms = None
        self._exec.shutdown(wait=False)
