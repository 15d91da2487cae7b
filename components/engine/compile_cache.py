"""torch.compile's and Triton's on-disk caches, kept in the job's storage so a fresh container starts warm.

A step pod on a cluster starts with empty caches, so it compiles the model's compiled regions and
Triton kernels again, which makes a process's first shards several times slower than the next
ones (docs/benchmarks.md). So each step keeps its caches beside its outputs:

    attach(output, engine)   at engine load: fetch <output>/_compile_cache/<fingerprint>/rank<r>.tar,
                             if there is one, into a local directory, and point
                             TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at it
    persist()                at the end of a step: if the directory gained files, upload it again

The fingerprint names what compiled code depends on: torch, Triton, CUDA and the GPU, the model
(config hash), the layout (tp, pp) and this rank's place in it, the quantization and the kernel
settings. Inductor and Triton check their own keys on every lookup, so an entry that does not fit
is a miss, never a wrong kernel. A cache that cannot be fetched, unpacked or stored costs
compiles and a log line, never the step.

ARDIT_COMPILE_CACHE: `auto` (default: on for CUDA engines, under the output root), `off`, or a
storage URL (a directory or s3://bucket/prefix) to keep the caches elsewhere, e.g. one place
shared by every job of a cluster.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ENV = "ARDIT_COMPILE_CACHE"
PREFIX = "_compile_cache"  # a run id starts with a letter or digit: no run's keys start so


def cache_setting() -> str:
    return os.environ.get(ENV, "auto").strip() or "auto"


def check_setting() -> str | None:
    """Why ARDIT_COMPILE_CACHE cannot be used (None when it can): for the job's checks, before any work."""
    setting = cache_setting()
    if setting in ("auto", "off"):
        return None
    from components.data.objectstore import open_object_store

    try:
        open_object_store(setting)
    except ValueError as e:
        return f"{ENV}={setting}: {e}; use auto, off, a directory or s3://bucket/prefix"
    return None


def fingerprint(engine: Any) -> str:
    """What compiled code depends on (see the module docstring), hashed: one cache per such tuple."""
    import torch

    from . import kernels

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    device = engine.model.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    parallel = getattr(engine.model, "parallel", None)
    layout = (parallel.world_size, parallel.pp_size) if parallel is not None else (1, 1)
    parts = (torch.__version__, torch.version.cuda, triton_version, gpu, engine.config_hash,
             str(engine.model.dtype), getattr(engine.model, "quantization", None), layout,
             kernels.settings().describe())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def rank_name(engine: Any) -> str:
    """This process's place in its model copy (replicas of one layout share their caches)."""
    parallel = getattr(engine.model, "parallel", None)
    if parallel is None:
        return "rank0"
    return f"pp{parallel.pp_rank}-tp{parallel.rank}-cfg{parallel.cfg_rank}"


class CompileCache:
    """One process's compile caches: a local directory mirrored to one storage key."""

    def __init__(self, store: Any, key: str, local_dir: Path, log: bool = True):
        self.store, self.key, self.local_dir, self.log = store, key, local_dir, log
        self.files_at_restore: set[str] = set()

    def _files(self) -> set[str]:
        if not self.local_dir.is_dir():
            return set()
        return {str(p.relative_to(self.local_dir)) for p in self.local_dir.rglob("*")
                if p.is_file() and not p.name.endswith(".lock")}

    def point_compilers_here(self) -> None:
        """Inductor and Triton read these at each compile, so setting them before the first one is enough."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.local_dir / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(self.local_dir / "triton")

    def restore(self) -> int:
        """Unpack the stored caches into the local directory (bytes fetched; 0 if none stored yet)."""
        from components.data.objectstore import ObjectNotFoundError

        t0 = time.perf_counter()
        self.local_dir.mkdir(parents=True, exist_ok=True)
        try:
            data = self.store.get_bytes(self.key)
        except ObjectNotFoundError:
            data = b""
        except Exception as e:  # noqa: BLE001 - a cache we cannot fetch costs compiles, not the step
            self._say(f"could not fetch {self.key} ({type(e).__name__}: {e}); compiling from scratch", problem=True)
            data = b""
        if data:
            with _locked(self.local_dir):  # replicas of one layout on one machine share the directory
                try:
                    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
                        tar.extractall(self.local_dir, filter="data")
                except (tarfile.TarError, OSError) as e:
                    self._say(f"could not unpack {self.key} ({type(e).__name__}: {e}); compiling from scratch",
                              problem=True)
        self.point_compilers_here()
        self.files_at_restore = self._files()
        if data:
            self._say(f"restored {len(data) / 2**20:.1f} MiB ({len(self.files_at_restore)} files) "
                      f"in {time.perf_counter() - t0:.1f} s")
        return len(data)

    def persist(self) -> int:
        """Store the local directory again if compiles added files since the restore (bytes stored)."""
        files = self._files()
        new = files - self.files_at_restore
        if not new:
            return 0
        t0 = time.perf_counter()
        buf = io.BytesIO()
        try:
            with _locked(self.local_dir), tarfile.open(fileobj=buf, mode="w:") as tar:
                for name in sorted(files):
                    try:
                        tar.add(self.local_dir / name, arcname=name, recursive=False)
                    except OSError:  # a compiler's temp file went away meanwhile
                        continue
            self.store.put_bytes(self.key, buf.getvalue())
        except Exception as e:  # noqa: BLE001 - the next start compiles again; the step is done
            self._say(f"could not store {self.key} ({type(e).__name__}: {e})", problem=True)
            return 0
        self.files_at_restore = files
        self._say(f"stored {buf.tell() / 2**20:.1f} MiB ({len(new)} new files) in {time.perf_counter() - t0:.1f} s")
        return buf.tell()

    def _say(self, text: str, problem: bool = False) -> None:
        if self.log or problem:
            print(f"compile cache: {text}", file=sys.stderr, flush=True)


class _locked:
    """An exclusive lock on `<directory>.lock` (other processes of this machine wait)."""

    def __init__(self, directory: Path):
        self.path = directory.with_name(directory.name + ".lock")

    def __enter__(self) -> None:
        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


_attached: dict[tuple[str, str], CompileCache] = {}
_attaching = threading.Lock()  # an overlapped job's AR and DiT steps attach from two threads at once


def attach(output: str, engine: Any, log: bool = True) -> CompileCache | None:
    """This process's compile cache for `engine` under the job's output (see ARDIT_COMPILE_CACHE),
    restored once per process; None where it is off (the default on the CPU, where nothing compiles).
    `log`: say what was restored and stored (problems are said anyway)."""
    setting = cache_setting()
    if setting == "off" or (setting == "auto" and engine.model.device.type != "cuda"):
        return None
    root = output if setting == "auto" else setting
    fp, rank = fingerprint(engine), rank_name(engine)
    key = f"{PREFIX}/{fp}/{rank}.tar"
    with _attaching:
        return _attach_once(root, key, fp, rank, setting, log)


def _attach_once(root: str, key: str, fp: str, rank: str, setting: str, log: bool) -> CompileCache | None:
    if (root, key) not in _attached:
        from components.data.objectstore import open_object_store

        local_dir = Path(tempfile.gettempdir()) / "ardit-compile-cache" / fp / rank
        try:
            store = open_object_store(root)
        except ValueError as e:  # a step run without the job's checks: compiles, never a failed step
            print(f"compile cache: off ({ENV}={setting}: {e})", file=sys.stderr, flush=True)
            return None
        cache = CompileCache(store, key, local_dir, log=log)
        cache.restore()
        _attached[(root, key)] = cache
    return _attached[(root, key)]
