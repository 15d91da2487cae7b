"""Pipeline-parallel engine on CPU: 2 gloo stages (and 2 stages x TP2) against one process (tiny, float32).

Each stage holds its decoder layers only (the others are never read or drawn), hands its hidden
states to the next stage, and every stage returns the last stage's output; the test compares with
the unsliced engine:
- AR tokens identical, each stage's exported K/V exactly its layers (and heads) of the one-process K/V;
- DiT latents within 1e-5 relative and images >= 60 dB, through the reuse and the recompute path;
- K/V moves across layouts: a TP1 AR's K/V feeds a PP2 DiT (reuse, same image) and PP2's stage
  parts joined feed a TP1 DiT.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from components.engine import Engine
from components.engine.ar import ARRequest, SamplingParams
from components.engine.dit import DiTRequest
from components.engine.kvcache import PromptKV
from components.engine.parallel import stage_layers
from components.runtime.ranks import run_on_ranks

from . import parallel_targets
from .test_engine_helpers import psnr, random_image


def _reference(kv: PromptKV | None = None, use: bool = False) -> dict:
    torch.manual_seed(0)
    engine = Engine.load("tiny")
    image = random_image(96, 64)
    ar = engine.generate_ar([ARRequest("r", "a red cat on a sofa", [image], seed=1)],
                            SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    reuse = engine.dit(DiTRequest(ar, [image], kv if use else ar.prompt_kv, steps=2, guidance_scale=5.0, seed=1))
    return {"tokens": ar.generated_ids, "kv": ar.prompt_kv, "latents": reuse.latents, "kv_path": reuse.kv_path,
            "reason": reuse.kv_reason, "image": np.asarray(reuse.image)}


@pytest.fixture(scope="module")
def single():
    return _reference()


def _stages(tmp_path, tp: int, pp: int, kv_file: str | None = None) -> dict[tuple[int, int], dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_on_ranks(parallel_targets.pipeline_row, {"outdir": str(tmp_path), "kv_file": kv_file},
                 world_size=tp, device="cpu", pipeline_parallel_size=pp)
    return {(s, r): pickle.load(open(tmp_path / f"rank{s}_{r}.pkl", "rb")) for s in range(pp) for r in range(tp)}


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_stage_handoffs_carry_their_dtype_and_shape(tmp_path):
    """A stage allocates what actually comes (a stage's output may be wider than its own input;
    NCCL send/recv of unequal byte counts would hang instead of failing)."""
    run_on_ranks(parallel_targets.stage_handoffs, {"outdir": str(tmp_path)}, world_size=1, device="cpu",
                 pipeline_parallel_size=2)
    first, last = (pickle.load(open(tmp_path / f"stage{s}.pkl", "rb")) for s in range(2))
    received = last["received"]
    assert received.dtype == torch.bfloat16 and torch.equal(received, torch.arange(30, dtype=torch.bfloat16).view(2, 3, 5))
    for got in (first, last):
        assert got["broadcast"].dtype == torch.float32 and got["broadcast"].tolist() == [1.5, 2.5, 3.5, 4.5]


@pytest.mark.parametrize("tp,pp", [(1, 3), (2, 2)])
def test_stage_links_opened_at_start_leave_nothing_behind(tmp_path, tp, pp):
    """Every stage opens its links of both directions at start-up (`open_stage_links`: NCCL made the
    way back lazily and hung the 80B model at --pp 2); what the opening sent must all be received
    then, so the first real hand-offs and the way back carry their own values."""
    import json

    run_on_ranks(parallel_targets.stage_round_trip, {"outdir": str(tmp_path)}, world_size=tp, device="cpu",
                 pipeline_parallel_size=pp)
    assert [json.load(open(tmp_path / f"tp{r}.json")) for r in range(tp)] == [float(pp)] * tp


def test_stage_layers_are_contiguous_and_cover_the_model():
    assert [stage_layers(32, 2, s) for s in range(2)] == [range(0, 16), range(16, 32)]
    assert [stage_layers(5, 3, s) for s in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError, match="at most 2 stages"):
        stage_layers(2, 3, 0)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_pipeline_stages_match_one_process(single, tmp_path, tp, pp):
    from components.engine.parallel import kv_head_range

    for (stage, rank), out in _stages(tmp_path, tp, pp).items():
        layers = out["layers"]
        assert layers == stage_layers(2, pp, stage)  # tiny: 2 decoder layers, one a stage
        assert out["tokens"] == single["tokens"]
        h0, h1 = kv_head_range(2, 4, tp, rank)
        assert out["kv"].num_layers == len(layers)
        for k_stage, layer in zip(out["kv"].keys, layers):
            torch.testing.assert_close(k_stage, single["kv"].keys[layer][:, h0:h1], rtol=1e-5, atol=1e-5)
        for path in ("reuse", "recompute"):
            latents, image, kv_path = out[path][:3]
            assert kv_path == path, out[path]
            assert _close(latents, single["latents"]) <= 1e-5, (stage, rank, path)
            assert psnr(image, single["image"]) >= 60


@pytest.mark.slow
def test_pipeline_stages_static_decode_matches_one_process(single, tmp_path, monkeypatch):
    """With decode_graphs=on each stage runs the static decode step over its own layers, the hand-offs
    outside it (on a GPU a CUDA graph of the stage's layers; eager here): same tokens and K/V."""
    monkeypatch.setenv("ARDIT_KERNELS", "decode_graphs=on")  # the spawned ranks read it
    for (stage, _), out in _stages(tmp_path, 1, 2).items():
        assert out["tokens"] == single["tokens"]
        for k_stage, layer in zip(out["kv"].keys, out["layers"]):
            torch.testing.assert_close(k_stage, single["kv"].keys[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_pipeline_stages_compiled_decode_matches_one_process(single, tmp_path, monkeypatch):
    """With compile=on each stage's static decode step runs its layers through the compiled regions
    (aot_eager here: dynamo's graphs, no C++ build), the hand-offs outside them: same tokens and K/V."""
    monkeypatch.setenv("ARDIT_KERNELS", "decode_graphs=on,compile=on")  # the spawned ranks read them
    monkeypatch.setenv("ARDIT_COMPILE_BACKEND", "aot_eager")
    for (stage, _), out in _stages(tmp_path, 1, 2).items():
        assert out["tokens"] == single["tokens"]
        assert out["compiled_decode"]
        for k_stage, layer in zip(out["kv"].keys, out["layers"]):
            torch.testing.assert_close(k_stage, single["kv"].keys[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_kv_moves_between_pipeline_and_one_process(single, tmp_path):
    """A TP1 AR's K/V feeds PP2 stages (each takes its layers) and reuses exactly; the PP2 stages'
    K/V, joined in layer order, feeds a TP1 DiT."""
    kv_file = tmp_path / "tp1_kv.pkl"
    with open(kv_file, "wb") as f:
        pickle.dump(single["kv"], f)
    stages = _stages(tmp_path / "from_tp1", 1, 2, str(kv_file))
    for out in stages.values():
        assert out["reuse"][2] == "reuse", out["reuse"]
        assert _close(out["reuse"][0], single["latents"]) <= 1e-5
    parts = [stages[(s, 0)]["kv"] for s in range(2)]
    joined = PromptKV([k for p in parts for k in p.keys], [v for p in parts for v in p.values], parts[0].token_ids,
                      parts[0].pos_reuse_len, parts[0].neg_reuse_len, parts[0].model_id, parts[0].config_hash)
    tp1 = _reference(joined, use=True)
    assert tp1["kv_path"] == "reuse", tp1["reason"]
    assert _close(tp1["latents"], single["latents"]) <= 1e-5
    # negative control: one stage's K/V alone is no model's K/V
    assert _reference(parts[0], use=True)["kv_path"] == "recompute"


@pytest.mark.slow
def test_the_wavefront_over_rows_equals_row_by_row(tmp_path):
    """Four rows (different prompts and sizes, one recomputing its prefix) denoised together through
    the pipeline schedule give exactly the latents and images each gets alone (stage 0 writes the
    images stage 1 decoded; the prefixes go through the stages without waiting); the rows differ,
    so a row given another's latents, cache or step would show."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_on_ranks(parallel_targets.pipeline_group, {"outdir": str(tmp_path)}, world_size=1, device="cpu",
                 pipeline_parallel_size=2)
    for stage in range(2):
        out = pickle.load(open(tmp_path / f"rank{stage}_0.pkl", "rb"))
        assert out["paths"] == ["reuse"] * 3 + ["recompute"] and out["in_flight"] == 4
        # the recomputed row's image is encoded by stage 0 only (stage 1 receives hidden states)
        assert out["vae_encodes"] == (1 if stage == 0 else 0), (stage, out["vae_encodes"])
        for together, alone in zip(out["together"], out["alone"]):
            assert torch.equal(together, alone)
        # the VAE decodes are shared out (row i on stage i mod 2); stage 0 gets every image
        for i, (image, alone) in enumerate(zip(out["images"], out["alone_images"])):
            if stage == 0 or i % 2 == stage:
                assert image is not None and np.array_equal(image, alone), (stage, i)
            else:
                assert image is None
        rows = out["alone"]  # negative control: the rows differ (in shape or values) from each other
        assert len({tuple(r.shape) for r in rows}) > 1
        assert all(x.shape != y.shape or (x - y).abs().max() > 0.1 for i, x in enumerate(rows) for y in rows[i + 1:])


@pytest.mark.slow
@pytest.mark.parametrize("tp,row_groups", [(1, "auto"), (2, "auto"), (1, "off")])
def test_the_ar_scheduler_keeps_a_row_group_in_each_stage(tmp_path, tp, row_groups):
    """Under 2 stages (and 2 stages x TP2) the scheduler decodes two row groups in turn, each stage working on one
    group's step while the other stage works on the other's: rows joining and leaving (forced CoT
    lengths, 4 of 8 rows in flight; two rows take their first token from their prefill's logits;
    the two edit rows' images encoded one on each stage) get the one-process scheduler's tokens, and
    each stage's exported K/V are its layers of the one-process K/V."""
    from components.engine.ar import ForcedCot
    from components.engine.ar_scheduler import Admission

    from .parallel_targets import scheduler_rows
    from .test_ar_scheduler import CHUNK, FORCED, GREEDY

    engine = Engine.load("tiny", seed=0)
    engine.ar.forced_cot = ForcedCot(FORCED)
    single: dict = {}
    engine.ar.stream(scheduler_rows(), lambda req, out: single.__setitem__(req.id, out), GREEDY,
                     admission=Admission(max_rows=4, max_num_batched_tokens=CHUNK))
    from components.engine.parallel import kv_head_range

    run_on_ranks(parallel_targets.pipeline_scheduler, {"outdir": str(tmp_path), "row_groups": row_groups},
                 world_size=tp, device="cpu", pipeline_parallel_size=2)
    groups = 2 if row_groups == "auto" else 1  # off: one group, each forward through the stages in turn
    encoded = []
    for stage, rank in [(s, r) for s in range(2) for r in range(tp)]:
        out = pickle.load(open(tmp_path / f"rank{stage}_{rank}.pkl", "rb"))
        h0, h1 = kv_head_range(2, 4, tp, rank)
        if rank == 0:
            encoded.append(out["stats"]["images_encoded"])
        stats = out["stats"]
        assert stats["rows"] == 8 and stats["failed"] == 1, stats
        assert stats["row_groups"] == groups and stats["peak_steps_in_flight"] == groups, stats
        assert list(out["errors"]) == ["broken"] and "broken" not in out["tokens"]
        assert len({len(t) for t in out["tokens"].values()}) >= 3  # rows leave at different steps
        for row_id, one in single.items():
            if row_id == "broken":  # fails alone too, on every stage, and the others go on
                assert isinstance(one, Exception)
                continue
            assert out["tokens"][row_id] == one.generated_ids, (stage, row_id)
            kv, ref = out["kv"][row_id], one.prompt_kv
            if ref is None:  # the text answer: no image, no K/V
                assert kv is None and row_id == "answer"
                continue
            assert kv.num_layers == len(out["layers"])
            for i, layer in enumerate(out["layers"]):
                torch.testing.assert_close(kv.keys[i], ref.keys[layer][:, h0:h1], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(kv.values[i], ref.values[layer][:, h0:h1], rtol=1e-5, atol=1e-5)
    if groups == 2:  # the two edit rows' images: one encoded on each stage, stage 0 embeds both
        assert encoded == [1, 1]
