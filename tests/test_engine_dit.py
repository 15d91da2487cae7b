"""DiT stage details: CFG row order and combination, reuse edge cases (no system prompt, empty user
text), conditioning-image handling on both paths. Latents only (the VAE decode is stubbed)."""

from __future__ import annotations

import pytest
import torch

from components.engine import ARRequest, DiTRequest, SamplingParams

from .test_engine_helpers import random_image, stub_vae_decode, tiny_engine

IMG = random_image(160, 96, seed=1)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(autouse=True)
def _no_decode(monkeypatch):
    stub_vae_decode(monkeypatch)


def _seq(engine, out):
    return out.dit_sequence(engine.builder)


def test_cfg_rows_are_cond_then_uncond_and_combined_with_guidance(engine):
    out = engine.generate_ar([ARRequest("cfg", "a blue boat on the sea", [], bot_task="think")], GREEDY)[0]
    dit, seq = engine.dit, _seq(engine, out)
    both = dit.prefix_from_scratch(seq, [], cfg_on=True)
    cond = dit.prefix_from_scratch(seq, [], cfg_on=False)
    uncond = engine.model.new_cache(1, dit._capacity(seq))
    dit._prefill(uncond, seq, [seq.uncond_ids], 0, [])
    assert both.length == cond.length == uncond.length == seq.gen_image.timestep_index
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 32, seq.gen_image.h, seq.gen_image.w, generator=g)
    t = torch.tensor([700.0])
    with torch.no_grad():
        p_cfg = dit.predict(both, seq, latents, t, 5.0)
        p_cond = dit.predict(cond, seq, latents, t, 5.0)  # one row: no guidance applied
        p_uncond = dit.predict(uncond, seq, latents, t, 5.0)
    assert (p_cond - p_uncond).abs().max() > 1e-2  # the <cfg> row really is different
    expected = p_uncond + 5.0 * (p_cond - p_uncond)
    assert (p_cfg - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


@pytest.fixture(scope="module")
def edge_outputs(engine):
    think = engine.generate_ar([ARRequest("nosys", "a cat", [], bot_task="think", system_prompt="none"),
                                ARRequest("empty", "", [], bot_task="think")], GREEDY)
    image = engine.generate_ar([ARRequest("empty-img", "", [], bot_task="image")], GREEDY)
    return {"no_system_prompt": think[0], "empty_user_text": think[1], "empty_no_cot": image[0]}


@pytest.mark.parametrize("case", ["no_system_prompt", "empty_user_text", "empty_no_cot"])
def test_reuse_edge_cases(engine, edge_outputs, case):
    out = edge_outputs[case]
    tok, kv = engine.tokenizer, out.prompt_kv
    kv.validate()
    seq = _seq(engine, out)
    if case == "no_system_prompt":  # L_neg degenerates to BOS + "User: "
        assert kv.neg_reuse_len == 1 + len(tok.encode("User: "))
    elif case == "empty_user_text":  # the first <cfg> is in the assistant turn (the CoT text)
        assert kv.neg_reuse_len > seq.assistant_start and seq.uncond_ids[kv.neg_reuse_len] == tok.cfg
    else:  # nothing to mask: the rows share everything up to <answer>
        assert seq.cond_ids == seq.uncond_ids and kv.neg_reuse_len == kv.pos_reuse_len
    a = engine.dit(DiTRequest(out, [], kv, steps=3, guidance_scale=5.0, seed=2))
    b = engine.dit(DiTRequest(out, [], None, steps=3, guidance_scale=5.0, seed=2))
    assert (a.kv_path, b.kv_path) == ("reuse", "recompute")
    assert (a.latents - b.latents).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def edit_out(engine):
    return engine.generate_ar([ARRequest("edit", "make the sky purple", [IMG], bot_task="recaption", seed=2)], GREEDY)[0]


def test_reuse_does_not_need_the_pixels(engine, edit_out):
    """Conditioning images live in the reused prefix: passing them or not gives the same result."""
    with_images = engine.dit(DiTRequest(edit_out, [IMG], edit_out.prompt_kv, steps=3, seed=2))
    without = engine.dit(DiTRequest(edit_out, [], edit_out.prompt_kv, steps=3, seed=2))
    assert with_images.kv_path == without.kv_path == "reuse"
    assert torch.equal(with_images.latents, without.latents)


def test_recompute_requires_the_conditioning_images(engine, edit_out):
    with pytest.raises(ValueError, match="1 conditioning images, got 0"):
        engine.dit(DiTRequest(edit_out, [], None, steps=1, seed=2))
    with pytest.raises(ValueError, match="1 conditioning images, got 2"):
        engine.dit(DiTRequest(edit_out, [IMG, IMG], None, steps=1, seed=2))


def test_generate_dit_runs_each_request(engine, edit_out):
    reqs = [DiTRequest(edit_out, [IMG], edit_out.prompt_kv, steps=2, seed=s) for s in (2, 1)]
    res = engine.generate_dit(reqs)
    assert [r.id for r in res] == ["edit", "edit"]
    # the AR's seed (2) reuses its K/V; another seed draws other conditioning latents, so it recomputes
    assert [r.kv_path for r in res] == ["reuse", "recompute"]
    assert not torch.equal(res[0].latents, res[1].latents)
    assert set(res[0].timings) >= {"dit_prefix_s", "dit_step_s", "vae_decode_s", "dit_total_s"}
    assert len(res[0].timings["dit_step_s"]) == 2


def _reference_predict(engine, cache, seq, latents, t, guidance, timestep_sees_image=False):
    """The denoising step written with the generic boolean block mask (`attention_mask`, checked by hand in
    test_engine_layout) instead of the DiT's HeadMask fast path."""
    from components.engine.transformer import attention_mask

    model, gen = engine.model, seq.gen_image
    batch = cache.k[0].shape[0]
    x = torch.cat([model.timestep_tokens(t), model.image_tokens(latents, t)[0]]).unsqueeze(0).expand(batch, -1, -1)
    start, end = gen.timestep_index, gen.end
    blocks = seq.block_ids()
    if timestep_sees_image:  # bug model: <timestep> inside the image block
        blocks = blocks.clone()
        blocks[start] = blocks[gen.start]
    mask = attention_mask(torch.arange(start, end).expand(batch, -1), torch.arange(end).expand(batch, -1),
                          blocks[start:end].expand(batch, -1), blocks[:end].expand(batch, -1))
    hidden = model.forward_layers(x, seq.positions()[start:end].expand(batch, -1, -1), mask, cache)
    out = model.image_output(hidden[:, 1:], t.expand(batch), gen.h, gen.w).float()
    return out if batch == 1 else out[1:2] + guidance * (out[0:1] - out[1:2])


def test_denoise_step_fast_mask_equals_block_mask(engine, edit_out):
    dit, seq = engine.dit, _seq(engine, edit_out)
    cache = dit.prefix_from_reuse(seq, edit_out.prompt_kv, [], cfg_on=True)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 32, seq.gen_image.h, seq.gen_image.w, generator=g)
    t = torch.tensor([450.0])
    with torch.no_grad():
        fast = dit.predict(cache, seq, latents, t, 5.0)
        ref = _reference_predict(engine, cache, seq, latents, t, 5.0)
        wrong = _reference_predict(engine, cache, seq, latents, t, 5.0, timestep_sees_image=True)
    scale = ref.abs().max().item()
    assert (fast - ref).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert (wrong - ref).abs().max().item() > 1e-4 * scale  # the mask matters: 10x above the tolerance
