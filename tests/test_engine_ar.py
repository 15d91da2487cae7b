"""AR stage: batching vs one row at a time, stage transitions, ratio tokens, determinism, and the
AROutput record round trip (tiny config, CPU, fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from components.engine import AROutput, ARRequest, DiTRequest, SamplingParams
from components.engine.ar import ARGenerator

from .test_engine_helpers import psnr, random_image, stub_vae_decode, tiny_engine

IMG = random_image(160, 96, seed=1)
GREEDY = SamplingParams(max_new_tokens=8)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=8)


def _requests(bot_task="think_recaption"):
    """Rows of different prompt lengths, with and without a conditioning image."""
    return [
        ARRequest("short", "a cat", [], bot_task=bot_task, seed=11),
        ARRequest("long", "a watercolor painting of a golden horse near a river at sunset, soft light", [],
                  bot_task=bot_task, seed=12),
        ARRequest("edit", "make the sky purple", [IMG], bot_task=bot_task, seed=13),
    ]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def runs(engine):
    """{mode: (batched outputs, one-at-a-time outputs)} for greedy and seeded sampling."""
    out = {}
    for mode, sp in [("greedy", GREEDY), ("sampled", SAMPLED)]:
        batched = engine.generate_ar(_requests(), sp)
        single = [engine.generate_ar([r], sp)[0] for r in _requests()]
        out[mode] = (batched, single)
    return out


# --------------------------------------------------------------------------- batching
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_batched_rows_generate_the_same_tokens_as_single_rows(runs, mode):
    batched, single = runs[mode]
    assert len({len(o.prompt_ids) for o in batched}) == 3  # really different lengths
    for b, s in zip(batched, single):
        assert b.id == s.id
        assert b.prompt_ids == s.prompt_ids
        assert b.generated_ids == s.generated_ids
        assert b.ratio_index == s.ratio_index and b.image_size == s.image_size
        assert b.cot_text == s.cot_text
    assert batched[0].timings["ar_batch_size"] == 3 and single[0].timings["ar_batch_size"] == 1


def test_sampling_is_not_greedy(runs):
    """Seeded sampling must actually sample (else the sampled comparison above proves nothing new)."""
    greedy, _ = runs["greedy"]
    sampled, _ = runs["sampled"]
    assert any(g.generated_ids != s.generated_ids for g, s in zip(greedy, sampled))


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_batched_kv_export_equals_single_row_export(runs, mode):
    batched, single = runs[mode]
    for b, s in zip(batched, single):
        kb, ks = b.prompt_kv, s.prompt_kv
        kb.validate()
        assert kb.token_ids == ks.token_ids
        assert (kb.pos_reuse_len, kb.neg_reuse_len) == (ks.pos_reuse_len, ks.neg_reuse_len)
        assert kb.num_layers == ks.num_layers == 2
        for x, y in zip(kb.keys + kb.values, ks.keys + ks.values):
            assert x.shape == y.shape == (kb.pos_reuse_len, 2, 16)
            assert (x - y).abs().max().item() <= 1e-5
        assert kb.keys[0].abs().max() > 0.1  # real data, not zeros


def test_ar_prompt_is_prefix_of_dit_sequence(engine, runs):
    """Segment-wise tokenisation: what the AR prefilled is exactly the DiT sequence's start (#3499)."""
    for out in runs["greedy"][0] + runs["sampled"][0]:
        seq = engine.builder.dit_sequence(out.user_text, out.cond_images, out.assistant_ids, out.system_prompt,
                                          out.ratio_index)
        assert seq.cond_ids[:len(out.prompt_ids)] == out.prompt_ids
        assert seq.cond_ids[seq.assistant_start:seq.gen_image.timestep_index] == out.assistant_ids
        assert out.prompt_kv.token_ids == seq.cond_ids[:seq.pos_reuse_len]
        assert out.prompt_ids + out.generated_ids == seq.cond_ids[:seq.gen_image.timestep_index]


def test_mixed_bot_tasks_in_one_batch(engine):
    """The first row has the shortest stage list (overflowed the KV cache before 0c533ac)."""
    reqs = [ARRequest("img", "a cat", [], bot_task="image"),
            ARRequest("tr", "a red dog", [], bot_task="think_recaption"),
            ARRequest("th", "a blue boat on the sea", [], bot_task="think")]
    batched = engine.generate_ar(reqs, GREEDY)
    lengths = [len(b.generated_ids) for b in batched]
    assert lengths[0] == 1 and len(set(lengths)) == 3  # rows finish at different steps
    for b, r in zip(batched, reqs):
        s = engine.generate_ar([r], GREEDY)[0]
        assert b.generated_ids == s.generated_ids
        assert b.prompt_kv.token_ids == s.prompt_kv.token_ids
        for x, y in zip(b.prompt_kv.keys + b.prompt_kv.values, s.prompt_kv.keys + s.prompt_kv.values):
            assert (x - y).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- stage transitions
def _split_stages(tok, generated, bot_task):
    """Check the stage structure of `generated` by hand; return the CoT segments."""
    answer = [tok.answer, tok.boi, tok.size_id(256)]
    assert generated[-1] in tok.ratio_ids
    assert sum(t in tok.ratio_ids for t in generated) == 1  # exactly one ratio token, last
    if bot_task == "image":  # the prompt already ends with the answer prefix: only the ratio token
        assert len(generated) == 1
        return []
    assert generated[-4:-1] == answer  # forced after the final end tag
    body = generated[:-4]
    if bot_task == "think_recaption":
        i = body.index(tok.think_end)
        assert body[i + 1] == tok.recaption  # forced right after </think>
        assert body[-1] == tok.recaption_end
        segs = [body[:i], body[i + 2:-1]]
    else:
        end = tok.think_end if bot_task == "think" else tok.recaption_end
        assert body[-1] == end
        segs = [body[:-1]]
    for seg in segs:
        assert not set(seg) & tok.special_ids  # CoT text never contains special tokens
    return segs


@pytest.fixture(scope="module")
def per_task(engine):
    """Greedy T2I outputs for every bot_task (two rows each)."""
    return {bt: engine.generate_ar([ARRequest(f"{bt}-0", "a cat", [], bot_task=bt),
                                    ARRequest(f"{bt}-1", "a blue boat on the sea", [], bot_task=bt)], GREEDY)
            for bt in ["think_recaption", "think", "recaption", "image"]}


@pytest.mark.parametrize("bot_task", ["think_recaption", "think", "recaption", "image"])
def test_stage_transitions(engine, per_task, bot_task):
    tok = engine.tokenizer
    trigger = {"think_recaption": [tok.think], "think": [tok.think], "recaption": [tok.recaption],
               "image": [tok.answer, tok.boi, tok.size_id(256)]}[bot_task]
    for out in per_task[bot_task]:
        assert out.prompt_ids[-len(trigger):] == trigger
        segs = _split_stages(tok, out.generated_ids, bot_task)
        assert all(len(s) <= GREEDY.max_new_tokens for s in segs)
        assert out.assistant_ids == trigger + out.generated_ids
        assert out.ratio_index == tok.ratio_ids.index(out.generated_ids[-1])
        assert out.image_size == engine.builder.resolutions.size(out.ratio_index)
        assert out.cot_text == tok.decode([t for s in segs for t in s])


def _patched_sampler(monkeypatch, tok, end_after=None):
    """Replace the sampler: always a plain word token, or the stage's end tag after `end_after` tokens."""
    word = tok.encode("cat")[0]
    state = {"n": 0}

    def fake(self, logits, end_tag, sampling, generator):
        state["n"] += 1
        if end_after is not None and state["n"] > end_after:
            state["n"] = 0
            return end_tag
        return word

    monkeypatch.setattr(ARGenerator, "_sample", fake)
    return word


def test_cot_budget_forces_end_tag(engine, monkeypatch):
    tok = engine.tokenizer
    word = _patched_sampler(monkeypatch, tok)
    out = engine.generate_ar([ARRequest("b", "a cat", [], bot_task="think_recaption")],
                             SamplingParams(max_new_tokens=5))[0]
    segs = _split_stages(tok, out.generated_ids, "think_recaption")
    assert segs == [[word] * 5, [word] * 5]  # never ends by itself: cut at the budget, end tag forced
    assert out.generated_ids[5] == tok.think_end and out.generated_ids[12] == tok.recaption_end


def test_cot_stage_ends_on_sampled_end_tag(engine, monkeypatch):
    tok = engine.tokenizer
    word = _patched_sampler(monkeypatch, tok, end_after=2)
    out = engine.generate_ar([ARRequest("b", "a cat", [], bot_task="think_recaption")],
                             SamplingParams(max_new_tokens=5))[0]
    assert _split_stages(tok, out.generated_ids, "think_recaption") == [[word] * 2, [word] * 2]


def test_fixed_image_size_forces_ratio_token(engine, per_task):
    tok, groups = engine.tokenizer, engine.builder.resolutions
    auto = per_task["think"][0]
    sizes = [s for s in [(256, 192), (128, 512), (512, 128)] if groups.index_of(*s) != auto.ratio_index][:2]
    for size in sizes:  # sizes other than what the model picks by itself
        k = groups.index_of(*size)
        out = engine.generate_ar([ARRequest("think-0", "a cat", [], image_size=size, bot_task="think")], GREEDY)[0]
        assert out.generated_ids[-1] == tok.ratio_ids[k]
        assert out.ratio_index == k and out.image_size == size
        assert out.generated_ids[:-1] == auto.generated_ids[:-1]  # only the ratio token changes


def test_unsupported_image_size_raises(engine):
    with pytest.raises(ValueError, match="300x300 is not a supported bucket"):
        engine.generate_ar([ARRequest("x", "a cat", [], image_size=(300, 300))], GREEDY)


# --------------------------------------------------------------------------- determinism + record
@pytest.fixture(scope="module")
def edit_out(runs):
    return runs["greedy"][0][2]  # the IT2I row of the greedy batch


@pytest.fixture(scope="module")
def edit_dit(engine, edit_out):
    return engine.dit(DiTRequest(edit_out, [IMG], edit_out.prompt_kv, steps=4, guidance_scale=5.0, seed=5))


def test_same_seed_is_bitwise_identical(engine, edit_out, edit_dit):
    again = engine.dit(DiTRequest(edit_out, [IMG], edit_out.prompt_kv, steps=4, guidance_scale=5.0, seed=5))
    assert torch.equal(edit_dit.latents, again.latents)
    assert np.array_equal(np.asarray(edit_dit.image), np.asarray(again.image))
    # (sampled AR with the same seeds twice gives the same tokens: the batched-vs-single test above)


def test_different_seed_changes_the_latents(engine, edit_out, edit_dit, monkeypatch):
    stub_vae_decode(monkeypatch)
    other = engine.dit(DiTRequest(edit_out, [IMG], edit_out.prompt_kv, steps=4, guidance_scale=5.0, seed=6))
    assert (other.latents - edit_dit.latents).abs().max() > 0.1


def test_record_round_trip_gives_the_same_image(engine, edit_out, edit_dit):
    rec = edit_out.to_record()
    assert "prompt_kv" not in rec
    text = json.dumps(rec)  # JSON-able, no tensors
    back = AROutput.from_record(json.loads(text))
    assert back.prompt_kv is None
    assert back.to_record() == rec
    for name in ["id", "user_text", "system_prompt", "bot_task", "cond_images", "prompt_ids", "generated_ids",
                 "assistant_ids", "cot_text", "ratio_index", "image_size"]:
        assert getattr(back, name) == getattr(edit_out, name), name
    assert isinstance(back.image_size, tuple) and isinstance(back.cond_images[0].vit_grid, tuple)
    # reuse with the KV that travelled separately: bitwise the same image
    res = engine.dit(DiTRequest(back, [IMG], edit_out.prompt_kv, steps=4, guidance_scale=5.0, seed=5))
    assert res.kv_path == "reuse"
    assert torch.equal(res.latents, edit_dit.latents)
    assert np.array_equal(np.asarray(res.image), np.asarray(edit_dit.image))
    # recompute from the record alone (re-encodes the conditioning image): the same image
    rec_only = engine.dit(DiTRequest(back, [IMG], None, steps=4, guidance_scale=5.0, seed=5))
    assert rec_only.kv_path == "recompute"
    assert (rec_only.latents - edit_dit.latents).abs().max().item() <= 1e-4
    assert psnr(rec_only.image, edit_dit.image) >= 60


def test_zero_cot_budget_gives_empty_cot(engine):
    tok = engine.tokenizer
    out = engine.generate_ar([ARRequest("z", "a cat", [], bot_task="think_recaption")],
                             SamplingParams(max_new_tokens=0))[0]
    assert out.generated_ids[:-1] == [tok.think_end, tok.recaption, tok.recaption_end, tok.answer, tok.boi,
                                      tok.size_id(256)]
    assert out.cot_text == ""
    seq = engine.builder.dit_sequence(out.user_text, out.cond_images, out.assistant_ids, out.system_prompt,
                                      out.ratio_index)
    assert out.prompt_kv.pos_reuse_len == seq.cond_ids.index(tok.recaption_end)


class _DeepcopyProbe:
    copies = 0

    def __deepcopy__(self, memo):
        type(self).copies += 1
        return self


def test_to_record_does_not_copy_the_kv():
    from components.engine import PromptKV
    from components.engine.sequence import CondImage

    kv = PromptKV([torch.zeros(3, 2, 16)], [torch.zeros(3, 2, 16)], [1, 2, 3], 3, 2, meta={"probe": _DeepcopyProbe()})
    out = AROutput("r", "a cat", "", "image", [CondImage(2, 3, 20, (2, 2), 5)], [1, 2, 3], [20], [1, 20], "",
                   0, (512, 128), prompt_kv=kv)
    rec = out.to_record()
    assert "prompt_kv" not in rec and rec["cond_images"][0]["vit_grid"] == (2, 2)
    assert _DeepcopyProbe.copies == 0


def test_special_token_strings_in_a_prompt_stay_text(engine):
    """A user cannot inject control tokens: "<cfg>" / "</think>" in a prompt are plain text."""
    tok = engine.tokenizer
    ids = tok.encode("make <cfg> the </think> sky <img>")
    assert not {tok.cfg, tok.think_end, tok.img} & set(ids)
    assert tok.decode(ids) == "make <cfg> the </think> sky <img>"
