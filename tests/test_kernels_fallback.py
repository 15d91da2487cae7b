"""A fast kernel path that fails on some shape falls back to the plain path for that shape
(`kernels.run_fast`): same result, counted in `kernels.fallbacks()`, never retried at that shape,
never a failed row; errors that are not the kernel's (out of memory, a lost rank) still raise.

The failures are injected where the compiler would raise them (a real InductorError wrapping a
NoValidChoicesError, as the 2xH100 TP2 run of issue 18 saw from flex attention), on the CPU.
"""

from __future__ import annotations

import os
import pickle

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from components.engine import kernels
from components.engine.kernels import attention as flex_kernels
from components.engine.kernels import compiled_layers
from components.engine.kernels import RankLost
from components.runtime.parallel import ParallelContext
from components.engine.transformer import SlotMask, attend

from .step_config import step_config
from .test_engine_parallel import _free_port


def inductor_error() -> Exception:
    from torch._inductor.exc import InductorError
    from torch._inductor.select_algorithm import NoValidChoicesError

    return InductorError(NoValidChoicesError("No choices to select ... target: flex_attention"), None)


@pytest.fixture(autouse=True)
def clean_fallbacks():
    kernels.reset_fallbacks()
    previous = kernels.configure()
    yield
    kernels.configure(previous)
    kernels.reset_fallbacks()


def image_mask(t: int) -> SlotMask:
    """T queries over T keys, causal with one image block (not plain causal: flex's case)."""
    blocks = torch.full((t,), -1)
    blocks[2:t - 2] = 0
    slots = torch.arange(t)
    return SlotMask(slots.view(1, -1), slots.view(1, -1), blocks.view(1, -1), blocks.view(1, -1))


def qkv(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, t, 16, generator=g), torch.randn(1, 2, t, 16, generator=g),
            torch.randn(1, 2, t, 16, generator=g))


def failing_at(lengths: set[int], error: Exception, calls: list[int]):
    real = flex_kernels.flex_attend

    def flex_attend(q, k, v, mask):
        calls.append(q.shape[2])
        if q.shape[2] in lengths:
            raise error
        return real(q, k, v, mask)
    return flex_attend


def test_a_failing_flex_shape_falls_back_once_and_other_shapes_still_try(monkeypatch, capfd):
    kernels.configure(attention="flex")
    calls: list[int] = []
    monkeypatch.setattr(flex_kernels, "flex_attend", failing_at({12}, inductor_error(), calls))
    q, k, v = qkv(12)
    mask = image_mask(12)
    out = attend(q, k, v, mask)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=True)
    assert torch.equal(out, plain)
    assert kernels.fallbacks() == 1 and "NoValidChoicesError" in kernels.first_error()
    assert "kernel fallback" in capfd.readouterr().err  # the first error, once, in the log
    attend(q, k, v, image_mask(12))  # same shape: straight to the plain path
    assert calls == [12] and kernels.fallbacks() == 1
    q2, k2, v2 = qkv(600)  # another length bucket still takes flex
    out2 = attend(q2, k2, v2, image_mask(600))
    assert calls == [12, 600] and kernels.fallbacks() == 1
    ref2 = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=image_mask(600).dense(), enable_gqa=True)
    assert (out2 - ref2).abs().max().item() < 1e-4
    assert capfd.readouterr().err == ""  # no second log line


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), RankLost("peer died"),
                                   ValueError("row 3: bad input")], ids=["oom", "rank_lost", "bad_input"])
def test_errors_that_are_not_the_kernels_are_raised(monkeypatch, error):
    kernels.configure(attention="flex")
    monkeypatch.setattr(flex_kernels, "flex_attend", failing_at({12}, error, []))
    q, k, v = qkv(12)
    with pytest.raises(type(error), match=str(error)):
        attend(q, k, v, image_mask(12))
    assert kernels.fallbacks() == 0


def test_auto_takes_flex_only_where_it_pays(monkeypatch):
    """attention=auto (CUDA bf16's default): SDPA below FLEX_MIN_PAIRS, flex above; flex forces it."""
    calls: list[int] = []
    monkeypatch.setattr(flex_kernels, "flex_attend", failing_at(set(), inductor_error(), calls))
    monkeypatch.setattr(kernels, "fast_device", lambda t: True)  # as CUDA bf16 would be
    q, k, v = qkv(40)
    attend(q, k, v, image_mask(40))
    assert calls == []
    monkeypatch.setattr(flex_kernels, "FLEX_MIN_PAIRS", 40 * 40)
    attend(q, k, v, image_mask(40))
    assert calls == [40]


def test_a_failing_compiled_region_runs_the_layers_plainly(monkeypatch):
    from .test_engine_helpers import tiny_engine

    model = tiny_engine().model
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5, dtype=torch.float64).view(1, -1, 1).expand(1, -1, 2)
    tries: list[int] = []

    def broken(layer, x, cos, sin, mask, cache, index, prefill=False):
        tries.append(index)
        raise inductor_error()

    monkeypatch.setattr(compiled_layers, "layer_step", broken)
    with torch.no_grad():
        plain = model.forward_layers(x, pos, None, None)
        fast = model.forward_layers(x, pos, None, None, compiled=True)
        assert torch.equal(fast, plain) and kernels.fallbacks() == 1 and tries == [0]
        model.forward_layers(x, pos, None, None, compiled=True)
        assert tries == [0] and kernels.fallbacks() == 1  # not retried at this shape
        model.forward_layers(x[:, :4], pos[:, :4], None, None, compiled=True)
        assert tries == [0, 0]  # another shape tries the compiled parts again
        # prompt chunks: one graph for every length, so one failure sends every length the plain way
        for n in (5, 3, 4):
            chunk = model.forward_layers(x[:, :n], pos[:, :n], None, None, compiled=True, prefill=True)
            assert torch.equal(chunk, model.forward_layers(x[:, :n], pos[:, :n], None, None))
        assert tries == [0, 0, 0] and kernels.fallbacks() == 3


def _rank(rank: int, world: int, port: int, outdir: str) -> None:
    """A TP rank whose compiled layer regions fail on rank 1 only."""
    import torch.distributed as dist

    from components.engine import Engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = ParallelContext(rank, world, torch.device("cpu"))
        model = Engine.load("tiny", tensor_parallel_size=world, parallel=ctx).model
        real = compiled_layers.layer_step
        tries: list[bool] = []

        def layer_step(layer, x, cos, sin, mask, cache, index, prefill=False):
            tries.append(ctx.local_only)  # compiled parts run with collectives off only in the trial
            if rank == 1:
                raise inductor_error()
            return real(layer, x, cos, sin, mask, cache, index, prefill)

        compiled_layers.layer_step = layer_step
        compiled_layers.BACKEND = "eager"  # dynamo's graphs without a backend compile (CPU CI)
        x = torch.randn(1, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
        pos = torch.arange(6, dtype=torch.float64).view(1, -1, 1).expand(1, -1, 2)
        with torch.no_grad():
            fast = model.forward_layers(x, pos, None, None, compiled=True)
            plain = model.forward_layers(x, pos, None, None)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump({"fast": fast, "plain": plain, "fallbacks": kernels.fallbacks(), "tries": tries}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_ranks_agree_to_fall_back_together(tmp_path):
    """Rank 1's compiled parts fail, rank 0's work: both run the plain layers (their all-reduces
    pair up: no hang) and get the same output as the plain path."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(2)]
    for r in ranks:
        assert r["fallbacks"] == 1
        assert torch.equal(r["fast"], r["plain"])
    assert torch.equal(ranks[0]["fast"], ranks[1]["fast"])
    assert ranks[0]["tries"] and all(ranks[0]["tries"])  # rank 0 ran its compiled parts in the trial only
    assert ranks[1]["tries"] == [True]


@pytest.mark.slow
def test_kernel_fallbacks_reach_the_rows_and_the_summary(tmp_path, monkeypatch):
    """A job whose flex attention fails at every shape: every row ok, the fallbacks counted per
    step, per row (rows.parquet) and in summary.json."""
    from components.ar.run import run as run_ar
    from components.data.sample import write_sample_edit_dataset
    from components.dit.run import run as run_dit
    from components.shard.run import run as run_shard
    from components.models import model_validators
    from components.summary.run import run as run_summary

    from .test_engine_helpers import stub_vae_decode

    stub_vae_decode(monkeypatch)
    calls: list[int] = []
    monkeypatch.setattr(flex_kernels, "flex_attend", failing_at(set(range(1 << 16)), inductor_error(), calls))
    kernels.configure(attention="flex")
    dataset = write_sample_edit_dataset(str(tmp_path / "data"), n=2, size=64, seed=7)
    output, run_id = str(tmp_path / "out"), "fallbacks"
    count_tokens, is_supported_size, max_tokens = model_validators("tiny")
    run_shard(dataset, output, run_id, 1, "edit", count_tokens=count_tokens, is_supported_size=is_supported_size,
              max_prompt_tokens=max_tokens)
    ar = run_ar(step_config(output, run_id, max_new_tokens=6), 0)
    dit = run_dit(step_config(output, run_id, steps=2), 0)
    assert calls, "flex attention was never asked for: the test would prove nothing"
    assert ar["errors"] == 0 and ar["kernel_fallbacks"] >= 1 and dit["kernel_fallbacks"] >= 1
    rows = pq.read_table(tmp_path / "out" / run_id / "shards" / "0" / "rows.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert sum(r["kernel_fallbacks"] for r in rows) == ar["kernel_fallbacks"] + dit["kernel_fallbacks"]
    summary = run_summary(output, run_id)
    assert summary["rows_ok"] == 2 and summary["rows_failed"] == 0
    assert summary["kernel_fallbacks"] == ar["kernel_fallbacks"] + dit["kernel_fallbacks"]
    assert summary["shards"][0]["kernel_fallbacks"] == summary["kernel_fallbacks"]
