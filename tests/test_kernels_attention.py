"""Flex attention with block masks (kernel setting `attention=flex`) and the compiled DiT step
(`compile=on`) against the plain paths, on the CPU in float32.

Flex attention runs eagerly off CUDA (the same block mask and mask_mod as the compiled GPU kernel),
so these tests check the mask plumbing exactly: for every mask kind the engine builds, flex with
the SlotMask's BlockMask gives SDPA's result with the dense mask. Negative controls show the
comparison notices a wrong mask. End to end, the tiny model under attention=flex keeps reuse ==
recompute and matches the SDPA path's images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from components.engine import ARRequest, DiTRequest, SamplingParams, kernels
from components.engine.kernels import attention as flex_kernels
from components.engine.transformer import HeadMask, SlotMask, attend, attention_mask

from .test_engine_helpers import psnr, random_image, tiny_engine

TOL = 1e-5


@pytest.fixture
def attention_setting():
    """Set the `attention` kernel setting inside a test; restored afterwards."""
    previous = kernels.settings()
    yield lambda value: kernels.configure(attention=value)
    kernels.configure(previous)


def _qkv(b: int, t: int, s: int, hq: int = 8, hkv: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, t, d, generator=g), torch.randn(b, hkv, s, d, generator=g),
            torch.randn(b, hkv, s, d, generator=g))


def _blocks(length: int, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    ids = torch.full((length,), -1, dtype=torch.long)
    for start, end, block in spans:
        ids[start:end] = block
    return ids


def ar_left_padded() -> SlotMask:
    """AR prefill of 3 rows of different lengths, left-padded to 300; row 1 holds a conditioning image."""
    lengths, total = [300, 171, 40], 300
    slots = torch.arange(total).expand(3, -1)
    blocks = torch.full((3, total), -1, dtype=torch.long)
    valid = torch.zeros(3, total, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, total - n:] = True
    blocks[1, 160:270] = 0
    blocks[0, 20:150] = 0
    return SlotMask(slots, slots, blocks, blocks, valid)


def dit_prefill(start: int) -> SlotMask:
    """DiT prefix prefill of [cond; uncond] over slots [start, 330) with a conditioning image at
    [30, 200): from token 0 (recompute) or on top of injected K/V (reuse, start > 0)."""
    end = 330
    blocks = _blocks(end, [(30, 200, 0)]).expand(2, -1)
    q = torch.arange(start, end).expand(2, -1)
    k = torch.arange(end).expand(2, -1)
    return SlotMask(q, k, blocks[:, start:], blocks)


def dit_first_step() -> SlotMask:
    """The whole DiT sequence in one forward: prefix with a conditioning image, <timestep>, then the
    generated image block (bidirectional, the last block)."""
    total, gen = 400, 250
    blocks = _blocks(total, [(30, 200, 0), (gen, total, 1)]).expand(2, -1)
    slots = torch.arange(total).expand(2, -1)
    return SlotMask(slots, slots, blocks, blocks)


def causal() -> SlotMask:
    slots = torch.arange(260).expand(2, -1)
    blocks = torch.full((2, 260), -1, dtype=torch.long)
    return SlotMask(slots, slots, blocks, blocks, torch.ones(2, 260, dtype=torch.bool))


MASKS = {"ar_left_padded": ar_left_padded, "dit_prefill_recompute": lambda: dit_prefill(0),
         "dit_prefill_reuse": lambda: dit_prefill(210), "dit_first_step": dit_first_step, "causal": causal}


# ------------------------------------------------------------------------------------------ masks
@pytest.mark.parametrize("kind", list(MASKS))
def test_slot_mask_dense_is_attention_mask(kind):
    mask = MASKS[kind]()
    dense = mask.dense()
    assert dense.dtype == torch.bool and dense.shape == mask.shape
    assert torch.equal(dense, attention_mask(mask.q_slots, mask.k_slots, mask.q_blocks, mask.k_blocks, mask.k_valid))
    assert mask.dense() is dense  # made once, shared by every layer


@pytest.mark.parametrize("kind", list(MASKS))
def test_block_mask_covers_exactly_the_dense_mask(kind):
    """Evaluating the BlockMask (its block structure + mask_mod) gives the dense mask, and its
    block structure skips tiles: only tiles with a visible pair are visited."""
    mask = MASKS[kind]()
    bm = mask.block_mask()
    assert mask.block_mask() is bm
    b, _, t, s = mask.shape
    q_idx, kv_idx = torch.arange(t)[:, None], torch.arange(s)[None, :]
    for row in range(b):
        visited = bm.to_dense()[row, 0].repeat_interleave(flex_kernels.BLOCK_SIZE, 0).repeat_interleave(
            flex_kernels.BLOCK_SIZE, 1)[:t, :s].bool()
        evaluated = bm.mask_mod(torch.tensor(row), torch.tensor(0), q_idx, kv_idx) & visited
        assert torch.equal(evaluated, mask.dense()[row, 0])
    if kind != "dit_prefill_reuse":  # 120 queries x 330 keys: every tile has visible pairs
        assert (bm.to_dense() == 0).any()
    # the same tiles as flex attention's own builder (vmap over the mask_mod)
    from torch.nn.attention.flex_attention import create_block_mask

    ref = create_block_mask(bm.mask_mod, b, None, t, s, device="cpu", BLOCK_SIZE=flex_kernels.BLOCK_SIZE)
    assert torch.equal(bm.to_dense(), ref.to_dense())
    assert torch.equal(bm.kv_num_blocks, ref.kv_num_blocks) and torch.equal(bm.full_kv_num_blocks, ref.full_kv_num_blocks)
    for ours, theirs, num in ((bm.kv_indices, ref.kv_indices, ref.kv_num_blocks),
                              (bm.full_kv_indices, ref.full_kv_indices, ref.full_kv_num_blocks)):
        used = torch.arange(ours.shape[-1]) < num[..., None]
        assert torch.equal(ours[used], theirs[used])


@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("heads", [(8, 2), (4, 1)])  # GQA; and one tensor-parallel rank's share
def test_flex_equals_sdpa(kind, heads, attention_setting):
    mask = MASKS[kind]()
    b, _, t, s = mask.shape
    q, k, v = _qkv(b, t, s, *heads)
    attention_setting("sdpa")
    plain = attend(q, k, v, mask)
    assert torch.equal(plain, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.dense(), enable_gqa=True))  # the plain path is SDPA with the bool mask
    attention_setting("flex")
    fast = attend(q, k, v, mask)
    assert fast.shape == plain.shape
    assert (fast - plain).abs().max().item() <= TOL


def test_flex_negative_control(attention_setting):
    """A mask that forgets the padding, or the image block, gives results far from SDPA's."""
    attention_setting("flex")
    right = ar_left_padded()
    q, k, v = _qkv(3, 300, 300)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=right.dense(), enable_gqa=True)
    assert (attend(q, k, v, right) - ref).abs().max().item() <= TOL
    no_padding = SlotMask(right.q_slots, right.k_slots, right.q_blocks, right.k_blocks, None)
    no_image = SlotMask(right.q_slots, right.k_slots, torch.full_like(right.q_blocks, -1),
                        torch.full_like(right.k_blocks, -1), right.k_valid)
    for wrong in (no_padding, no_image):
        assert (attend(q, k, v, wrong) - ref).abs().max().item() > 1e-2


def test_causal_rule_takes_causal_sdpa(attention_setting, monkeypatch):
    """A mask that is plain causal (T2I prefix: no image block, no padding) goes to causal SDPA, no
    block mask is made; any image block or padding key sends it to flex."""
    assert causal().is_causal()
    assert not any(MASKS[kind]().is_causal() for kind in MASKS if kind != "causal")
    made = []
    real_block_mask = flex_kernels.block_mask
    monkeypatch.setattr(flex_kernels, "block_mask", lambda *a, **kw: made.append(1))
    attention_setting("flex")
    mask = causal()
    q, k, v = _qkv(2, 260, 260)
    out = attend(q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=True)
    assert (out - ref).abs().max().item() <= TOL and not made
    monkeypatch.setattr(flex_kernels, "CAUSAL_SDPA", False)  # causal masks to flex as well
    mask = causal()
    monkeypatch.setattr(flex_kernels, "block_mask", real_block_mask)
    assert (attend(q, k, v, mask) - ref).abs().max().item() <= TOL and "block" in mask._made


def test_head_mask_step_equals_flex_full_mask(attention_setting):
    """The DiT cached step: HeadMask (masked <timestep> row + unmasked image rows, SDPA) == flex with
    the step's full SlotMask (the image block sees the whole prefix and itself)."""
    prefix, gen_end = 300, 400
    blocks = _blocks(gen_end, [(30, 200, 0), (prefix + 1, gen_end, 1)]).expand(2, -1)
    q_slots = torch.arange(prefix, gen_end).expand(2, -1)
    k_slots = torch.arange(gen_end).expand(2, -1)
    full = SlotMask(q_slots, k_slots, blocks[:, prefix:], blocks)
    head = HeadMask(attention_mask(q_slots[:, :1], k_slots, blocks[:, prefix:prefix + 1], blocks), rows=1)
    q, k, v = _qkv(2, gen_end - prefix, gen_end)
    attention_setting("flex")
    assert (attend(q, k, v, head) - attend(q, k, v, full)).abs().max().item() <= TOL
    # control: the <timestep> row must not see the image block
    wrong = HeadMask(torch.ones_like(head.mask), rows=1)
    assert (attend(q, k, v, wrong) - attend(q, k, v, full))[:, :, 0].abs().max().item() > 1e-2


def test_one_block_mask_per_forward(attention_setting, monkeypatch):
    """forward_layers over the 2-layer tiny stack makes the block mask once, for all layers."""
    engine = tiny_engine()
    model = engine.model
    made = []
    real = flex_kernels.block_mask
    monkeypatch.setattr(flex_kernels, "block_mask", lambda *a, **kw: made.append(1) or real(*a, **kw))
    attention_setting("flex")
    mask = dit_first_step()
    x = torch.randn(2, mask.shape[2], model.config.hidden_size)
    positions = torch.arange(mask.shape[2], dtype=torch.float64).view(1, -1, 1).expand(2, -1, 2)
    with torch.no_grad():
        fast = model.forward_layers(x, positions, mask, None)
        attention_setting("sdpa")
        plain = model.forward_layers(x, positions, mask, None)
    assert len(made) == 1 and len(model.model.layers) == 2
    assert (fast - plain).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------------ tiny end to end
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
IMG = random_image(160, 96, seed=1)


def _run(engine, value: str):
    """AR batch (an edit and a shorter T2I prompt, an image block) + DiT reuse and recompute of each
    row, under attention=value."""
    previous = kernels.configure(attention=value)
    try:
        reqs = [ARRequest("edit", "make the sky purple", [IMG], bot_task="think", seed=7),
                ARRequest("t2i", "a cat", [], bot_task="think", seed=7)]
        outs = engine.generate_ar(reqs, GREEDY)
        res = {}
        for out, req in zip(outs, reqs):
            for path, kv in (("reuse", out.prompt_kv), ("recompute", None)):
                r = engine.dit(DiTRequest(out, req.images, kv, steps=3, guidance_scale=5.0, seed=7))
                assert r.kv_path == path, r.kv_reason
                res[(out.id, path)] = r
        return outs, res
    finally:
        kernels.configure(previous)


def test_tiny_end_to_end_flex_matches_sdpa(monkeypatch):
    engine = tiny_engine()
    made = []
    real = flex_kernels.block_mask
    monkeypatch.setattr(flex_kernels, "block_mask", lambda *a, **kw: made.append(a[0].shape) or real(*a, **kw))
    flex_ar, flex = _run(engine, "flex")
    # flex ran: the AR prefill (the scheduler's: each row alone, the edit's whole prompt with its image
    # block in one chunk), the edit's DiT prefills (recompute: whole prefix with its image; reuse: the
    # uncond row from its <cfg> on); the T2I DiT prefix is plain causal
    edit_prompt = len(flex_ar[0].prompt_ids)
    assert len(made) >= 3 and tuple(made[0]) == (1, 1, edit_prompt, edit_prompt)
    sdpa_ar, sdpa = _run(engine, "sdpa")
    for a, b in zip(flex_ar, sdpa_ar):
        assert a.fed_ids == b.fed_ids  # same greedy tokens
        assert max((x - y).abs().max().item() for x, y in zip(a.prompt_kv.keys, b.prompt_kv.keys)) <= 1e-4
    for key, r in flex.items():
        assert r.latents.abs().max() > 0.5 and np.asarray(r.image).std() > 5.0
        assert (r.latents - sdpa[key].latents).abs().max().item() <= 1e-4, key
        assert psnr(r.image, sdpa[key].image) >= 60.0, key
    for row in ("edit", "t2i"):  # reuse == recompute under flex
        a, b = flex[(row, "reuse")], flex[(row, "recompute")]
        assert (a.latents - b.latents).abs().max().item() <= 1e-4
        assert psnr(a.image, b.image) >= 60.0


# ------------------------------------------------------------------------- compiled DiT steps
@pytest.fixture
def compile_on(monkeypatch):
    """compile=on with the aot_eager backend (dynamo's graphs and guards, no C++ build on the CPU)."""
    from components.engine.kernels import compiled_layers

    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    compiled_layers.reset()
    previous = kernels.configure(compile="on")
    yield compiled_layers
    kernels.configure(previous)
    compiled_layers.reset()


def _frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _two_prompts_one_bucket(engine):
    reqs = [ARRequest("long", "a red cat on a boat at sunset, oil painting", [], bot_task="think", seed=7,
                      image_size=(256, 256)),
            ARRequest("short", "a dog", [], bot_task="think", seed=7, image_size=(256, 256))]
    outs = engine.generate_ar(reqs, GREEDY)
    lengths = {len(o.dit_sequence(engine.builder).cond_ids) for o in outs}
    assert len(lengths) == 2  # different prefix lengths, same image bucket
    return outs


def test_compiled_dit_steps_match_and_reuse_the_graphs(compile_on, monkeypatch):
    from components.engine.transformer import MoE

    monkeypatch.setattr(MoE, "impl", "loop")  # grouped GEMMs have no float32 fake kernel on the CPU
    engine = tiny_engine()
    from .test_engine_helpers import stub_vae_decode

    stub_vae_decode(monkeypatch)
    outs = _two_prompts_one_bucket(engine)
    kernels.configure(compile="off")
    plain = [engine.dit(DiTRequest(o, [], o.prompt_kv, steps=3, seed=7)) for o in outs]
    kernels.configure(compile="on")
    before = _frames()
    first = engine.dit(DiTRequest(outs[0], [], outs[0].prompt_kv, steps=3, seed=7))
    compiled = _frames()
    assert compiled > before  # the step ran through dynamo
    second = engine.dit(DiTRequest(outs[1], [], outs[1].prompt_kv, steps=3, seed=7))
    assert _frames() == compiled  # another prompt, same bucket: no recompile, over every step and layer
    for r, p in zip((first, second), plain):
        assert r.latents.abs().max() > 0.5
        assert (r.latents - p.latents).abs().max().item() <= 1e-5
    # control: another bucket does compile (the counter notices recompiles)
    other = engine.generate_ar([ARRequest("wide", "a dog", [], bot_task="think", seed=7, image_size=(384, 256))],
                               GREEDY)[0]
    engine.dit(DiTRequest(other, [], other.prompt_kv, steps=1, seed=7))
    assert _frames() > compiled


def test_compiled_prefill_matches_plain_and_one_graph_serves_every_length(compile_on, monkeypatch):
    """Prompt chunks (the AR's prefill, here with a conditioning image) through the compiled
    regions: the same greedy tokens and K/V as the plain layers, and prompts of new lengths trace
    nothing more (the prefill graphs are dynamic in the token count; a graph per length would
    compile for every prompt). Control: with compile_prefill=off the prompts trace nothing of the
    prefill, so the frames counted are the prefill's."""
    from components.engine.transformer import MoE

    monkeypatch.setattr(MoE, "impl", "loop")  # grouped GEMMs have no float32 fake kernel on the CPU
    engine = tiny_engine()
    image = random_image(96, 64, seed=3)

    def rows(*texts):
        return [ARRequest(f"r{i}", t, [image], bot_task="think", seed=7) for i, t in enumerate(texts)]

    kernels.configure(compile="off")
    plain = engine.generate_ar(rows("make the sky purple", "a dog on a red boat at sunset, in oil"), GREEDY)
    kernels.configure(compile="on", compile_prefill="off")
    engine.generate_ar(rows("warm up", "the decode graphs of one and two rows"), GREEDY)
    before = _frames()
    engine.generate_ar(rows("another prompt length here, longer still", "and one more"), GREEDY)
    assert _frames() == before  # control: nothing of a prefill is traced with compile_prefill=off
    kernels.configure(compile="on", compile_prefill="on")
    engine.generate_ar(rows("one more", "and a prompt of yet another length"), GREEDY)
    traced = _frames()
    assert traced > before  # the prefill went through dynamo
    fast = engine.generate_ar(rows("make the sky purple", "a dog on a red boat at sunset, in oil"), GREEDY)
    assert _frames() == traced  # two new prompt lengths: no recompile
    assert len({len(o.prompt_kv.token_ids) for o in fast}) == 2
    for a, b in zip(plain, fast):
        assert a.generated_ids == b.generated_ids
        worst = max((ka - kb).abs().max().item() for ka, kb in zip(a.prompt_kv.keys, b.prompt_kv.keys))
        assert worst <= 1e-4


@pytest.mark.slow
def test_compiled_dit_step_inductor_cpu(monkeypatch):
    """The inductor backend (what CUDA runs), here on the CPU: same velocity as the plain step."""
    from components.engine.kernels import compiled_layers
    from components.engine.transformer import MoE

    monkeypatch.setattr(MoE, "impl", "loop")
    compiled_layers.reset()
    engine = tiny_engine()
    out = _two_prompts_one_bucket(engine)[0]
    dit, seq = engine.dit, out.dit_sequence(engine.builder)
    cache = dit.prefix_from_reuse(seq, out.prompt_kv, [], cfg_on=True)
    latents = torch.randn(1, 32, seq.gen_image.h, seq.gen_image.w, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([450.0])
    previous = kernels.configure(compile="off")
    try:
        with torch.no_grad():
            plain = dit.predict(cache, seq, latents, t, 5.0)
            kernels.configure(compile="on")
            fast = dit.predict(cache, seq, latents, t, 5.0)
    finally:
        kernels.configure(previous)
        compiled_layers.reset()
    assert (fast - plain).abs().max().item() <= 1e-4 * max(1.0, plain.abs().max().item())


def _rank_fast(rank: int, world: int, port: int, outdir: str, full_kv_file: str | None) -> None:
    """A tensor-parallel rank of test_engine_parallel under attention=flex and compiled DiT steps."""
    from components.engine.kernels import compiled_layers

    from .test_engine_parallel import _rank

    compiled_layers.BACKEND = "aot_eager"
    kernels.configure(attention="flex", compile="on")
    _rank(rank, world, port, outdir, full_kv_file)


@pytest.mark.slow
def test_tensor_parallel_ranks_with_flex_and_compile(tmp_path):
    """2 gloo ranks (heads sliced per rank) with flex attention and compiled DiT steps == the plain
    single process."""
    import pickle

    import torch.multiprocessing as mp

    from components.engine import Engine

    from .test_engine_parallel import _free_port
    from .test_engine_parallel import _run as run_parallel

    single = run_parallel(Engine.load("tiny"))
    mp.spawn(_rank_fast, args=(2, _free_port(), str(tmp_path), None), nprocs=2, join=True)
    for r in range(2):
        out = pickle.load(open(tmp_path / f"rank{r}.pkl", "rb"))
        assert out["tokens"] == single["tokens"] and out["kv_path"] == "reuse", out["reason"]
        rel = (out["latents"] - single["latents"]).abs().max() / single["latents"].abs().max()
        assert rel.item() <= 1e-5, f"rank {r}: latents differ by {rel.item():.2e} relative"
        assert psnr(out["image"], single["image"]) >= 60
