"""The embedded default: a directory of payload files, `{root}/{run}/{shard}/{row}.kv`.

Each file is exactly one payload (see payload.py). Writes go to a temp file in the same
directory and are renamed into place, so a reader sees either no file or a whole one.
The put time is the file's mtime (also in the header); `expire` uses the mtime.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
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
)
from components.kvstore.payload import (
    PayloadError,
    StreamEncoding,
    as_u8,
    decode_payload,
    read_header,
    thread_pool,
)

SUFFIX = ".kv"
_READ_CHUNK = 32 << 20
_TMP = ".tmp-"


# Payloads older than this are orphans (a killed run, never resumed): `expire` at every AR/DiT step
# start (with the default embedded store, the other runs' beside it too: <output>/<run>/_kv) and
# `ardit store gc` (on an output root: every run's) remove them. `local:///dir?ttl=12h` sets another.
DEFAULT_TTL_S = 24 * 3600.0

# A put that would leave less than this free on the store's disk is refused: the row's DiT step
# recomputes its prefix (the reason is recorded), and the K/V of a big shard never fills the disk
# that the images and records are written to. On a disk with less than 10x this free when the store
# opens, a tenth of that (small jobs on small disks still reuse). `local:///dir?min_free=20G` sets it.
MIN_FREE_BYTES = 4 << 30


class LocalStore(KVStore):
    def __init__(self, root: str | os.PathLike, ttl_s: float = DEFAULT_TTL_S, min_free_bytes: int | None = None):
        self.root = Path(root).expanduser().absolute()
        self.url = f"local://{self.root}"
        self.ttl_s = ttl_s
        try:  # an embedded store exists once opened: an empty directory means "missing", not "down"
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"local store {self.root}: cannot create the directory: {e}"
            ) from e
        if min_free_bytes is None:
            min_free_bytes = min(MIN_FREE_BYTES, shutil.disk_usage(self.root).free // 10)
        self.min_free_bytes = min_free_bytes
        self.last: dict[
            str, float
        ] = {}  # seconds spent in the phases of the last put/get

    def _path(self, key: str) -> Path:
        return self.root / (check_key(key) + SUFFIX)

    # ------------------------------------------------------------ write

    def put(self, key: str, kv: PromptKV | Any, *, check: bool = True) -> int:
        t0 = time.perf_counter()
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"local store {self.root}: cannot create {path.parent}: {e}"
            ) from e
        tmp = path.parent / f"{_TMP}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            enc = StreamEncoding(kv) if isinstance(kv, PromptKV) else None
            buf = as_u8(kv) if enc is None else None
            size = enc.data_offset + enc.data_len if enc is not None else buf.nbytes
            self._check_room(key, size)
            with open(tmp, "wb") as f:
                if enc is not None:
                    # tensors first (no staging copy) while the pool computes their crc32s,
                    # then the header into the hole left for it
                    f.seek(enc.data_offset)
                    f.writelines(memoryview(v) for v in enc.views)
                    f.seek(0)
                    f.write(enc.header())
                    f.seek(0, os.SEEK_END)
                else:
                    if check:
                        read_header(buf)  # refuse bytes that are not a payload
                    f.write(memoryview(buf))
                size = f.tell()
            os.replace(tmp, path)
        except PayloadError as e:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"put {key!r}: not a KV payload ({e})") from None
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"put {key!r} into {self.root}: {e}") from e
        self.last = {"write_s": time.perf_counter() - t0}
        return size

    def _check_room(self, key: str, size: int) -> None:
        free = shutil.disk_usage(self.root).free
        if free - size < self.min_free_bytes:
            raise StoreError(
                f"put {key!r}: {size / 2**30:.2f} GiB would leave {max(free - size, 0) / 2**30:.2f} GiB free "
                f"on the disk of {self.root} (the store keeps {self.min_free_bytes / 2**30:.2f} GiB free); the "
                "DiT step recomputes this row's prefix. Give the store more room: --kv-store "
                "local:///a/bigger/disk, or fewer rows a shard (--num-shards)")

    # ------------------------------------------------------------ read

    def _read(self, path: Path) -> np.ndarray:
        """The whole file into a fresh array; big files in parallel chunks (page-cache reads
        run concurrently, one reader thread stays near single-core memcpy speed)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            out = np.empty(size, dtype=np.uint8)
            mv = memoryview(out)

            def read(lo: int) -> int:
                hi, got = min(lo + _READ_CHUNK, size), lo
                while got < hi:  # preadv releases the GIL
                    n = os.preadv(fd, [mv[got:hi]], got)
                    if n == 0:
                        break
                    got += n
                return got - lo

            n = sum(thread_pool().map(read, range(0, size, _READ_CHUNK)))
        finally:
            os.close(fd)
        return out[:n]

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._read(self._path(key)).tobytes()
        except FileNotFoundError:
            return None

    def get(
        self, key, expect_model_id=None, expect_config_hash=None, device=None
    ) -> GetResult:
        path = self._path(key)
        t0 = time.perf_counter()
        try:
            buf = self._read(path)
        except FileNotFoundError:
            return GetResult(
                None, f"{base.MISSING}: no payload for {key!r} in {self.root}"
            )
        except OSError as e:
            return GetResult(None, f"{base.UNREACHABLE}: reading {path}: {e}")
        t1 = time.perf_counter()
        try:
            # the tensors view `buf`, a fresh array nobody else holds: no second copy
            kv = decode_payload(buf, expect_model_id, expect_config_hash, device=device)
        except PayloadError as e:
            return GetResult(None, base.reason_for(e))
        self.last = {"read_s": t1 - t0, "decode_s": time.perf_counter() - t1}
        return GetResult(kv, base.OK)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    # ------------------------------------------------------------ delete

    def _prune(self, d: Path) -> None:
        """Remove empty directories from `d` up to (not including) the root."""
        while d != self.root and self.root in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        self._prune(path.parent)
        return True

    def delete_prefix(self, prefix: str) -> int:
        check_key(prefix)
        n = int(self.delete(prefix))
        d = self.root / prefix
        if d.is_dir():
            n += sum(1 for p in d.rglob("*" + SUFFIX) if not p.name.startswith(_TMP))
            shutil.rmtree(d)
            self._prune(d.parent)
        return n

    def expire(self, older_than_s: float) -> int:
        """Delete payloads (and stray temp files) whose mtime is older than `older_than_s`."""
        if older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        cutoff, n = time.time() - older_than_s, 0
        if not self.root.is_dir():
            return 0
        for p in list(self.root.rglob("*")):
            if not p.is_file() or not (
                p.name.endswith(SUFFIX) or p.name.startswith(_TMP)
            ):
                continue
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
                    n += not p.name.startswith(_TMP)
                    self._prune(p.parent)
            except FileNotFoundError:
                pass  # deleted concurrently
        return n

    def keys(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.rglob("*" + SUFFIX):
            if p.name.startswith(_TMP):
                continue
            k = p.relative_to(self.root).as_posix()[: -len(SUFFIX)]
            if k.startswith(prefix):
                out.append(k)
        return sorted(out)

    def orphaned_parts(self, prefix: str = "") -> list[str]:
        """Temp files of puts that never finished (a killed writer), as paths under the root."""
        if not self.root.is_dir():
            return []
        found = (p.relative_to(self.root).as_posix() for p in self.root.rglob(_TMP + "*") if p.is_file())
        return sorted(k for k in found if k.startswith(prefix))

    def health(self) -> Health:
        if not self.root.is_dir():
            return Health(False, f"{self.root} is not a directory")
        if not os.access(self.root, os.W_OK):
            return Health(False, f"{self.root} is not writable")
        return Health(True, f"directory {self.root}")
