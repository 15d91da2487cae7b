"""KV heads across parallel layouts through a real store (the local backend)."""

from __future__ import annotations

import torch

from components.engine.kvcache import PromptKV
from components.kvparts import delete_heads, get_heads, head_key, put_heads
from components.kvstore import open_store


def _kv(heads: int = 4, tokens: int = 7, layers: int = 2) -> PromptKV:
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(tokens, heads, 8, generator=g) for _ in range(layers)]
    values = [torch.randn(tokens, heads, 8, generator=g) for _ in range(layers)]
    return PromptKV(keys, values, list(range(tokens)), tokens, 3, "tiny", "abc")


def _heads(kv: PromptKV, a: int, b: int) -> PromptKV:
    return PromptKV([k[:, a:b] for k in kv.keys], [v[:, a:b] for v in kv.values], kv.token_ids, kv.pos_reuse_len,
                    kv.neg_reuse_len, kv.model_id, kv.config_hash)


def _same(a: PromptKV, b: PromptKV) -> None:
    assert a.token_ids == b.token_ids and (a.pos_reuse_len, a.neg_reuse_len) == (b.pos_reuse_len, b.neg_reuse_len)
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert torch.equal(x, y)


def test_tp1_writer_feeds_any_reader_layout(tmp_path):
    store = open_store(f"local://{tmp_path}")
    full = _kv()
    put_heads(store, "run/0/row", full, first=0, total=4)
    assert store.exists("run/0/row") and not store.exists(head_key("run/0/row", 0))
    for first, last in [(0, 4), (0, 2), (2, 4), (3, 4)]:
        got = get_heads(store, "run/0/row", first, last, 4, "tiny", "abc")
        assert got.ok, got.reason
        _same(got.kv, _heads(full, first, last))


def test_tp4_writers_feed_tp2_and_tp1_readers(tmp_path):
    store = open_store(f"local://{tmp_path}")
    full = _kv()
    for rank in range(4):  # each rank writes its own head, nothing gathered through one host
        put_heads(store, "run/0/row", _heads(full, rank, rank + 1), first=rank, total=4)
    assert not store.exists("run/0/row")
    _same(get_heads(store, "run/0/row", 0, 4, 4).kv, full)  # a TP1 reader
    _same(get_heads(store, "run/0/row", 2, 4, 4).kv, _heads(full, 2, 4))  # rank 1 of a TP2 reader
    # a replicated head written once: the second holder does not write
    assert put_heads(store, "run/0/other", _heads(full, 0, 1), first=0, total=4, writes=False) == 0


def test_a_missing_head_part_means_recompute_with_the_reason(tmp_path):
    store = open_store(f"local://{tmp_path}")
    full = _kv()
    for head in (0, 1, 3):
        put_heads(store, "run/0/row", _heads(full, head, head + 1), first=head, total=4)
    assert get_heads(store, "run/0/row", 0, 2, 4).ok  # the heads a TP2 rank 0 needs are there
    missing = get_heads(store, "run/0/row", 2, 4, 4)
    # the DiT's "KV missing" row reason names the key (it used to say only "missing")
    assert not missing.ok and missing.code == "missing" and "run/0/row" in missing.reason, missing.reason
    absent = get_heads(store, "run/0/never", 0, 4, 4)
    assert absent.code == "missing" and "run/0/never" in absent.reason, absent.reason
    wrong_model = get_heads(store, "run/0/row", 0, 2, 4, expect_model_id="other")
    assert not wrong_model.ok and wrong_model.code == "model_mismatch" and "KV head 0 of 4" in wrong_model.reason


def test_delete_removes_both_forms(tmp_path):
    store = open_store(f"local://{tmp_path}")
    full = _kv()
    put_heads(store, "run/0/a", full, 0, 4)
    for head in range(4):
        put_heads(store, "run/0/b", _heads(full, head, head + 1), head, 4)
    assert delete_heads(store, "run/0/a", 4) == 1 and delete_heads(store, "run/0/b", 4) == 4
    assert store.keys("run/") == []


def test_delete_removes_layer_parts_and_asks_the_store_once_which_form_is_there(tmp_path):
    from components.kvstore.local import LocalStore

    class Counting(LocalStore):
        def __init__(self, root):
            super().__init__(root)
            self.batch_queries, self.deletes = 0, []

        def exists_many(self, keys):
            self.batch_queries += 1
            return super().exists_many(keys)

        def delete(self, key):
            self.deletes.append(key)
            return super().delete(key)

    store = Counting(tmp_path)
    full = _kv(layers=2)
    put_heads(store, "run/0/pp", full, 0, 4, layers=range(0, 1), total_layers=2)  # two pipeline stages
    put_heads(store, "run/0/pp", _kv(layers=1), 0, 4, layers=range(1, 2), total_layers=2)
    put_heads(store, "run/0/pptp", _heads(_kv(layers=1), 0, 2), 0, 4, layers=range(1, 2), total_layers=2)
    assert delete_heads(store, "run/0/pp", 4, total_layers=2) == 2
    assert store.batch_queries == 1 and store.deletes == ["run/0/pp.l0", "run/0/pp.l1"]  # only what is there
    assert delete_heads(store, "run/0/pptp", 4, total_layers=2) == 2
    assert store.keys("run/") == []
