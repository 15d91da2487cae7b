"""Prompt KV across tensor-parallel layouts: each rank stores and fetches only its own KV heads.

The payload stays layout-independent (full head order, one head per part), so an AR step at TP4
feeds a DiT step at TP2 or TP1 without gathering the heads through one host:

    AR at TP1:          one payload at `key` (all heads), as always
    AR at TP N > 1:     one payload per KV head at `key.h{i}` (ranks that share a replicated head:
                        the first of them writes it)
    DiT at any TP:      the heads [first, last) it holds: sliced from `key` when that exists,
                        else read from the head parts

Deleting a row's KV removes both forms.
"""

from __future__ import annotations

from typing import Any

from components.engine.kvcache import PromptKV


def rank_heads(engine: Any) -> tuple[int, int, int, bool]:
    """(first, last, total, writes): the KV heads this rank's engine holds, and whether it is the
    rank that stores them (ranks that replicate a KV head, and a CFG-parallel group's twin, do not)."""
    cfg, parallel = engine.config, getattr(engine, "parallel", None)
    total = cfg.num_key_value_heads
    if parallel is None or parallel.world_size == 1:
        return 0, total, total, parallel is None or parallel.cfg_rank == 0
    from components.engine.parallel import kv_head_range

    first, last = kv_head_range(total, cfg.num_attention_heads, parallel.world_size, parallel.rank)
    replicas = max(1, parallel.world_size // total)
    return first, last, total, parallel.rank % replicas == 0 and parallel.cfg_rank == 0


def head_key(key: str, head: int) -> str:
    return f"{key}.h{head}"


def _slice(kv: PromptKV, first: int, last: int) -> PromptKV:
    return PromptKV([k[:, first:last] for k in kv.keys], [v[:, first:last] for v in kv.values], kv.token_ids,
                    kv.pos_reuse_len, kv.neg_reuse_len, kv.model_id, kv.config_hash, dict(kv.meta))


def put_heads(store: Any, key: str, kv: PromptKV, first: int, total: int, writes: bool = True,
              written: list[str] | None = None) -> int:
    """Store this rank's KV (heads [first, first + local)); returns bytes written and appends the
    keys it wrote to `written`.

    writes=False: a rank whose heads another rank already writes (a replicated KV head)."""
    local = kv.keys[0].shape[1]
    if not writes:
        return 0
    if first == 0 and local == total:
        size = store.put(key, kv)
        if written is not None:
            written.append(key)
        return size
    size = 0
    for i in range(local):
        size += store.put(head_key(key, first + i), _slice(kv, i, i + 1))
        if written is not None:
            written.append(head_key(key, first + i))
    return size


def get_heads(store: Any, key: str, first: int, last: int, total: int, expect_model_id: str | None = None,
              expect_config_hash: str | None = None, device: str | None = None) -> Any:
    """A GetResult with KV heads [first, last): from the whole payload, else from the head parts."""
    from components.kvstore.base import GetResult

    whole = store.get(key, expect_model_id, expect_config_hash, device=device)
    if whole.ok:
        kv = whole.kv
        if kv.keys[0].shape[1] != total:
            return GetResult(None, f"corrupt: payload holds {kv.keys[0].shape[1]} KV heads, the model has {total}")
        return whole if (first, last) == (0, total) else GetResult(_slice(kv, first, last), whole.reason)
    if whole.code != "missing":
        return whole
    parts = [store.get(head_key(key, h), expect_model_id, expect_config_hash, device=device)
             for h in range(first, last)]
    for head, part in zip(range(first, last), parts):
        if not part.ok:
            # missing in both forms: the whole payload's reason, which names the key
            return GetResult(None, f"{part.reason} (KV head {head} of {total})" if part.code != "missing"
                             else whole.reason)
    kvs = [p.kv for p in parts]
    import torch

    joined = PromptKV([torch.cat([kv.keys[i] for kv in kvs], dim=1) for i in range(kvs[0].num_layers)],
                      [torch.cat([kv.values[i] for kv in kvs], dim=1) for i in range(kvs[0].num_layers)],
                      kvs[0].token_ids, kvs[0].pos_reuse_len, kvs[0].neg_reuse_len, kvs[0].model_id,
                      kvs[0].config_hash, dict(kvs[0].meta))
    return GetResult(joined, parts[0].reason)


def delete_heads(store: Any, key: str, total: int) -> int:
    """Remove a row's KV in either form; returns how many payloads were removed."""
    return sum(bool(store.delete(k)) for k in [key] + [head_key(key, h) for h in range(total)])
