"""The in-process store: `memory://NAME` keeps payloads as tensors inside this process.

A local job runs the AR and DiT steps of a shard in the same process (one model copy, or the same
rank of a tensor- / pipeline-parallel copy), so the prompt K/V need not become bytes, files or
network traffic: the AR's exported tensors are kept as they are and the DiT takes them back.

- Where: in GPU memory up to `device_budget` bytes (`memory://NAME?device=8G`; default 0), else
  copied to page-locked host memory, so a shard's waiting K/V never takes the GPU memory the AR's
  batch and the DiT's steps need. A copy runs on the putting thread's CUDA stream and the getting
  thread waits for it (an event), so an AR and a DiT on two streams hand over safely.
- How much: at most `host_budget` bytes on the host (`?host=64G`; default half the memory
  available when the store is first opened). A put beyond it is refused (StoreError): the row's
  DiT step recomputes its prefix and records why.
- Who sees it: every `open_store("memory://NAME")` in this process returns the same store, and
  nothing outside the process: a step of another process (a resume after a crash, a cluster's
  split steps) finds no payload and recomputes (`missing: ... in memory of another process`).
- Lifetime: until deleted (the DiT deletes a row's K/V once its image is written, the shard's
  prefix at commit), expired (`ttl`, as the other backends), or the process ends.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from components.kvstore import base
from components.kvstore.base import GetResult, Health, KVStore, StoreError, check_key, parse_query

_stores: dict[str, "MemoryStore"] = {}
_stores_lock = threading.Lock()
DEFAULT_TTL_S = 24 * 3600.0


@dataclass
class _Entry:
    kv: Any  # PromptKV, its tensors on the device or in (pinned) host memory
    nbytes: int
    on_device: bool
    ready: Any  # a torch.cuda.Event recorded after the tensors were made or copied, or None
    put_time: float


def open_memory_store(url: str) -> "MemoryStore":
    """The process's store of that name (made on first use with the URL's budgets)."""
    name, options = parse_memory_url(url)
    with _stores_lock:
        store = _stores.get(name)
        if store is None:
            store = _stores[name] = MemoryStore(name, **options)
        return store


def parse_memory_url(url: str) -> tuple[str, dict[str, Any]]:
    """`memory://NAME[?device=8G&host=64G&ttl=24h]` -> (name, MemoryStore options); ValueError
    for anything else."""
    u, q = parse_query(url)
    name = (u.netloc + u.path).strip("/")
    if not name:
        raise ValueError(f"store url {url!r}: memory:// needs a name (memory://RUN)")
    if set(q) - {"device", "host", "ttl"}:
        raise ValueError(f"store url {url!r}: memory:// takes only device, host and ttl, got {sorted(q)}")
    options: dict[str, Any] = {}
    if "device" in q:
        options["device_budget"] = base.parse_size(q["device"], "memory store device budget")
    if "host" in q:
        options["host_budget"] = base.parse_size(q["host"], "memory store host budget")
    if "ttl" in q:
        options["ttl_s"] = base.parse_duration(q["ttl"], "memory store ttl")
    return name, options


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class MemoryStore(KVStore):
    def __init__(self, name: str, device_budget: int = 0, host_budget: int | None = None,
                 ttl_s: float = DEFAULT_TTL_S):
        self.name, self.url, self.ttl_s = name, f"memory://{name}", ttl_s
        self.device_budget = device_budget
        self.host_budget = host_budget if host_budget is not None else _available_host_bytes() // 2
        self.entries: dict[str, _Entry] = {}
        self.lock = threading.Lock()
        self.device_bytes = self.host_bytes = 0

    # -- write ------------------------------------------------------------------------------------
    def put(self, key: str, kv: Any) -> int:
        from components.engine.kvcache import PromptKV

        check_key(key)
        if not isinstance(kv, PromptKV):  # encoded bytes (tools, tests): decoded once
            from components.kvstore.payload import PayloadError, decode_payload

            try:
                kv = decode_payload(kv, copy=True)
            except PayloadError as e:
                raise ValueError(f"put {key!r}: not a KV payload ({e})") from None
        kv.validate()
        nbytes = kv.nbytes()
        self.delete(key)  # a put replaces
        cuda = kv.keys[0].is_cuda
        with self.lock:
            on_device = cuda and self.device_bytes + nbytes <= self.device_budget
            if not on_device and self.host_bytes + nbytes > self.host_budget:
                raise StoreError(f"put {key!r}: {nbytes / 2**30:.2f} GiB would take the in-memory K/V store past its "
                                 f"{self.host_budget / 2**30:.1f} GiB of host memory; the DiT step recomputes this "
                                 "row's prefix (fewer rows a shard, --num-shards, keep less waiting)")
            if on_device:
                self.device_bytes += nbytes
            else:
                self.host_bytes += nbytes
        try:
            kept, ready = (kv, _event()) if on_device or not cuda else _to_host(kv)
        except BaseException:
            with self.lock:
                self.host_bytes -= nbytes
            raise
        with self.lock:
            self.entries[key] = _Entry(kept, nbytes, on_device, ready, time.time())
        return nbytes

    # -- read -------------------------------------------------------------------------------------
    def get(self, key, expect_model_id=None, expect_config_hash=None, device=None) -> GetResult:
        with self.lock:
            entry = self.entries.get(check_key(key))
        if entry is None:
            return GetResult(None, f"{base.MISSING}: no payload for {key!r} in {self.url} (it lives in the memory "
                                   "of the process that put it: a resume or another process recomputes)")
        kv = entry.kv
        if expect_model_id is not None and kv.model_id != expect_model_id:
            return GetResult(None, f"{base.MODEL}: payload is for model {kv.model_id!r}, expected {expect_model_id!r}")
        if expect_config_hash is not None and kv.config_hash != expect_config_hash:
            return GetResult(None, f"{base.CONFIG}: payload config hash {kv.config_hash!r}, "
                                   f"expected {expect_config_hash!r}")
        if entry.ready is not None:
            entry.ready.synchronize()  # the put's copy (or the AR's export) has run
        return GetResult(_on(kv, device), base.OK)

    def get_bytes(self, key: str) -> bytes | None:
        got = self.get(key)
        if not got.ok:
            return None
        from components.kvstore.payload import encode_payload

        return encode_payload(_on(got.kv, "cpu")).tobytes()

    def exists(self, key: str) -> bool:
        with self.lock:
            return check_key(key) in self.entries

    # -- delete -----------------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        with self.lock:
            entry = self.entries.pop(check_key(key), None)
            if entry is None:
                return False
            if entry.on_device:
                self.device_bytes -= entry.nbytes
            else:
                self.host_bytes -= entry.nbytes
        return True

    def _delete_where(self, match) -> int:
        with self.lock:
            keys = [k for k in self.entries if match(k, self.entries[k])]
        return sum(self.delete(k) for k in keys)

    def delete_prefix(self, prefix: str) -> int:
        check_key(prefix)
        return self._delete_where(lambda k, _: k == prefix or k.startswith(prefix + "/"))

    def expire(self, older_than_s: float) -> int:
        if older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        cutoff = time.time() - older_than_s
        return self._delete_where(lambda _, e: e.put_time < cutoff)

    def keys(self, prefix: str = "") -> list[str]:
        with self.lock:
            return sorted(k for k in self.entries if k.startswith(prefix))

    def health(self) -> Health:
        with self.lock:
            return Health(True, f"in-memory store {self.name}: {len(self.entries)} payload(s), "
                                f"{self.device_bytes / 2**30:.2f} GiB on the GPU, {self.host_bytes / 2**30:.2f} GiB "
                                f"on the host (of {self.host_budget / 2**30:.1f})")


def _event():
    """An event on this thread's stream after the work queued so far (None off the GPU)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _to_host(kv: Any) -> tuple[Any, Any]:
    """The payload copied to page-locked host memory on this thread's stream (queued after the
    export that made it), and the event the copy ends with."""
    import torch

    from components.engine.kvcache import PromptKV

    def host(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    copied = PromptKV([host(k) for k in kv.keys], [host(v) for v in kv.values], kv.token_ids, kv.pos_reuse_len,
                      kv.neg_reuse_len, kv.model_id, kv.config_hash, dict(kv.meta))
    return copied, _event()


def _on(kv: Any, device: Any) -> Any:
    """The payload with its tensors on `device` (the same object when they are there already)."""
    import torch

    from components.engine.kvcache import PromptKV

    if device is None or all(t.device == torch.device(device) for t in (kv.keys[0], kv.values[0])):
        if kv.keys[0].is_cuda:
            stream = torch.cuda.current_stream(kv.keys[0].device)
            for t in (*kv.keys, *kv.values):
                t.record_stream(stream)  # not reused by the putting stream while this one reads it
        return kv
    return PromptKV([k.to(device, non_blocking=True) for k in kv.keys],
                    [v.to(device, non_blocking=True) for v in kv.values], kv.token_ids, kv.pos_reuse_len,
                    kv.neg_reuse_len, kv.model_id, kv.config_hash, dict(kv.meta))
