"""One self-describing byte payload per request: PromptKV <-> bytes.

Layout (little endian):

    [0, 64)                 fixed prefix: magic, format version, header length, data offset,
                            data length, crc32 of the JSON header
    [64, 64 + header_len)   JSON header: model id, config hash, dtype, per-layer shapes,
                            token ids, reuse boundaries, meta, put time, per-tensor offset/crc32
    [data_offset, +data_len) raw tensor bytes K0 V0 K1 V1 ... (data_offset is 4096-aligned)

Why this shape: the tensor region is one contiguous block, so a store can move it with a few
large zero-copy transfers and the reader can view it as tensors without another copy. The
per-tensor crc32 (zlib, ~3 GB/s per core) is computed and checked in a thread pool (zlib
releases the GIL), so it stays well below the transfer time.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from components.engine.kvcache import PromptKV

MAGIC = b"ARDITKV\x00"
VERSION = 1
PREFIX_SIZE = 64
DATA_ALIGN = 4096
# magic, version, header_len, data_offset, data_len, header_crc32
_PREFIX = struct.Struct("<8sIIQQI")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class PayloadError(Exception):
    """A payload that cannot be used. `reason` is a short code, `detail` says what was found.

    Reasons: truncated, bad_magic, bad_version, header_corrupt, checksum_mismatch,
    model_mismatch, config_mismatch, bad_header.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TensorEntry:
    name: str  # "k.<layer>" or "v.<layer>"
    offset: int  # from the start of the data region
    nbytes: int
    crc: str  # 8 hex digits, fixed width so the header length does not depend on the values


@dataclass(frozen=True)
class Header:
    """The parsed header. `data_offset`/`data_len` locate the tensor region in the payload."""

    fields: dict[str, Any]
    header_len: int  # JSON bytes after the 64-byte prefix
    data_offset: int
    data_len: int

    @property
    def total_size(self) -> int:
        return self.data_offset + self.data_len

    @property
    def put_time(self) -> float:
        return float(self.fields["put_time"])

    @property
    def tensors(self) -> list[TensorEntry]:
        return [TensorEntry(**t) for t in self.fields["tensors"]]


# ---------------------------------------------------------------- threads


def _workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


_POOL: ThreadPoolExecutor | None = None


def thread_pool() -> ThreadPoolExecutor:
    # One shared pool: numpy copies and zlib.crc32 release the GIL on large buffers.
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(
            max_workers=_workers(), thread_name_prefix="kvpayload"
        )
    return _POOL


_CHUNK = 16 << 20  # split big tensors so a few huge layers still use every core


def _crc_chunked(view: np.ndarray) -> str:
    """crc32 of a whole tensor, computed chunk by chunk in order (crc32 chains)."""
    c = 0
    for s in range(0, view.nbytes, _CHUNK):
        c = zlib.crc32(view[s : s + _CHUNK], c)
    return f"{c & 0xFFFFFFFF:08x}"


# ---------------------------------------------------------------- helpers


def as_u8(buffer: Any) -> np.ndarray:
    """A flat uint8 numpy view of a bytes-like object, numpy array or CPU torch tensor (no copy)."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise TypeError("payload buffers must live in CPU memory")
        return buffer.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def tensor_u8(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor as a CPU uint8 numpy view (copies only if not CPU-contiguous)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _dtype_name(kv: PromptKV) -> str:
    try:
        return _DTYPE_NAMES[kv.dtype]
    except KeyError:
        raise ValueError(
            f"PromptKV dtype {kv.dtype} is not supported (supported: {sorted(_DTYPES)})"
        ) from None


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _check_kv(kv: PromptKV) -> None:
    kv.validate()
    dt = kv.dtype
    for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
        if k.dtype != dt or v.dtype != dt:
            raise ValueError(
                f"layer {i}: dtype {k.dtype}/{v.dtype} differs from layer 0 dtype {dt}"
            )


def _entries(kv: PromptKV) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
        out.append((f"k.{i}", k))
        out.append((f"v.{i}", v))
    return out


def _header_json(kv: PromptKV, tensors: list[dict], put_time: float) -> bytes:
    fields = {
        "model_id": kv.model_id,
        "config_hash": kv.config_hash,
        "dtype": _dtype_name(kv),
        "num_layers": kv.num_layers,
        "shapes": [list(k.shape) for k in kv.keys],
        "token_ids": [int(t) for t in kv.token_ids],
        "pos_reuse_len": int(kv.pos_reuse_len),
        "neg_reuse_len": int(kv.neg_reuse_len),
        "meta": kv.meta,
        "put_time": round(float(put_time), 3),
        "checksum": "crc32",
        "tensors": tensors,
    }
    try:
        return json.dumps(fields, separators=(",", ":")).encode()
    except TypeError as e:
        raise ValueError(f"PromptKV.meta must be JSON-serialisable: {e}") from None


def _plan(
    kv: PromptKV, put_time: float, crcs: list[str] | None
) -> tuple[bytes, int, int, list[dict]]:
    """Header JSON bytes, data offset, data length and tensor table (crcs placeholder if None)."""
    tensors, off = [], 0
    for j, (name, t) in enumerate(_entries(kv)):
        nb = t.numel() * t.element_size()
        tensors.append(
            {
                "name": name,
                "offset": off,
                "nbytes": nb,
                "crc": crcs[j] if crcs else "00000000",
            }
        )
        off += nb
    hj = _header_json(kv, tensors, put_time)
    return hj, _align(PREFIX_SIZE + len(hj), DATA_ALIGN), off, tensors


def _prefix(hj: bytes, data_offset: int, data_len: int) -> bytes:
    p = _PREFIX.pack(
        MAGIC, VERSION, len(hj), data_offset, data_len, zlib.crc32(hj) & 0xFFFFFFFF
    )
    return p + b"\x00" * (PREFIX_SIZE - len(p))


# ---------------------------------------------------------------- encode


def payload_size(kv: PromptKV) -> int:
    """Exact number of bytes `encode_into` writes for this PromptKV."""
    _check_kv(kv)
    _, data_offset, data_len, _ = _plan(kv, time.time(), None)
    return data_offset + data_len


class EncodeJob:
    """Encoding of one payload into a buffer, running in the thread pool.

    Each tensor is copied into place (the one copy from engine memory) and its crc32 computed
    while the bytes are in cache. `wait_range` lets a store start sending the first bytes of the
    data region before the last tensor is copied; `finish` writes the header (it needs every crc).
    """

    def __init__(self, kv: PromptKV, buffer: Any, *, put_time: float | None = None):
        _check_kv(kv)
        self.kv = kv
        self.put_time = time.time() if put_time is None else put_time
        self._hj0, self.data_offset, self.data_len, self.entries = _plan(
            kv, self.put_time, None
        )
        self.size = self.data_offset + self.data_len
        buf = as_u8(buffer)
        if buf.nbytes < self.size:
            raise ValueError(
                f"buffer of {buf.nbytes} bytes is smaller than the payload ({self.size} bytes)"
            )
        if not buf.flags.writeable:
            raise ValueError("buffer is read-only")
        self.buf = buf
        data = buf[self.data_offset : self.size]

        def copy_and_crc(entry: dict, t: torch.Tensor) -> str:
            dst = data[entry["offset"] : entry["offset"] + entry["nbytes"]]
            if t.device.type == "cpu":
                np.copyto(dst, tensor_u8(t))
            else:  # device -> host straight into the buffer
                torch.from_numpy(dst).copy_(
                    t.detach().contiguous().reshape(-1).view(torch.uint8)
                )
            return _crc_chunked(dst)

        self.futures = [
            thread_pool().submit(copy_and_crc, e, t)
            for e, (_, t) in zip(self.entries, _entries(kv))
        ]

    def wait_range(self, lo: int, hi: int) -> None:
        """Block until data-region bytes [lo, hi) are encoded."""
        for e, f in zip(self.entries, self.futures):
            if e["offset"] < hi and e["offset"] + e["nbytes"] > lo:
                f.result()

    def finish(self) -> int:
        crcs = [f.result() for f in self.futures]
        hj, data_offset, _, _ = _plan(self.kv, self.put_time, crcs)
        assert data_offset == self.data_offset and len(hj) == len(
            self._hj0
        )  # crcs are fixed width
        head = _prefix(hj, data_offset, self.data_len) + hj
        self.buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        self.buf[len(head) : data_offset] = 0
        return self.size


def encode_into(kv: PromptKV, buffer: Any, *, put_time: float | None = None) -> int:
    """Write the payload for `kv` into `buffer` (bytes-like, numpy or CPU torch uint8); returns
    its size. Zero-copy apart from the one copy of each tensor into place."""
    return EncodeJob(kv, buffer, put_time=put_time).finish()


def encode_payload(kv: PromptKV, *, put_time: float | None = None) -> np.ndarray:
    """The payload as a fresh uint8 numpy array (bytes-like: supports the buffer protocol)."""
    out = np.empty(payload_size(kv), dtype=np.uint8)
    encode_into(kv, out, put_time=put_time)
    return out


class StreamEncoding:
    """For streaming writers (files), without a staging buffer: the tensors' raw byte views in
    data order, written from `data_offset` on, and `header()` (prefix, JSON, padding: the bytes
    before `data_offset`), which waits for the crc32s that the pool computes meanwhile."""

    def __init__(self, kv: PromptKV, *, put_time: float | None = None):
        _check_kv(kv)
        self.kv = kv
        self.put_time = time.time() if put_time is None else put_time
        self.views = [tensor_u8(t) for _, t in _entries(kv)]
        # crcs are fixed width, so the data offset is known before they are
        _, self.data_offset, self.data_len, _ = _plan(kv, self.put_time, None)
        self._crcs = [thread_pool().submit(_crc_chunked, v) for v in self.views]

    def header(self) -> bytes:
        crcs = [f.result() for f in self._crcs]
        hj, data_offset, data_len, _ = _plan(self.kv, self.put_time, crcs)
        head = _prefix(hj, data_offset, data_len) + hj
        return head + b"\x00" * (data_offset - len(head))


def encode_header(
    kv: PromptKV, *, put_time: float | None = None
) -> tuple[bytes, list[np.ndarray]]:
    """The bytes before the data region and the tensors' byte views (see StreamEncoding)."""
    enc = StreamEncoding(kv, put_time=put_time)
    return enc.header(), enc.views


# ---------------------------------------------------------------- decode


def read_header(buffer: Any) -> Header:
    """Parse and check the prefix and JSON header. Needs only the first `data_offset` bytes."""
    buf = as_u8(buffer)
    if buf.nbytes < PREFIX_SIZE:
        raise PayloadError(
            "truncated", f"{buf.nbytes} bytes, the fixed prefix alone is {PREFIX_SIZE}"
        )
    magic, version, hlen, data_offset, data_len, hcrc = _PREFIX.unpack(
        buf[: _PREFIX.size].tobytes()
    )
    if magic != MAGIC:
        raise PayloadError("bad_magic", f"expected {MAGIC!r}, found {magic!r}")
    if version != VERSION:
        raise PayloadError(
            "bad_version",
            f"format version {version}, this reader understands {VERSION}",
        )
    if buf.nbytes < PREFIX_SIZE + hlen:
        raise PayloadError(
            "truncated", f"{buf.nbytes} bytes, header needs {PREFIX_SIZE + hlen}"
        )
    hj = buf[PREFIX_SIZE : PREFIX_SIZE + hlen]
    if zlib.crc32(hj) & 0xFFFFFFFF != hcrc:
        raise PayloadError("header_corrupt", "header crc32 does not match")
    try:
        fields = json.loads(hj.tobytes())
    except ValueError as e:
        raise PayloadError("header_corrupt", f"header is not JSON: {e}") from None
    for key in (
        "model_id",
        "config_hash",
        "dtype",
        "shapes",
        "token_ids",
        "pos_reuse_len",
        "neg_reuse_len",
        "tensors",
        "put_time",
    ):
        if key not in fields:
            raise PayloadError("bad_header", f"header has no {key!r}")
    if fields["dtype"] not in _DTYPES:
        raise PayloadError("bad_header", f"unknown dtype {fields['dtype']!r}")
    return Header(
        fields=fields, header_len=hlen, data_offset=data_offset, data_len=data_len
    )


def check_identity(
    h: Header, expect_model_id: str | None, expect_config_hash: str | None
) -> None:
    if expect_model_id is not None and h.fields["model_id"] != expect_model_id:
        raise PayloadError(
            "model_mismatch",
            f"payload is for model {h.fields['model_id']!r}, expected {expect_model_id!r}",
        )
    if expect_config_hash is not None and h.fields["config_hash"] != expect_config_hash:
        raise PayloadError(
            "config_mismatch",
            f"payload config hash {h.fields['config_hash']!r}, expected {expect_config_hash!r}",
        )


def verify_data(h: Header, data: np.ndarray) -> None:
    """Check every tensor's crc32 (in the thread pool); raise checksum_mismatch naming the first bad one."""
    if data.nbytes < h.data_len:
        raise PayloadError(
            "truncated",
            f"data region has {data.nbytes} bytes, header says {h.data_len}",
        )
    ents = h.tensors
    got = list(
        thread_pool().map(
            lambda e: _crc_chunked(data[e.offset : e.offset + e.nbytes]), ents
        )
    )
    for e, c in zip(ents, got):
        if c != e.crc:
            raise PayloadError(
                "checksum_mismatch", f"tensor {e.name}: crc32 {c}, header says {e.crc}"
            )


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy in chunks across the thread pool (one thread cannot saturate memory bandwidth)."""
    n = src.nbytes
    list(
        thread_pool().map(
            lambda s: np.copyto(dst[s : s + _CHUNK * 4], src[s : s + _CHUNK * 4]),
            range(0, n, _CHUNK * 4),
        )
    )


def decode_payload(
    buffer: Any,
    expect_model_id: str | None = None,
    expect_config_hash: str | None = None,
    *,
    verify: bool = True,
    copy: bool = False,
    device: str | torch.device | None = None,
) -> PromptKV:
    """Payload -> PromptKV. Raises PayloadError(reason) on corruption or identity mismatch.

    copy=False returns tensors that view `buffer` (zero-copy; the caller must not reuse it).
    copy=True (or a device) copies the data region once into fresh memory first.
    """
    buf = as_u8(buffer)
    h = read_header(buf)
    check_identity(h, expect_model_id, expect_config_hash)
    if buf.nbytes < h.total_size:
        raise PayloadError(
            "truncated", f"{buf.nbytes} bytes, payload needs {h.total_size}"
        )
    return decode_data(
        h, buf[h.data_offset : h.total_size], verify=verify, copy=copy, device=device
    )


def decode_data(
    h: Header,
    data: Any,
    *,
    verify: bool = True,
    copy: bool = False,
    device: str | torch.device | None = None,
    ready: Callable[[int, int], None] | None = None,
) -> PromptKV:
    """PromptKV from a parsed header and the data region held elsewhere (a store's buffer).

    `ready(lo, hi)`, if given, blocks until data bytes [lo, hi) have arrived (or raises), so a
    store can decode the first tensors while later parts are still in flight."""
    data = as_u8(data)
    if data.nbytes < h.data_len:
        raise PayloadError(
            "truncated",
            f"data region has {data.nbytes} bytes, header says {h.data_len}",
        )
    data = data[: h.data_len]
    f = h.fields
    dtype = _DTYPES[f["dtype"]]
    for e in h.tensors:
        if e.offset < 0 or e.offset + e.nbytes > h.data_len:
            raise PayloadError(
                "bad_header", f"tensor {e.name} lies outside the data region"
            )
    if (copy or not data.flags.writeable) and (
        device is None or torch.device(device).type == "cpu"
    ):
        # copy each tensor, then crc the copy while it is in cache: one read pass, not two
        region_np = np.empty(h.data_len, dtype=np.uint8)
        ents = h.tensors

        def copy_and_crc(e: TensorEntry) -> str:
            dst = region_np[e.offset : e.offset + e.nbytes]
            np.copyto(dst, data[e.offset : e.offset + e.nbytes])
            return _crc_chunked(dst)

        futs = []
        for e in ents:
            if ready:
                ready(e.offset, e.offset + e.nbytes)
            futs.append(thread_pool().submit(copy_and_crc, e))
        crcs = [f.result() for f in futs]
        if verify:
            for e, c in zip(ents, crcs):
                if c != e.crc:
                    raise PayloadError(
                        "checksum_mismatch",
                        f"tensor {e.name}: crc32 {c}, header says {e.crc}",
                    )
        region = torch.from_numpy(region_np)
    else:
        if ready:
            ready(0, h.data_len)
        if verify:
            verify_data(h, data)
        if device is not None and torch.device(device).type != "cpu":
            region = torch.from_numpy(data if data.flags.writeable else data.copy()).to(
                device
            )
        else:
            region = torch.from_numpy(data)
    shapes = f["shapes"]
    ents = h.tensors
    if len(ents) != 2 * len(shapes):
        raise PayloadError(
            "bad_header", f"{len(ents)} tensors for {len(shapes)} layers"
        )
    tensors = {}
    for e, shape in zip(ents, [s for s in shapes for _ in (0, 1)]):
        tensors[e.name] = (
            region[e.offset : e.offset + e.nbytes].view(dtype).reshape(shape)
        )
    n = len(shapes)
    try:
        kv = PromptKV(
            keys=[tensors[f"k.{i}"] for i in range(n)],
            values=[tensors[f"v.{i}"] for i in range(n)],
            token_ids=list(f["token_ids"]),
            pos_reuse_len=f["pos_reuse_len"],
            neg_reuse_len=f["neg_reuse_len"],
            model_id=f["model_id"],
            config_hash=f["config_hash"],
            meta=dict(f.get("meta") or {}),
        )
        kv.validate()
    except (KeyError, RuntimeError, ValueError) as e:
        raise PayloadError("bad_header", str(e)) from None
    return kv
