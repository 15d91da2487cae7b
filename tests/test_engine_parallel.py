"""Tensor + expert parallel engine on CPU: 2 and 4 gloo ranks against one process (tiny, float32).

Each rank loads only its slices (dummy weights drawn slice by slice), runs the same AR request and
the same DiT denoising, and writes what it saw; the test compares with the unsliced engine:
- prefill logits and DiT latents within 1e-5 relative, images >= 60 dB, AR tokens identical;
- each rank's exported KV is exactly its heads of the unsliced KV;
- KV moves across layouts: AR at TP2 -> DiT at TP1 and TP1 -> DiT at TP2 reuse exactly.
At 4 ranks the tiny model (2 KV heads, 4 query heads, 4 experts) replicates KV heads across ranks,
so both attention layouts are covered.
"""

from __future__ import annotations

import os
import pickle
import socket

import numpy as np
import pytest
import torch

from components.engine import Engine
from components.engine.ar import ARRequest, SamplingParams
from components.engine.dit import DiTRequest
from components.engine.kernels.decode import decode_mode
from components.engine.kvcache import PromptKV
from components.engine.parallel import kv_head_range
from components.runtime.parallel import ParallelContext
from components.engine.transformer import attention_mask

from . import parallel_targets
from .test_engine_helpers import psnr, random_image

PROMPT = "a red cat on a sofa"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    model = engine.model
    t = len(ids)
    slots = torch.arange(t).unsqueeze(0)
    none = torch.full((1, t), -1)
    positions = torch.arange(t, dtype=torch.float64).unsqueeze(-1).repeat(1, 2).unsqueeze(0)
    with torch.no_grad():
        hidden = model.forward_layers(model.embed_ids(torch.tensor([ids])), positions,
                                      attention_mask(slots, slots, none, none), None)
        return model.text_logits(hidden)[0]


def _run(engine: Engine, kv_override: PromptKV | None = None, use_override: bool = False) -> dict:
    ar = engine.generate_ar([ARRequest("r", PROMPT, [random_image(96, 64)], seed=1)], GREEDY)[0]
    kv = kv_override if use_override else ar.prompt_kv
    dit = engine.dit(DiTRequest(ar, [random_image(96, 64)], kv, steps=2, seed=1))
    return {"tokens": ar.generated_ids, "kv": ar.prompt_kv, "latents": dit.latents, "kv_path": dit.kv_path,
            "reason": dit.kv_reason, "image": np.asarray(dit.image), "logits": _text_logits(engine, ar.prompt_ids)}


def _rank(rank: int, world: int, port: int, outdir: str, full_kv_file: str | None) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the CPU cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        ctx = ParallelContext(rank, world, torch.device("cpu"))
        engine = Engine.load("tiny", tensor_parallel_size=world, parallel=ctx)
        override = None
        if full_kv_file:  # a TP1 AR's KV, this rank's heads of it
            full: PromptKV = pickle.load(open(full_kv_file, "rb"))
            attn = engine.model.model.layers[0].self_attn
            h0, h1 = kv_head_range(full.keys[0].shape[1], engine.config.num_attention_heads, world, rank)
            assert h1 - h0 == attn.num_kv_heads
            override = PromptKV([k[:, h0:h1] for k in full.keys], [v[:, h0:h1] for v in full.values],
                                full.token_ids, full.pos_reuse_len, full.neg_reuse_len, full.model_id, full.config_hash)
        out = _run(engine, override, full_kv_file is not None)
        out["head_range"] = kv_head_range(engine.config.num_key_value_heads, engine.config.num_attention_heads, world, rank)
        out["decode_mode"] = decode_mode(engine.model)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path, full_kv_file: str | None = None) -> list[dict]:
    import torch.multiprocessing as mp

    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(world, _free_port(), str(tmp_path), full_kv_file), nprocs=world, join=True)
    return [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(world)]


@pytest.fixture(scope="module")
def single():
    return _run(Engine.load("tiny"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_ranks_match_one_process(single, world, tmp_path):
    ranks = _spawn(world, tmp_path)
    for r, out in enumerate(ranks):
        assert out["decode_mode"] == "plain"  # decode_graphs=auto on the CPU
        assert out["tokens"] == single["tokens"]
        rel = (out["logits"] - single["logits"]).abs().max() / single["logits"].abs().max()
        assert rel.item() <= 1e-5, f"rank {r}: logits differ by {rel.item():.2e} relative"
        lat_rel = (out["latents"] - single["latents"]).abs().max() / single["latents"].abs().max()
        assert lat_rel.item() <= 1e-5, f"rank {r}: latents differ by {lat_rel.item():.2e} relative"
        assert psnr(out["image"], single["image"]) >= 60
        assert out["kv_path"] == "reuse", out["reason"]
        h0, h1 = out["head_range"]
        for k_rank, k_full in zip(out["kv"].keys, single["kv"].keys):
            torch.testing.assert_close(k_rank, k_full[:, h0:h1], rtol=1e-5, atol=1e-5)
    # negative control: another model's logits are far outside the tolerance
    other = _text_logits(Engine.load("tiny", seed=7), [5, 6, 7, 8])
    assert (other - _text_logits(Engine.load("tiny"), [5, 6, 7, 8])).abs().max() > 1e-2


@pytest.mark.slow
def test_tensor_parallel_static_decode_matches_one_process(single, tmp_path, monkeypatch):
    """Tensor-parallel ranks run the static decode step (on a GPU, by default, CUDA graphs holding
    the layers' all-reduces; here eager with decode_graphs=on, all-reduces over gloo): the same
    tokens and K/V."""
    monkeypatch.setenv("ARDIT_KERNELS", "decode_graphs=on")  # the spawned ranks read it
    for out in _spawn(2, tmp_path):
        assert out["decode_mode"] == "eager"
        assert out["tokens"] == single["tokens"]
        h0, h1 = out["head_range"]
        for k_rank, k_full in zip(out["kv"].keys, single["kv"].keys):
            torch.testing.assert_close(k_rank, k_full[:, h0:h1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_kv_moves_between_layouts(single, tmp_path):
    """AR at TP2 -> DiT at TP1 (the ranks' head slices concatenated), and TP1 -> DiT at TP2."""
    ranks = _spawn(2, tmp_path / "tp2")
    parts = sorted(ranks, key=lambda o: o["head_range"])
    joined = PromptKV([torch.cat([p["kv"].keys[layer] for p in parts], dim=1) for layer in range(len(parts[0]["kv"].keys))],
                      [torch.cat([p["kv"].values[layer] for p in parts], dim=1) for layer in range(len(parts[0]["kv"].values))],
                      parts[0]["kv"].token_ids, parts[0]["kv"].pos_reuse_len, parts[0]["kv"].neg_reuse_len,
                      parts[0]["kv"].model_id, parts[0]["kv"].config_hash)
    tp1 = _run(Engine.load("tiny"), joined, use_override=True)
    assert tp1["kv_path"] == "reuse", tp1["reason"]
    assert (tp1["latents"] - single["latents"]).abs().max() / single["latents"].abs().max() <= 1e-5

    kv_file = tmp_path / "full_kv.pkl"
    with open(kv_file, "wb") as f:
        pickle.dump(single["kv"], f)
    for out in _spawn(2, tmp_path / "from_tp1", str(kv_file)):
        assert out["kv_path"] == "reuse", out["reason"]
        assert (out["latents"] - single["latents"]).abs().max() / single["latents"].abs().max() <= 1e-5


@pytest.mark.slow
def test_cfg_parallel_dit_matches_one_process(single, tmp_path):
    """4 ranks as two tensor-parallel groups of 2: one computes the cond row, the other the uncond
    row, and they trade predictions each step; the result equals the single-process CFG batch."""
    from components.runtime.ranks import run_on_ranks

    run_on_ranks(parallel_targets.engine_row, {"outdir": str(tmp_path)}, world_size=4, device="cpu",
                 cfg_parallel=True)
    outs = {p.name: pickle.load(open(p, "rb")) for p in tmp_path.glob("rank*.pkl")}
    assert sorted(outs) == ["rank0_0.pkl", "rank0_1.pkl", "rank1_0.pkl", "rank1_1.pkl"]
    ref = single["latents"]
    for name, out in outs.items():
        assert out["kv_path"] == "reuse" and out["cache_rows"] == [1]  # one CFG row per group
        rel = (out["latents"] - ref).abs().max() / ref.abs().max()
        assert rel.item() <= 1e-5, f"{name}: {rel.item():.2e}"
        assert psnr(out["image"], single["image"]) >= 60


def _agree_rank(rank: int, world: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = ParallelContext(rank, world, torch.device("cpu"))
        # rank r reports r GiB peak and 3 - r retries: the record keeps the worst of each
        agreed = ctx.agree_max([rank << 30, 3 - rank]), ctx.agree_min(10 + rank)
        with open(os.path.join(outdir, f"agree{rank}.pkl"), "wb") as f:
            pickle.dump(agreed, f)
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_worst_value_of_each(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_agree_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert pickle.load(open(tmp_path / f"agree{rank}.pkl", "rb")) == ([1 << 30, 3], 10)
    assert ParallelContext(0, 1, torch.device("cpu")).agree_max([5, 7]) == [5, 7]  # one rank: as given


@pytest.mark.parametrize("failing_rank", [None, 0, 1])
def test_tensor_parallel_ranks_agree_on_each_decode_graph(failing_rank):
    """A decode graph under tensor parallelism holds the layers' all-reduces, so the ranks must all
    replay it or all run the step eagerly: one rank's failed capture sends every rank to the eager
    step (each counts a fallback); captures are thread-local (NCCL's watchdog polls meanwhile)."""
    from components.runtime.ranks import run_on_ranks

    got = run_on_ranks(parallel_targets.decode_graph_agreement, {"failing_rank": failing_rank},
                       world_size=2, device="cpu")
    if failing_rank is None:
        expected = {"out": [0.0], "kept_anywhere": 1, "graphs_anywhere": 1, "fallbacks": 0}  # replayed
    else:
        expected = {"out": [1.0], "kept_anywhere": 0, "graphs_anywhere": 0, "fallbacks": 1}  # eager
    assert got == {"modes": ["thread_local"], **expected}
