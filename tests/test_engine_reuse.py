"""AR -> DiT prompt-KV reuse vs full recompute (tiny config, CPU, fp32).

The DiT's reuse path injects the AR's K/V for the conditional prefix and prefills only what the AR
did not compute (the cond row after the reuse boundary, and the uncond row from its first <cfg>).
It must give the same final latents as recomputing the whole prefix, for every bot_task, T2I and
IT2I (one and two conditioning images of different aspect ratios), with CFG on. Negative controls
prove the comparison is sensitive: a corrupted KV or a wrong uncond boundary is far off.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from components.engine import ARRequest, DiTRequest, SamplingParams
from components.engine.dit import DiTGenerator

from .test_engine_helpers import psnr, random_image, script_sampled_tokens, tiny_engine

_REAL_DECODE = DiTGenerator.decode
BOT_TASKS = ["think_recaption", "think", "recaption", "image"]
IMG_WIDE = random_image(160, 96, seed=1)  # 5:3, lands on a wide bucket
IMG_TALL = random_image(96, 144, seed=2)  # 2:3, lands on a tall bucket
CASES = {
    "t2i": ("a red cat on a boat at sunset", []),
    "it2i_1": ("make the sky purple", [IMG_WIDE]),
    "it2i_2": ("put the dog from the second image into the first", [IMG_WIDE, IMG_TALL]),
}
STEPS = 4
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
GUIDANCE = 5.0
LATENT_TOL = 1e-4
PSNR_MIN = 60.0


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def ar_outputs(engine):
    """Greedy AR, one batch of the three cases per bot_task: {(bot_task, case): AROutput}."""
    outs = {}
    for bot_task in BOT_TASKS:
        # the row's seed: the AR draws the conditioning latents from its stream, as the DiT does
        reqs = [ARRequest(f"{bot_task}-{case}", prompt, images, bot_task=bot_task, seed=7)
                for case, (prompt, images) in CASES.items()]
        for case, out in zip(CASES, engine.generate_ar(reqs, GREEDY)):
            outs[(bot_task, case)] = out
    return outs


@pytest.fixture(scope="module")
def recomputed(engine, ar_outputs):
    """Recompute-path DiT results, computed on first use and shared by the tests below."""
    cache = {}

    def get(bot_task: str, case: str):
        key = (bot_task, case)
        if key not in cache:
            dit = engine.dit
            dit.decode = types.MethodType(_REAL_DECODE, dit)  # real pixels even under `no_decode`
            cache[key] = dit(DiTRequest(ar_outputs[key], CASES[case][1], None, steps=STEPS,
                                        guidance_scale=GUIDANCE, seed=7))
        return cache[key]

    return get


@pytest.fixture
def no_decode(monkeypatch):
    """For tests that only compare latents / kv_path: skip the VAE decode (most of a tiny DiT call's time)."""
    from PIL import Image

    monkeypatch.setattr(DiTGenerator, "decode", lambda self, latents: Image.new("RGB", (16, 16)))


def _seq(engine, out):
    return out.dit_sequence(engine.builder)


def _reuse(engine, out, kv, images, dit: DiTGenerator | None = None, steps: int = STEPS):
    return (dit or engine.dit)(DiTRequest(out, images, kv, steps=steps, guidance_scale=GUIDANCE, seed=7))


# --------------------------------------------------------------------------- reuse == recompute
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bot_task", BOT_TASKS)
def test_reuse_matches_recompute(engine, ar_outputs, recomputed, bot_task, case):
    out = ar_outputs[(bot_task, case)]
    images = CASES[case][1]
    kv = out.prompt_kv
    assert kv is not None
    kv.validate()
    assert len(out.cond_images) == len(images)
    tok = engine.tokenizer
    seq = _seq(engine, out)
    # the KV covers the DiT prefix the AR computed: up to the official boundary tag (</recaption>, else
    # </think>; <answer> without CoT), or less where the re-encoded CoT left the AR's tokens
    assert seq.cond_ids[seq.reuse_boundary] in (tok.recaption_end, tok.think_end, tok.answer)
    if out.reencode_diff_at is None:
        assert kv.pos_reuse_len == seq.reuse_boundary
    else:
        assert kv.pos_reuse_len == out.reencode_diff_at < seq.reuse_boundary
        assert out.fed_ids[kv.pos_reuse_len] != seq.cond_ids[kv.pos_reuse_len]
    assert kv.token_ids == seq.cond_ids[:kv.pos_reuse_len] == out.fed_ids[:kv.pos_reuse_len]
    if images:  # the conditioning images are inside the reused prefix
        assert seq.cond_images[-1].end < kv.neg_reuse_len

    r_reuse = _reuse(engine, out, kv, images)
    r_full = recomputed(bot_task, case)
    assert (r_reuse.kv_path, r_reuse.kv_reason) == ("reuse", "")
    assert r_full.kv_path == "recompute" and r_full.kv_reason == "no KV given"
    # the outputs carry signal (a constant output would match trivially)
    assert r_full.latents.abs().max() > 0.5
    assert np.asarray(r_full.image).std() > 5.0
    w, h = out.image_size
    assert r_full.image.size == (w, h)
    assert r_full.latents.shape == (1, 32, h // 16, w // 16)

    diff = (r_reuse.latents - r_full.latents).abs().max().item()
    assert diff <= LATENT_TOL, f"reuse vs recompute latents differ by {diff}"
    p = psnr(r_reuse.image, r_full.image)
    assert p >= PSNR_MIN, f"PSNR {p:.1f} dB"


def test_reuse_without_cfg_matches_recompute(engine, ar_outputs, no_decode):
    """guidance <= 1: a single cond row; reuse still equals recompute."""
    out = ar_outputs[("think", "it2i_1")]
    images = CASES["it2i_1"][1]
    a = engine.dit(DiTRequest(out, images, out.prompt_kv, steps=STEPS, guidance_scale=1.0, seed=7))
    b = engine.dit(DiTRequest(out, images, None, steps=STEPS, guidance_scale=1.0, seed=7))
    assert a.kv_path == "reuse" and b.kv_path == "recompute"
    assert (a.latents - b.latents).abs().max().item() <= LATENT_TOL


def _reuse_vs_recompute(engine, out, images, guidance=GUIDANCE):
    """Both paths with the AR row's own seed (DiTRequest.seed None)."""
    a = engine.dit(DiTRequest(out, images, out.prompt_kv, steps=STEPS, guidance_scale=guidance))
    b = engine.dit(DiTRequest(out, images, None, steps=STEPS, guidance_scale=guidance))
    assert (a.kv_path, b.kv_path) == ("reuse", "recompute"), a.kv_reason
    assert b.latents.abs().max() > 0.5
    return (a.latents - b.latents).abs().max().item()


def test_reencoded_cot_reuses_the_common_prefix(engine, monkeypatch, no_decode):
    """The AR writes a CoT in single-character tokens; the DiT re-encodes its text (official), so its
    tokens differ from the AR's inside the CoT. The AR's K/V is reused up to the first difference and
    the rest is recomputed: still equal to recompute."""
    tok = engine.tokenizer
    chars = [tok.token_id(c) for c in "cat"]
    assert None not in chars and tok.encode("cat") != chars  # "cat" has a merged token
    script = iter(chars + [tok.think_end] + chars + [tok.recaption_end])
    script_sampled_tokens(monkeypatch, lambda: next(script))
    out = engine.generate_ar([ARRequest("reenc", "make the sky purple", [IMG_WIDE])],
                             SamplingParams(temperature=0, max_new_tokens=64))[0]
    assert out.cot_text == "<think>cat</think><recaption>cat</recaption>"
    seq = _seq(engine, out)
    first_cot = len(out.prompt_ids)  # the AR prompt ends with <think>; the CoT comes next
    assert out.reencode_diff_at == first_cot
    assert out.prompt_kv.pos_reuse_len == first_cot < seq.reuse_boundary
    assert _reuse_vs_recompute(engine, out, [IMG_WIDE]) <= LATENT_TOL


def test_drop_think_switched_system_prompt_reuses_what_matches(engine, no_decode):
    """drop_think: the DiT sequence has the en_recaption system prompt and no think section (official);
    the AR's K/V matches only up to the system prompt, and reuse still equals recompute."""
    from components.engine.ar import ARGenerator
    from components.engine.generation_config import tiny_generation_config
    from components.engine.system_prompts import TINY_SYSTEM_PROMPTS

    ar = ARGenerator(engine.model, engine.tokenizer, engine.builder, engine.model_id,
                     tiny_generation_config().with_overrides(drop_think=True))
    out = ar.generate([ARRequest("drop", "make the sky purple", [IMG_WIDE])], GREEDY)[0]
    assert out.drop_think and out.system_prompt == TINY_SYSTEM_PROMPTS["en_recaption"]
    assert out.cot_text.startswith("<recaption>") and "<think>" not in out.cot_text
    seq = _seq(engine, out)
    assert engine.tokenizer.think not in seq.cond_ids[seq.assistant_start:]
    assert out.prompt_kv.pos_reuse_len == out.reencode_diff_at < 20  # inside the system prompt
    assert _reuse_vs_recompute(engine, out, [IMG_WIDE]) <= LATENT_TOL


def test_infer_align_image_size_reuse_matches_recompute(engine, no_decode):
    """Conditioning images stretched to their bucket (official infer_align_image_size) in the AR and in
    the DiT's recompute alike."""
    req = ARRequest("align", "make the sky purple", [IMG_TALL], image_size=(256, 256), bot_task="recaption",
                    infer_align_image_size=True)
    out = engine.generate_ar([req], GREEDY)[0]
    plain = engine.generate_ar([dataclasses.replace(req, infer_align_image_size=False)], GREEDY)[0]
    assert out.infer_align_image_size
    n = out.prompt_kv.neg_reuse_len  # the prefix through the conditioning image: same tokens, other pixels
    assert out.prompt_kv.token_ids[:n] == plain.prompt_kv.token_ids[:n]
    diff_kv = max((a[:n] - b[:n]).abs().max().item() for a, b in zip(out.prompt_kv.keys, plain.prompt_kv.keys))
    assert diff_kv > 1e-3  # the stretched image is not the center-cropped one
    assert _reuse_vs_recompute(engine, out, [IMG_TALL]) <= LATENT_TOL


# --------------------------------------------------------------------------- negative controls
def _copy_kv(kv):
    return dataclasses.replace(kv, keys=[k.clone() for k in kv.keys], values=[v.clone() for v in kv.values],
                               token_ids=list(kv.token_ids), meta=dict(kv.meta))


def test_negative_control_corrupted_keys(engine, ar_outputs, recomputed, no_decode):
    """Noise on one layer's keys is still 'reused' (shapes/tokens match) but gives very different latents."""
    out = ar_outputs[("think_recaption", "it2i_1")]
    ref = recomputed("think_recaption", "it2i_1").latents  # computed with the real decode
    kv = _copy_kv(out.prompt_kv)
    gen = torch.Generator().manual_seed(0)
    kv.keys[1] += 0.5 * torch.randn(kv.keys[1].shape, generator=gen)
    bad = _reuse(engine, out, kv, CASES["it2i_1"][1])
    assert bad.kv_path == "reuse"
    diff = (bad.latents - ref).abs().max().item()
    assert diff > 100 * LATENT_TOL, f"corrupted KV only moved latents by {diff}"


class _WrongNegBoundary(DiTGenerator):
    """Bug model: the uncond row shares the cond K/V up to pos_reuse_len (its <cfg> text is skipped)."""

    def prefix_from_reuse(self, seq, kv, images, cfg_on, generator=None, **kwargs):
        return super().prefix_from_reuse(dataclasses.replace(seq, neg_reuse_len=seq.pos_reuse_len), kv, images,
                                         cfg_on, generator, **kwargs)


def test_negative_control_wrong_uncond_boundary(engine, ar_outputs, recomputed, no_decode):
    out = ar_outputs[("think_recaption", "it2i_1")]
    bad = _reuse(engine, out, out.prompt_kv, CASES["it2i_1"][1], dit=_WrongNegBoundary(engine.model, engine.builder))
    assert bad.kv_path == "reuse"
    diff = (bad.latents - recomputed("think_recaption", "it2i_1").latents).abs().max().item()
    assert diff > 100 * LATENT_TOL, f"skipping the uncond prefill only moved latents by {diff}"


# --------------------------------------------------------------------------- unusable KV -> recompute
def _mismatched_kvs(kv, engine):
    bad_tokens = _copy_kv(kv)
    i = len(bad_tokens.token_ids) - 2
    bad_tokens.token_ids[i] = engine.tokenizer.encode("cat")[0] if bad_tokens.token_ids[i] != \
        engine.tokenizer.encode("cat")[0] else engine.tokenizer.encode("dog")[0]
    bad_hash = dataclasses.replace(_copy_kv(kv), config_hash="0123456789abcdef")
    one_layer = _copy_kv(kv)
    one_layer.keys, one_layer.values = one_layer.keys[:1], one_layer.values[:1]
    return {
        "token_ids": (bad_tokens, f"prefix tokens differ from the DiT sequence at index {i}"),
        "config_hash": (bad_hash, "config hash 0123456789abcdef"),
        "layers": (one_layer, "KV has 1 layers, model has 2"),
    }


@pytest.mark.parametrize("problem", ["token_ids", "config_hash", "layers"])
def test_unusable_kv_falls_back_to_recompute(engine, ar_outputs, recomputed, problem, no_decode):
    out = ar_outputs[("think", "t2i")]
    ref = recomputed("think", "t2i")
    kv, reason = _mismatched_kvs(out.prompt_kv, engine)[problem]
    res = engine.dit(DiTRequest(out, [], kv, steps=STEPS, guidance_scale=GUIDANCE, seed=7))
    assert res.kv_path == "recompute"
    assert reason in res.kv_reason, res.kv_reason
    assert torch.equal(res.latents, ref.latents)  # the fallback is the ordinary recompute, bit for bit


def test_absent_kv_reason_is_passed_through(engine, ar_outputs, no_decode):
    out = ar_outputs[("image", "t2i")]
    res = engine.dit(DiTRequest(out, [], None, absent_reason="kv store: key not found", steps=1, seed=7))
    assert (res.kv_path, res.kv_reason) == ("recompute", "kv store: key not found")


def test_truncated_token_ids_fall_back_to_recompute(engine, ar_outputs):
    out = ar_outputs[("image", "t2i")]
    kv = _copy_kv(out.prompt_kv)
    kv.token_ids = kv.token_ids[:-1]  # boundaries unchanged, one token id missing
    reason = engine.dit.check_kv(kv, _seq(engine, out))  # (was a StopIteration crash; fixed in 0c533ac)
    assert reason == f"prefix tokens differ from the DiT sequence at index {len(kv.token_ids)}"


def test_short_kv_tensors_fall_back_to_recompute(engine, ar_outputs, no_decode):
    out = ar_outputs[("image", "t2i")]
    kv = _copy_kv(out.prompt_kv)
    kv.keys = [k[:-1] for k in kv.keys]
    kv.values = [v[:-1] for v in kv.values]
    res = engine.dit(DiTRequest(out, [], kv, steps=1, guidance_scale=GUIDANCE, seed=7))  # (crashed before 0c533ac)
    assert res.kv_path == "recompute"
    n = kv.pos_reuse_len
    assert res.kv_reason == f"layer 0: KV holds {n - 1} tokens, expected {n}"


# --------------------------------------------------------------------------- conditioning images are used
def test_changed_conditioning_image_changes_latents(engine, no_decode):
    """Same tokens (bot_task image, fixed size); only one conditioning image's pixels differ (the first or
    the second of two). Reuse with each AR's KV, and recompute with the new pixels, must follow the pixels."""
    base = [IMG_WIDE, IMG_TALL]
    variants = {"base": base,
                "first": [random_image(*IMG_WIDE.size, seed=98), IMG_TALL],
                "second": [IMG_WIDE, random_image(*IMG_TALL.size, seed=99)]}
    reqs = [ARRequest(f"cond-{name}", "turn it into a watercolor painting", imgs, image_size=(256, 256),
                      bot_task="image", seed=7) for name, imgs in variants.items()]
    outs = dict(zip(variants, engine.generate_ar(reqs, GREEDY)))
    # identical token sequences, so any difference below comes from the pixels
    for name in ("first", "second"):
        assert outs[name].prompt_ids == outs["base"].prompt_ids
        assert outs[name].generated_ids == outs["base"].generated_ids
        assert outs[name].prompt_kv.token_ids == outs["base"].prompt_kv.token_ids
    assert outs["base"].ratio_index == engine.builder.resolutions.index_of(256, 256)

    reuse = {name: engine.dit(DiTRequest(out, variants[name], out.prompt_kv, steps=STEPS, seed=7))
             for name, out in outs.items()}
    assert all(r.kv_path == "reuse" for r in reuse.values())
    for name in ("first", "second"):
        diff = (reuse[name].latents - reuse["base"].latents).abs().max().item()
        assert diff > 1e-2, f"changing the {name} conditioning image moved the latents by only {diff}"
    # recompute from the base AR output with the second image swapped: follows the pixels, not the AR
    recompute = engine.dit(DiTRequest(outs["base"], variants["second"], None, steps=STEPS, seed=7))
    assert recompute.kv_path == "recompute"
    assert (recompute.latents - reuse["second"].latents).abs().max().item() <= LATENT_TOL


def test_a_dit_seed_other_than_the_ars_recomputes_with_the_reason(engine, ar_outputs, no_decode):
    """The AR's K/V holds conditioning latents drawn from the row's stream; a DiT request with another
    seed draws other latents when it recomputes (official), so it must not reuse that K/V."""
    out = ar_outputs[("think_recaption", "it2i_1")]
    res = engine.dit(DiTRequest(out, CASES["it2i_1"][1], out.prompt_kv, steps=1, seed=8))
    assert res.kv_path == "recompute" and res.kv_reason == "seed 8 differs from the AR's 7, which drew the conditioning latents"
    t2i = ar_outputs[("think_recaption", "t2i")]  # no conditioning image: the seed only moves the noise
    assert engine.dit(DiTRequest(t2i, [], t2i.prompt_kv, steps=1, seed=8)).kv_path == "reuse"
