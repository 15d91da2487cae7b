"""Prompt KV across parallel layouts: each rank stores and fetches only its own KV heads and layers.

The payload stays layout-independent (full head order, one head per part; one layer per part),
so an AR step at TP4 or PP2 feeds a DiT step at TP2, TP1 or PP2 without gathering the KV through
one host:

    AR at TP1:            one payload at `key` (all heads, all layers), as always
    AR at TP N > 1:       one payload per KV head at `key.h{i}` (ranks that share a replicated head:
                          the first of them writes it)
    AR at PP P > 1:       one payload per decoder layer at `key.l{j}` (TP1 stages), or per layer and
                          KV head at `key.l{j}.h{i}` (stages of TP > 1): each stage writes its layers
    DiT at any layout:    the heads [first, last) of the layers it holds: sliced from `key` when that
                          exists, else joined from whichever form of parts the AR wrote

Deleting a row's KV removes every form.
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


def rank_layers(engine: Any) -> range:
    """The decoder layers this rank's engine holds (its pipeline stage's; all of them without PP)."""
    return engine.model.stage_layers


def head_key(key: str, head: int) -> str:
    return f"{key}.h{head}"


def layer_key(key: str, layer: int, head: int | None = None) -> str:
    """The part of one decoder layer (all KV heads), or of one layer and one KV head."""
    return f"{key}.l{layer}" if head is None else f"{key}.l{layer}.h{head}"


def slice_kv(kv: PromptKV, first: int, last: int, layers: range | None = None) -> PromptKV:
    """KV heads [first, last) of `kv`, and of its layers `layers` only (indices into kv's layers)."""
    layers = range(kv.num_layers) if layers is None else layers
    return PromptKV([kv.keys[i][:, first:last] for i in layers], [kv.values[i][:, first:last] for i in layers],
                    kv.token_ids, kv.pos_reuse_len, kv.neg_reuse_len, kv.model_id, kv.config_hash, dict(kv.meta))


def _join(kvs: list[PromptKV], dim: int) -> PromptKV:
    """Parts side by side: along the heads (dim 1) or as consecutive layers (dim None)."""
    import torch

    first = kvs[0]
    if dim is None:
        keys = [k for kv in kvs for k in kv.keys]
        values = [v for kv in kvs for v in kv.values]
    else:
        keys = [torch.cat([kv.keys[i] for kv in kvs], dim=dim) for i in range(first.num_layers)]
        values = [torch.cat([kv.values[i] for kv in kvs], dim=dim) for i in range(first.num_layers)]
    return PromptKV(keys, values, first.token_ids, first.pos_reuse_len, first.neg_reuse_len, first.model_id,
                    first.config_hash, dict(first.meta))


def put_heads(store: Any, key: str, kv: PromptKV, first: int, total: int, writes: bool = True,
              written: list[str] | None = None, layers: range | None = None, total_layers: int | None = None) -> int:
    """Store this rank's KV (heads [first, first + local) of the decoder layers `layers`, all by
    default); returns bytes written and appends the keys it wrote to `written`.

    writes=False: a rank whose heads another rank already writes (a replicated KV head)."""
    local = kv.keys[0].shape[1]
    if not writes:
        return 0
    parts: list[tuple[str, PromptKV]]
    all_layers = layers is None or len(layers) == (total_layers or kv.num_layers)
    if all_layers and first == 0 and local == total:
        parts = [(key, kv)]
    elif all_layers:
        parts = [(head_key(key, first + i), slice_kv(kv, i, i + 1)) for i in range(local)]
    elif local == total:  # a pipeline stage at TP1: one part per layer
        parts = [(layer_key(key, layer), slice_kv(kv, 0, total, range(j, j + 1))) for j, layer in enumerate(layers)]
    else:  # a pipeline stage's tensor-parallel rank: one part per layer and KV head
        parts = [(layer_key(key, layer, first + i), slice_kv(kv, i, i + 1, range(j, j + 1)))
                 for j, layer in enumerate(layers) for i in range(local)]
    size = 0
    for part_key, part in parts:
        size += store.put(part_key, part)
        if written is not None:
            written.append(part_key)
    return size


def get_heads(store: Any, key: str, first: int, last: int, total: int, expect_model_id: str | None = None,
              expect_config_hash: str | None = None, device: str | None = None, layers: range | None = None,
              total_layers: int | None = None) -> Any:
    """A GetResult with KV heads [first, last) of the decoder layers `layers` (all by default): from
    the whole payload, else from the parts of a tensor- or pipeline-parallel AR."""
    from components.kvstore.base import GetResult

    def get(k: str):
        return store.get(k, expect_model_id, expect_config_hash, device=device)

    whole = get(key)
    if whole.ok:
        kv = whole.kv
        if kv.keys[0].shape[1] != total:
            return GetResult(None, f"corrupt: payload holds {kv.keys[0].shape[1]} KV heads, the model has {total}")
        if total_layers is not None and kv.num_layers != total_layers:
            return GetResult(None, f"corrupt: payload holds {kv.num_layers} layers, the model has {total_layers}")
        if (first, last) == (0, total) and (layers is None or len(layers) == kv.num_layers):
            return whole
        return GetResult(slice_kv(kv, first, last, layers), whole.reason)
    if whole.code != "missing":
        return whole

    def gather(keys: list[str], what: list[str]):
        """Every part, or the first problem (None: the first part is missing, try another form)."""
        got = []
        for k, name in zip(keys, what):
            part = get(k)
            if not part.ok:
                if not got and part.code == "missing":
                    return None
                # missing in every form: the whole payload's reason, which names the key
                return GetResult(None, f"{part.reason} ({name})" if part.code != "missing" else whole.reason)
            got.append(part.kv)
        return got

    heads = range(first, last)
    by_head = gather([head_key(key, h) for h in heads], [f"KV head {h} of {total}" for h in heads])
    if isinstance(by_head, list):  # a tensor-parallel AR: every layer, one head a part
        joined = _join(by_head, 1)
        return GetResult(joined if layers is None else slice_kv(joined, 0, last - first, layers), "")
    if by_head is not None or layers is None and total_layers is None:
        return by_head or GetResult(None, whole.reason)
    layers = layers if layers is not None else range(total_layers)
    names = [f"layer {j}" for j in layers]
    by_layer = gather([layer_key(key, j) for j in layers], names)
    if isinstance(by_layer, list):  # a pipeline-parallel AR at TP1: one layer a part
        return GetResult(slice_kv(_join(by_layer, None), first, last), "")
    if by_layer is not None:
        return by_layer
    rows = []
    for j in layers:  # a pipeline-parallel AR at TP > 1: one layer and one head a part
        got = gather([layer_key(key, j, h) for h in heads], [f"layer {j}, KV head {h}" for h in heads])
        if not isinstance(got, list):
            return got or GetResult(None, whole.reason)
        rows.append(_join(got, 1))
    return GetResult(_join(rows, None), "")


def delete_heads(store: Any, key: str, total: int, total_layers: int = 0) -> int:
    """Remove a row's KV in every form; returns how many payloads were removed. One batch query
    finds the form the AR wrote first: the full model has 297 candidate keys a row, 32 of them there
    after an AR at PP (a delete each, e.g. two Mooncake calls, is worth saving)."""
    keys = [key] + [head_key(key, h) for h in range(total)]
    keys += [layer_key(key, j, h) for j in range(total_layers) for h in (None, *range(total))]
    return sum(bool(store.delete(k)) for k, there in zip(keys, store.exists_many(keys)) if there)
