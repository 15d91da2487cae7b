"""KV store backed by a Mooncake distributed store (zero-copy put_from / get_into).

Objects per payload (`key` = `{run}/{shard}/{row}`):

    key                 the payload header (prefix + JSON) followed by a small part index
    key#<tag>.<i>       part i of the tensor region (<tag> = put time in ms + random hex)

Parts are written first, the header last, so a visible header means a complete payload. The
put time in the part names lets `expire` find orphans (even parts whose header never landed)
from the key list alone, without reading anything.

Memory: the step processes contribute no memory (`segment=0`); payloads live in a standalone
`mooncake_client` segment holder, so they outlive the AR process that put them.

Pinning is a lease: every object is put soft-pinned for `pin_ttl` (default 6 h). Within its TTL
the master evicts a payload only as a last resort when the store is full; after it, the payload
is an ordinary object that eviction may take. So the payloads of a failed or killed run do not
hold the store forever: each AR step also deletes payloads older than the TTL (best effort), the
failing step deletes what it put on its way out, and `ardit store clean --older-than` does the
same by hand. A payload read after its TTL may be gone: the DiT recomputes and says why.
`pin=hard` (never evicted; a full store fails the put with -200 instead) and `pin=none` exist too.

Mooncake logs ~17 glog lines to stderr when a client connects; they are kept out of the terminal
(shown only when the connection fails, or with ARDIT_MOONCAKE_LOGS=1).

Transfers go through one registered buffer per process (grown when a payload is bigger), so
there is no per-request registration and no serialisation copy beyond encoding into it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from components.engine.kvcache import PromptKV
from components.kvstore import base
from components.kvstore.base import (
    GetResult,
    Health,
    KVStore,
    StoreError,
    check_key,
    parse_duration,
    parse_query,
    parse_size,
)
from components.kvstore.payload import (
    PREFIX_SIZE,
    EncodeJob,
    PayloadError,
    as_u8,
    check_identity,
    decode_data,
    parallel_copy,
    payload_size,
    read_header,
)

# Mooncake error codes we explain (mooncake-store/include/types.h)
_CODES = {
    -200: "NO_AVAILABLE_HANDLE: store full (segments hold only pinned objects); delete consumed payloads or enlarge the segment holder",
    -600: "INVALID_PARAMS (e.g. buffer too small)",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED: the transfer outlived its lease",
    -800: "TRANSFER_FAIL: the segment holder holding the data did not answer",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL: master unreachable",
    -901: "RPC_TIMEOUT: master did not answer",
}
# codes that mean "a server is down", not "this key is absent"
_DOWN = {-800: "segment holder", -900: "master", -901: "master"}


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


class _Absent(Exception):
    """Carries the GetResult that explains why a payload cannot be returned."""

    def __init__(self, result: GetResult):
        super().__init__(result.reason)
        self.result = result


@dataclass
class MooncakeConfig:
    master: str  # HOST:PORT of mooncake_master's RPC
    metadata: str  # http://HOST:PORT/metadata (or P2PHANDSHAKE); must match the segment holder
    protocol: str = "tcp"  # tcp (dev) | rdma (clusters)
    device: str = ""  # RDMA device names, e.g. "mlx5_0,mlx5_1"; empty = auto
    host: str = ""  # address this process is reachable at; default $ARDIT_KV_HOST, $POD_IP, 127.0.0.1
    segment: int = (
        0  # memory this process contributes (0: a standalone segment holder holds data)
    )
    local_buffer: int = (
        16 << 20
    )  # mooncake's own transfer buffer (unused by put_from/get_into)
    buffer: int = (
        64 << 20
    )  # initial size of our registered transfer buffer (grown on demand)
    part: int = 64 << 20  # tensor region split into parts of this size (batch calls)
    # put: up to this many parts in flight, each sent as soon as it is encoded (1: encode all,
    # then one batch call). get: parts fetched in this many batch calls one after another,
    # decoding the first while the next is in flight (1: one batch call, then decode).
    put_streams: int = 4
    get_groups: int = 4  # measured on the 16-core GPU host: 3.3 GB/s vs 2.5-2.9 for one batch call
    timeout: float = 60.0  # bound on one put/get transfer
    connect_timeout: float = 3.0
    pin: str = "soft"  # soft (a lease of pin_ttl) | hard (never evicted) | none
    pin_ttl: float = 6 * 3600.0  # seconds a soft-pinned payload is protected; older ones are expired
    admin: str = ""  # master's HTTP admin (metrics) URL, for keys()/expire(); default http://MASTER_HOST:9003

    def __post_init__(self) -> None:
        _hostport(self.master, "mooncake master")
        if self.protocol not in ("tcp", "rdma", "efa", "cxl"):
            raise ValueError(f"mooncake protocol {self.protocol!r}: use tcp or rdma")
        if self.pin not in ("hard", "soft", "none"):
            raise ValueError(f"mooncake pin {self.pin!r}: use hard, soft or none")
        if self.part < 1 << 20:
            raise ValueError(f"mooncake part size {self.part} must be at least 1 MiB")
        for name in ("put_streams", "get_groups"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(
                    f"mooncake {name} {getattr(self, name)} must be in [1, 64]"
                )
        if self.timeout <= 0:
            raise ValueError(f"mooncake timeout {self.timeout} must be > 0")
        if not 1 <= self.pin_ttl <= 24 * 3600:  # the master's default -max_kv_soft_pin_ttl is 24 h
            raise ValueError(f"mooncake pin_ttl {self.pin_ttl:g} s must be between 1 s and 24 h")
        self.host = (
            self.host
            or os.environ.get("ARDIT_KV_HOST")
            or os.environ.get("POD_IP")
            or "127.0.0.1"
        )
        self.admin = self.admin or f"http://{_hostport(self.master, 'master')[0]}:9003"


_PARAMS = {
    "metadata": str,
    "protocol": str,
    "device": str,
    "host": str,
    "admin": str,
    "pin": str,
    "pin_ttl": "duration",
    "segment": "size",
    "local_buffer": "size",
    "buffer": "size",
    "part": "size",
    "timeout": float,
    "connect_timeout": float,
    "put_streams": int,
    "get_groups": int,
}


def config_from_url(url: str) -> MooncakeConfig:
    """mooncake://MASTER_HOST:PORT?metadata=URL&protocol=tcp&device=&segment=0&buffer=256MB&part=64MB
    &timeout=60&pin=soft&pin_ttl=6h&admin=http://MASTER_HOST:9003&host=THIS_HOST"""
    u, q = parse_query(url)
    if not u.netloc:
        raise ValueError(f"store url {url!r}: no master HOST:PORT after mooncake://")
    unknown = sorted(set(q) - set(_PARAMS))
    if unknown:
        raise ValueError(
            f"store url {url!r}: unknown parameter(s) {unknown} (known: {sorted(_PARAMS)})"
        )
    kw: dict[str, Any] = {}
    for k, v in q.items():
        t = _PARAMS[k]
        try:
            kw[k] = parse_size(v, k) if t == "size" else parse_duration(v, k) if t == "duration" else t(v)
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
            raise StoreError(
                f"mooncake register_buffer({size} bytes) failed: {_explain(rc)}"
            )


_GLOG_LINE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] |WARNING: Logging before InitGoogleLogging)")


class _mooncake_logs:
    """Route fd 2 into a temp file while Mooncake's C++ code logs (glog, straight to fd 2).
    Lines that are not glog's are written back to stderr; `errors` keeps glog's E/F lines."""

    def __enter__(self) -> _mooncake_logs:
        self.errors = ""
        self.active = os.environ.get("ARDIT_MOONCAKE_LOGS", "") in ("", "0")
        if self.active:
            sys.stderr.flush()
            self.saved = os.dup(2)
            self.tmp = tempfile.TemporaryFile()
            os.dup2(self.tmp.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.active:
            return
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.tmp.seek(0)
        lines = self.tmp.read().decode(errors="replace").splitlines()
        self.tmp.close()
        self.errors = "; ".join(ln.split("] ", 1)[-1] for ln in lines if ln[:1] in "EF" and _GLOG_LINE.match(ln))[-500:]
        other = [ln for ln in lines if not _GLOG_LINE.match(ln)]
        if other:
            print("\n".join(other), file=sys.stderr)


class MooncakeStore(KVStore):
    def __init__(self, cfg: MooncakeConfig, url: str | None = None):
        self.cfg = cfg
        self.url = url or f"mooncake://{cfg.master}"
        self.ttl_s = cfg.pin_ttl if cfg.pin == "soft" else None
        self._ms: Any = None
        self._rcfg: Any = None
        self._buf: _Registered | None = None  # tensor region (put: the whole payload)
        self._hbuf: _Registered | None = None  # header object
        self._abandoned: list[
            Any
        ] = []  # buffers a timed-out transfer may still write into
        self._abandoned_pools: list[base.DaemonPool] = []  # threads that may still be in such a call
        self._exec = self._executor()  # put parts in flight, single calls
        self._seq = self._executor(1)  # get groups, one after another
        self._failed_at = 0.0
        self._failure = ""
        self._connect_lock = threading.Lock()
        self.last: dict[
            str, float
        ] = {}  # seconds spent in the phases of the last put/get

    @classmethod
    def from_url(cls, url: str) -> MooncakeStore:
        return cls(config_from_url(url), url)

    # ------------------------------------------------------------ connection

    def _connect(self) -> Any:
        with self._connect_lock:  # the DiT step's get and delete threads may both be first
            return self._connect_once()

    def _connect_once(self) -> Any:
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
                _probe(
                    *_hostport(netloc, "metadata"),
                    c.connect_timeout,
                    "mooncake metadata server",
                )
            # the transfer engine refuses to start without a LAN address unless told which one to use
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", c.host)
            from mooncake.store import (  # lazy: optional wheel
                MooncakeDistributedStore,
                ReplicateConfig,
            )

            ms = MooncakeDistributedStore()
            with _mooncake_logs() as logs:
                rc = ms.setup(
                    c.host,
                    c.metadata,
                    c.segment,
                    c.local_buffer,
                    c.protocol,
                    c.device,
                    c.master,
                )
            if rc != 0:
                raise StoreError(
                    f"mooncake setup against master {c.master} failed: {_explain(rc)}"
                    + (f" ({logs.errors})" if logs.errors else "")
                )
            rcfg = ReplicateConfig()
            rcfg.replica_num = 1
            if c.pin == "hard":
                rcfg.with_hard_pin = True
            elif c.pin == "soft":
                from mooncake.store import SoftPinAction

                rcfg.soft_pin_action = SoftPinAction.ENABLE
                rcfg.soft_pin_ttl_ms = int(c.pin_ttl * 1000)
        except StoreError as e:
            self._failed_at, self._failure = time.monotonic(), str(e)
            raise
        self._ms, self._rcfg = ms, rcfg
        return ms

    def _call(self, fn: Callable, *args: Any) -> Any:
        """Run one blocking mooncake call with the configured timeout."""
        return self._wait(
            [self._exec.submit(fn, *args)], time.monotonic() + self.cfg.timeout
        )[0]

    def _abandon(self) -> None:
        """A call may still be writing into our buffers: never reuse or free them."""
        self._abandoned += [b for b in (self._buf, self._hbuf) if b is not None]
        self._buf = self._hbuf = None
        for pool in (self._exec, self._seq):
            pool.shutdown(wait=False)
            self._abandoned_pools.append(pool)
        self._exec, self._seq = self._executor(), self._executor(1)

    def _executor(self, n: int = 0) -> base.DaemonPool:
        # daemon threads: a call hung in a frozen master is abandoned, never joined at exit
        return base.DaemonPool(n or max(1, self.cfg.put_streams), name="mooncake")

    def _ensure(self, which: str, size: int) -> _Registered:
        cur: _Registered | None = getattr(self, which)
        if cur is not None and cur.size >= size:
            return cur
        if cur is not None:
            self._ms.unregister_buffer(cur.ptr)
        floor = self.cfg.buffer if which == "_buf" else 1 << 20
        if cur is not None:  # grow by half at least, so a few slightly bigger payloads
            floor = max(
                floor, cur.size * 3 // 2
            )  # do not re-fault the whole buffer each time
        new = _Registered(self._ms, max(floor, -(-size // (1 << 20)) << 20))
        setattr(self, which, new)
        return new

    # ------------------------------------------------------------ put

    def _parts(self, data_len: int) -> list[tuple[int, int]]:
        ps = self.cfg.part
        return [(o, min(ps, data_len - o)) for o in range(0, max(data_len, 1), ps)]

    def _wait(self, futs: list[Future], deadline: float) -> list[Any]:
        out = []
        for f in futs:
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                self._abandon()
                raise _Timeout(f"no answer in {self.cfg.timeout:g} s") from None
        return out

    def put(self, key: str, kv: PromptKV | Any, *, check: bool = True) -> int:
        check_key(key)
        ms = self._connect()
        if self.exists(key):  # replacing: drop the old header and its parts first
            self.delete(key)
        t0 = time.perf_counter()
        job = None
        if isinstance(kv, PromptKV):
            n = payload_size(kv)
            buf = self._ensure("_buf", n)
            job = EncodeJob(kv, buf.arr[:n])  # runs in the payload thread pool
            data_offset, data_len = job.data_offset, job.data_len
        else:
            src = as_u8(kv)
            n = src.nbytes
            buf = self._ensure("_buf", n)
            parallel_copy(buf.arr[:n], src)
            try:
                h = read_header(buf.arr[:n])
                if n < h.total_size:
                    raise PayloadError(
                        "truncated", f"{n} bytes, payload needs {h.total_size}"
                    )
                data_offset, data_len = h.data_offset, h.data_len
            except PayloadError as e:
                if check:
                    raise ValueError(f"put {key!r}: not a KV payload ({e})") from None
                # unchecked bytes (tests): stored as a header object only; readers reject it
                return self._put_header(ms, key, buf.arr[:n].tobytes(), [])
        tag = f"{int(time.time() * 1000)}-{secrets.token_hex(4)}"
        parts = self._parts(data_len)
        keys = [f"{key}#{tag}.{i}" for i in range(len(parts))]
        ptrs = [buf.ptr + data_offset + o for o, _ in parts]
        sizes = [sz for _, sz in parts]
        deadline = time.monotonic() + self.cfg.timeout
        try:
            if self.cfg.put_streams <= 1:  # encode everything, then one batch call
                if job:
                    job.finish()
                t1 = time.perf_counter()
                rcs = self._wait(
                    [
                        self._exec.submit(
                            ms.batch_put_from, keys, ptrs, sizes, self._rcfg
                        )
                    ],
                    deadline,
                )[0]
            else:  # send each part as soon as its bytes are encoded, `put_streams` in flight
                futs = []
                for (o, sz), k, ptr in zip(parts, keys, ptrs):
                    if job:
                        job.wait_range(o, o + sz)
                    futs.append(self._exec.submit(ms.put_from, k, ptr, sz, self._rcfg))
                if job:
                    job.finish()
                t1 = time.perf_counter()
                rcs = self._wait(futs, deadline)
        except BaseException as e:
            self._forget(ms, keys)  # parts that did land must not linger until expiry
            if isinstance(e, _Timeout):
                raise StoreError(f"put {key!r}: {e}") from None
            raise
        finally:
            if job:  # never leave copies running into a buffer the next call reuses
                futures_wait(job.futures)
        bad = [(i, rc) for i, rc in enumerate(rcs) if rc != 0]
        if bad:
            self._forget(ms, keys)
            raise StoreError(
                f"put {key!r}: part {bad[0][0]} of {len(parts)} failed: {_explain(bad[0][1])}"
            )
        hlen = read_header(buf.arr[:n]).header_len
        index = json.dumps(
            {"tag": tag, "part": self.cfg.part, "parts": len(parts)}
        ).encode()
        self._put_header(ms, key, buf.arr[: PREFIX_SIZE + hlen].tobytes() + index, keys)
        t2 = time.perf_counter()
        self.last = {"encode_s": t1 - t0, "transfer_s": t2 - t1}
        return n

    @staticmethod
    def _forget(ms: Any, keys: list[str]) -> None:
        """Best-effort removal of a failed put's parts (expire() catches what this misses)."""
        if keys:
            # the put's own error is the one to report
            with contextlib.suppress(Exception):
                ms.batch_remove(keys, True)

    def _put_header(self, ms: Any, key: str, head: bytes, part_keys: list[str]) -> int:
        """Header object last: once it is visible, the payload is complete."""
        hb = self._ensure("_hbuf", len(head))
        hb.arr[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        try:
            rc = self._call(ms.put_from, key, hb.ptr, len(head), self._rcfg)
        except _Timeout as e:
            rc, err = None, str(e)
        if rc != 0:
            self._forget(ms, part_keys)
            raise StoreError(
                f"put {key!r}: header failed: {_explain(rc) if rc is not None else err}"
            )
        return len(head)

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
            return GetResult(
                None, f"{base.MISSING}: no {what} for {key!r} in the store"
            )
        if (
            rc in _DOWN
        ):  # (health_check() still said ok right after the master was killed)
            return GetResult(
                None,
                f"{base.UNREACHABLE}: {_DOWN[rc]} (master {self.cfg.master}), get {what} for {key!r}: {_explain(rc)}",
            )
        if rc == -707:
            return GetResult(
                None, f"{base.TIMEOUT}: get {what} for {key!r}: {_explain(rc)}"
            )
        return GetResult(
            None, f"{base.MISSING}: get {what} for {key!r} failed: {_explain(rc)}"
        )

    def _header(
        self,
        ms: Any,
        key: str,
        expect_model_id: str | None,
        expect_config_hash: str | None,
    ):
        """Read and check the header object -> (header, header bytes view, part keys, part ranges)."""
        rc, hb = self._read_header_object(ms, key)
        if rc < 0:
            raise _Absent(self._absent(ms, key, rc, "payload"))
        head = hb.arr[:rc]
        h = read_header(head)
        check_identity(h, expect_model_id, expect_config_hash)
        try:
            index = json.loads(head[PREFIX_SIZE + h.header_len :].tobytes())
            ps, nparts, tag = int(index["part"]), int(index["parts"]), str(index["tag"])
        except (ValueError, KeyError, TypeError) as e:
            raise _Absent(
                GetResult(
                    None, f"{base.CORRUPT}: part index of {key!r} unreadable: {e}"
                )
            ) from None
        parts = [(o, min(ps, h.data_len - o)) for o in range(0, max(h.data_len, 1), ps)]
        if nparts != len(parts):
            raise _Absent(
                GetResult(
                    None,
                    f"{base.CORRUPT}: part index of {key!r} says {nparts} parts of {ps} "
                    f"for {h.data_len} bytes",
                )
            )
        return h, head, [f"{key}#{tag}.{i}" for i in range(nparts)], parts

    def _get(self, key: str, expect_model_id, expect_config_hash, device, raw: bool):
        """-> (PromptKV or raw bytes) or a GetResult saying why not."""
        t0 = time.perf_counter()
        try:
            ms = self._connect()
        except StoreError as e:
            return GetResult(None, f"{base.UNREACHABLE}: {e}")
        try:
            h, head, keys, parts = self._header(
                ms, key, expect_model_id, expect_config_hash
            )
            buf = self._ensure("_buf", h.data_len)
            ptrs = [buf.ptr + o for o, _ in parts]
            sizes = [sz for _, sz in parts]
            deadline = time.monotonic() + self.cfg.timeout
            # parts move in `get_groups` batch calls, one after another, so the first
            # groups are decoded while later ones are in flight (concurrent single-part
            # get_into calls measured slower than one batch call)
            ngroups = 1 if raw else max(1, min(self.cfg.get_groups, len(parts)))
            bounds = [len(parts) * g // ngroups for g in range(ngroups + 1)]
            groups = [range(bounds[g], bounds[g + 1]) for g in range(ngroups)]
            group_of = {i: g for g, r in enumerate(groups) for i in r}
            futs = [
                self._seq.submit(
                    ms.batch_get_into,
                    [keys[i] for i in r],
                    [ptrs[i] for i in r],
                    [sizes[i] for i in r],
                )
                for r in groups
            ]
            done: dict[int, int] = {}
            waited = [0.0]

            def ready(lo: int, hi: int) -> None:
                """Block until the parts covering data bytes [lo, hi) have arrived intact."""
                tw = time.perf_counter()
                for i, (o, sz) in enumerate(parts):
                    if o < hi and o + sz > lo and i not in done:
                        r = groups[group_of[i]]
                        rcs = self._wait([futs[group_of[i]]], deadline)[0]
                        done.update(zip(r, rcs))
                        for j in r:
                            if done[j] < 0:
                                what = f"part {j + 1}/{len(parts)}"  # "no part 2/3 for 'k'"
                                raise _Absent(self._absent(ms, key, done[j], what))
                            if done[j] != sizes[j]:
                                raise _Absent(
                                    GetResult(
                                        None,
                                        f"{base.CORRUPT}: part {j} of {key!r} has "
                                        f"{done[j]} bytes, expected {sizes[j]}",
                                    )
                                )
                waited[0] += time.perf_counter() - tw

            t1 = time.perf_counter()
            if raw:
                ready(0, h.data_len)
                pre = head[: PREFIX_SIZE + h.header_len].tobytes()
                return (
                    pre
                    + b"\x00" * (h.data_offset - len(pre))
                    + buf.arr[: h.data_len].tobytes()
                )
            # copy out of the reused transfer buffer (straight to the device if one is given),
            # tensor by tensor as their parts arrive
            kv = decode_data(
                h, buf.arr[: h.data_len], copy=True, device=device, ready=ready
            )
            total = time.perf_counter() - t1
            # wait_s: blocked on transfers; decode_s: copy + crc32 not hidden behind them
            self.last = {
                "header_s": t1 - t0,
                "wait_s": waited[0],
                "decode_s": total - waited[0],
            }
            return kv
        except _Absent as a:
            return a.result
        except PayloadError as e:
            return GetResult(None, base.reason_for(e))
        except _Timeout as e:
            return GetResult(None, f"{base.TIMEOUT}: get {key!r}: {e}")
        finally:
            # a failed get must not leave transfers writing into the buffer we reuse next
            if "futs" in locals() and not all(f.done() for f in futs):
                self._abandon()

    def get(
        self, key, expect_model_id=None, expect_config_hash=None, device=None
    ) -> GetResult:
        check_key(key)
        r = self._get(key, expect_model_id, expect_config_hash, device, raw=False)
        return r if isinstance(r, GetResult) else GetResult(r, base.OK)

    def get_bytes(self, key: str) -> bytes | None:
        check_key(key)
        r = self._get(key, None, None, None, raw=True)
        return None if isinstance(r, GetResult) else r

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
            raise StoreError(
                f"listing keys needs the master admin endpoint {url}: {e}"
            ) from None
        return [k for k in text.splitlines() if k.strip()]

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(
            k for k in self._all_keys() if "#" not in k and k.startswith(prefix)
        )

    def orphaned_parts(self, prefix: str = "") -> list[str]:
        """Part objects (`KEY#tag.i`) whose header `KEY` is gone: a put that never finished."""
        found = self._all_keys()
        headers = {k for k in found if "#" not in k}
        return sorted(k for k in found if "#" in k and k.rpartition("#")[0] not in headers and k.startswith(prefix))

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
        try:  # health_check() alone kept saying ok after the master was killed
            _probe(
                *_hostport(self.cfg.master, "master"),
                self.cfg.connect_timeout,
                "mooncake master",
            )
        except StoreError as e:
            return Health(False, str(e))
        rc = ms.health_check()
        detail = {0: "ok", 1: "client not initialised", 2: "master unreachable"}.get(
            rc, f"code {rc}"
        )
        return Health(rc == 0, f"mooncake master {self.cfg.master}: {detail}")

    def close(self) -> None:
        # A call abandoned after a failed or timed-out get may still be inside the client: tearing
        # the client down under it crashes the process (SIGSEGV). Give such calls
        # a few seconds to end; a client still busy after that is left open (process exit frees it).
        deadline = time.monotonic() + min(self.cfg.timeout, 5.0)
        self._abandoned_pools = [
            pool
            for pool in self._abandoned_pools
            if not pool.shutdown(wait=True, timeout=max(0.0, deadline - time.monotonic()))
        ]
        self._exec.shutdown(wait=False)
        if self._abandoned_pools:
            return
        if self._ms is not None:
            for b in (self._buf, self._hbuf):
                if b is not None:
                    self._ms.unregister_buffer(b.ptr)
            self._buf = self._hbuf = None
            with _mooncake_logs():
                self._ms.close()
            self._ms = None
