"""AR stage: batching vs one row at a time, the official stage transitions / stop tokens / ratio slice,
the budget, the official cot_text, text-only answers, generation-config defaults, determinism, and the
AROutput record round trip (tiny config, CPU, fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from components.engine import AROutput, ARRequest, DiTRequest, SamplingParams
from components.engine.ar import ARGenerator
from components.engine.generation_config import tiny_generation_config
from components.engine.system_prompts import TINY_SYSTEM_PROMPTS

from .test_engine_helpers import psnr, random_image, script_sampled_tokens, stub_vae_decode, tiny_engine

IMG = random_image(160, 96, seed=1)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=12)


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
    # the three rows really decoded together (mean rows per decode step), each single row alone
    assert max(o.timings["ar_batch_size"] for o in batched) > 1 and single[0].timings["ar_batch_size"] == 1


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


def test_exported_kv_is_the_common_prefix_of_ar_and_dit(engine, runs):
    """The K/V the AR exports belongs to tokens the AR fed that are also the DiT sequence's tokens."""
    for out in runs["greedy"][0] + runs["sampled"][0]:
        seq = out.dit_sequence(engine.builder)
        n = out.prompt_kv.pos_reuse_len
        assert out.prompt_kv.token_ids == seq.cond_ids[:n] == out.fed_ids[:n]
        assert n == seq.pos_reuse_len <= seq.reuse_boundary
        if out.reencode_diff_at is None:
            assert n == seq.reuse_boundary
        else:
            assert n == out.reencode_diff_at and out.fed_ids[n] != seq.cond_ids[n]


def test_mixed_bot_tasks_in_one_batch(engine):
    """The first row has the shortest stage list (overflowed the KV cache before 0c533ac)."""
    reqs = [ARRequest("img", "a cat", [], bot_task="image"),
            ARRequest("tr", "a red dog", [], bot_task="think_recaption"),
            ARRequest("txt", "hello", [], bot_task="auto"),
            ARRequest("th", "a blue boat on the sea", [], bot_task="think")]
    batched = engine.generate_ar(reqs, GREEDY)
    assert len(batched[0].generated_ids) == 1  # the one-token ratio pass
    for b, r in zip(batched, reqs):
        s = engine.generate_ar([r], GREEDY)[0]
        assert b.generated_ids == s.generated_ids and b.answer_text == s.answer_text
        if b.prompt_kv is None:
            assert r.bot_task == "auto" and s.prompt_kv is None
            continue
        assert b.prompt_kv.token_ids == s.prompt_kv.token_ids
        for x, y in zip(b.prompt_kv.keys + b.prompt_kv.values, s.prompt_kv.keys + s.prompt_kv.values):
            assert (x - y).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------- the official flow, scripted
def _script(monkeypatch, tokens):
    """Replace the sampler by a script: the given tokens in order, then a plain word forever.
    Forced tokens and the greedy ratio choice do not go through the sampler (they never consume it)."""
    it = iter(tokens)
    calls = []

    plain_word = tiny_engine().tokenizer.encode("cat")[0]

    def scripted() -> int:
        token = next(it, None)
        calls.append(token)
        return token if token is not None else plain_word

    script_sampled_tokens(monkeypatch, scripted)
    return calls


def _words(tok, text):
    return tok.encode(text)


def test_think_recaption_stage_transitions(engine, monkeypatch):
    """</think> -> forced <recaption>; </recaption> -> forced <answer><boi><img_size_B>; then the greedy
    ratio choice ends the row. cot_text = "<think>" + decode(tokens through </recaption>)."""
    tok = engine.tokenizer
    think, recap = _words(tok, "a red cat"), _words(tok, "a cat on a boat")
    _script(monkeypatch, think + [tok.think_end] + recap + [tok.recaption_end])
    out = engine.generate_ar([ARRequest("tr", "a cat", [], bot_task="think_recaption")],
                             SamplingParams(temperature=0, max_new_tokens=64))[0]
    g = out.generated_ids
    body = think + [tok.think_end, tok.recaption] + recap + [tok.recaption_end]
    assert g[:-1] == body + [tok.answer, tok.boi, tok.size_id(256)]
    assert g[-1] in tok.ratio_choice_ids and out.ratio_index == tok.ratio_ids.index(g[-1])
    assert out.image_size == engine.builder.resolutions.size(out.ratio_index)
    assert out.cot_text == "<think>" + tok.decode(body) == \
        "<think>a red cat</think><recaption>a cat on a boat</recaption>"
    assert out.prompt_ids[-1] == tok.think  # the AR prompt ends with "Assistant: <think>"
    seq = out.dit_sequence(engine.builder)
    assert seq.cond_ids[len(out.prompt_ids) - 1:seq.gen_image.timestep_index] == [tok.think] + g[:-1] + [g[-1]]


def test_a_sampled_ratio_token_stops_the_row(engine, monkeypatch):
    """Official final stop tokens: any ratio token, even one the model writes inside its CoT."""
    tok = engine.tokenizer
    _script(monkeypatch, _words(tok, "a cat") + [tok.ratio_ids[35]])
    out = engine.generate_ar([ARRequest("early", "a cat", [], bot_task="think_recaption")], GREEDY)[0]
    assert out.generated_ids == _words(tok, "a cat") + [tok.ratio_ids[35]]
    assert out.ratio_index == 35 and out.image_size == (1024, 768)  # the official extra bucket, H1024 x W768
    # no end tag: the official cot_text keeps every generated token; it is one <answer>-wrapped text
    assert out.cot_text == "<think>a cat<img_ratio_35>"


def test_end_tag_inside_think_goes_straight_to_the_answer(engine, monkeypatch):
    """think_recaption: the model writes </recaption> before </think>: its transition fires (official)."""
    tok = engine.tokenizer
    _script(monkeypatch, _words(tok, "a cat") + [tok.recaption_end])
    out = engine.generate_ar([ARRequest("jump", "a cat", [], bot_task="think_recaption")], GREEDY)[0]
    assert out.generated_ids[:-1] == _words(tok, "a cat") + [tok.recaption_end, tok.answer, tok.boi,
                                                                tok.size_id(256)]
    assert out.cot_text == "<think>a cat</recaption>"


@pytest.mark.parametrize("bot_task,trigger,end", [("think", "<think>", "</think>"),
                                                  ("recaption", "<recaption>", "</recaption>")])
def test_single_stage_tasks(engine, monkeypatch, bot_task, trigger, end):
    tok = engine.tokenizer
    words = _words(tok, "a red cat")
    _script(monkeypatch, words + [tok.token_id(end)])
    out = engine.generate_ar([ARRequest("s", "a cat", [], bot_task=bot_task)], GREEDY)[0]
    assert out.generated_ids[:-1] == words + [tok.token_id(end), tok.answer, tok.boi, tok.size_id(256)]
    assert out.cot_text == f"{trigger}a red cat{end}"
    assert out.prompt_ids[-1] == tok.token_id(trigger)


def test_budget_counts_every_generated_token_and_closes_the_cot(engine, monkeypatch):
    """max_new_tokens bounds all generated tokens (HF generate); when only the closing tokens still fit
    they are forced (ardit: the official code would fail for want of a ratio token)."""
    tok = engine.tokenizer
    calls = _script(monkeypatch, [])  # the model never ends a stage by itself
    word = tok.encode("cat")[0]
    out = engine.generate_ar([ARRequest("b", "a cat", [], bot_task="think_recaption")],
                             SamplingParams(temperature=0, max_new_tokens=10))[0]
    g = out.generated_ids
    assert len(g) == 10
    assert g[:-1] == [word] * 3 + [tok.think_end, tok.recaption, tok.recaption_end, tok.answer, tok.boi,
                                   tok.size_id(256)]
    assert g[-1] in tok.ratio_choice_ids and len(calls) == 3  # only the 3 free tokens were sampled


def test_zero_budget_gives_empty_cot(engine):
    tok = engine.tokenizer
    out = engine.generate_ar([ARRequest("z", "a cat", [], bot_task="think_recaption")],
                             SamplingParams(temperature=0, max_new_tokens=0))[0]
    assert out.generated_ids[:-1] == [tok.think_end, tok.recaption, tok.recaption_end, tok.answer, tok.boi,
                                      tok.size_id(256)]
    assert out.cot_text == "<think></think><recaption></recaption>"
    seq = out.dit_sequence(engine.builder)
    assert out.prompt_kv.pos_reuse_len == seq.cond_ids.index(tok.recaption_end, seq.assistant_start)


# --------------------------------------------------------------------------- sizes
def test_fixed_size_stops_at_the_end_tag_and_maps_any_ratio(engine, monkeypatch):
    """Official: with an explicit size the CoT stops at its end tag (no answer prefix, no ratio token), and
    the size goes to the nearest-ratio bucket; ardit's WxH (300x300) is accepted for any ratio."""
    tok = engine.tokenizer
    _script(monkeypatch, _words(tok, "a cat") + [tok.think_end] + _words(tok, "a dog") + [tok.recaption_end])
    out = engine.generate_ar([ARRequest("fixed", "a cat", [], image_size=(300, 300),
                                        bot_task="think_recaption")], GREEDY)[0]
    assert out.generated_ids[-1] == tok.recaption_end
    assert not set(out.generated_ids) & set(tok.ratio_ids) and tok.answer not in out.generated_ids
    assert out.ratio_index == 16 and out.image_size == (256, 256)
    wide = engine.generate_ar([ARRequest("wide", "a cat", [], image_size="1280x720", bot_task="image")], GREEDY)[0]
    assert wide.generated_ids == [] and wide.ratio_index == 36 and wide.image_size == (1280, 720)
    assert wide.prompt_kv is not None  # the prompt is still prefilled for the DiT to reuse


def test_image_task_picks_the_ratio_greedily_among_the_official_slices(engine):
    out = engine.generate_ar([ARRequest("img", "a cat", [], bot_task="image")], SAMPLED)[0]
    assert len(out.generated_ids) == 1 and out.generated_ids[0] in engine.tokenizer.ratio_choice_ids
    again = engine.generate_ar([ARRequest("img", "a cat", [], bot_task="image", seed=99)], SAMPLED)[0]
    assert again.generated_ids == out.generated_ids  # greedy: not sampled


# --------------------------------------------------------------------------- text answers
def test_auto_is_a_text_answer_until_the_stop_token(engine, monkeypatch):
    tok = engine.tokenizer
    words = _words(tok, "a red cat")
    _script(monkeypatch, words + [tok.eos])
    out = engine.generate_ar([ARRequest("t2t", "what is red?", [], bot_task="auto")], GREEDY)
    _script(monkeypatch, [])  # never stops by itself
    out += engine.generate_ar([ARRequest("i2t", "describe it", [IMG], bot_task="auto")], GREEDY)
    assert out[0].is_text_only and out[0].generated_ids == words + [tok.eos]
    assert out[0].answer_text == "a red cat" and out[0].prompt_kv is None
    assert out[0].ratio_index == -1 and out[0].cot_text == ""
    assert tok.decode(out[0].prompt_ids[-3:]).endswith("Assistant: ")
    assert out[1].is_text_only and len(out[1].generated_ids) == GREEDY.max_new_tokens  # budget, no stop
    with pytest.raises(ValueError, match="text answer"):
        out[0].dit_sequence(engine.builder)


# --------------------------------------------------------------------------- generation config + prompts
def test_defaults_come_from_the_generation_config(engine, monkeypatch):
    tok = engine.tokenizer
    _script(monkeypatch, [])
    gc = tiny_generation_config().with_overrides(max_new_tokens=11, bot_task="recaption",
                                                 use_system_prompt="en_vanilla")
    ar = ARGenerator(engine.model, tok, engine.builder, generation_config=gc)
    out = ar.generate([ARRequest("d", "a cat")])[0]
    assert out.bot_task == "recaption" and len(out.generated_ids) == 11
    assert out.system_prompt == TINY_SYSTEM_PROMPTS["en_vanilla"].strip()
    assert out.prompt_ids[1:1 + len(tok.encode(out.system_prompt))] == tok.encode(out.system_prompt)
    # request values win over the config
    none = ar.generate([ARRequest("n", "a cat", system_prompt="none", bot_task="image")])[0]
    assert none.system_prompt == "" and none.prompt_ids[1:3] == tok.encode("User: ")[:2]
    custom = ar.generate([ARRequest("c", "a cat", system_prompt="  Draw well.  ", bot_task="image")])[0]
    assert custom.system_prompt == "Draw well."


def test_sampling_params_resolve_against_the_config():
    gc = tiny_generation_config()
    s = SamplingParams(top_k=5).resolved(gc)
    assert (s.temperature, s.top_k, s.top_p, s.max_new_tokens) == (0.6, 5, 0.95, 32) and not s.greedy
    assert SamplingParams(temperature=0).resolved(gc).greedy
    assert SamplingParams().resolved(gc.with_overrides(do_sample=False)).greedy


def test_image_structure_tokens_in_a_prompt_fail_the_row(engine):
    with pytest.raises(ValueError, match="request bad: prompt contains the image-structure token '<img>'"):
        engine.generate_ar([ARRequest("bad", "make the sky <img> purple")], GREEDY)


def test_tags_in_a_prompt_are_special_tokens(engine):
    """As the official tokenizer: "</think>" typed in a prompt is the </think> token (no longer text)."""
    tok = engine.tokenizer
    out = engine.generate_ar([ARRequest("tags", "make </think> the sky", [], bot_task="image")], GREEDY)[0]
    assert tok.think_end in out.prompt_ids


# --------------------------------------------------------------------------- determinism + record
@pytest.fixture(scope="module")
def edit_out(runs):
    return runs["greedy"][0][2]  # the IT2I row of the greedy batch


@pytest.fixture(scope="module")
def edit_dit(engine, edit_out):
    return engine.dit(DiTRequest(edit_out, [IMG], edit_out.prompt_kv, steps=4, guidance_scale=5.0))  # the AR row's seed


def test_same_seed_is_bitwise_identical(engine, edit_out, edit_dit):
    again = engine.dit(DiTRequest(edit_out, [IMG], edit_out.prompt_kv, steps=4, guidance_scale=5.0))  # the AR row's seed
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
                 "cot_text", "ratio_index", "image_size", "drop_think", "infer_align_image_size", "answer_text",
                 "reencode_diff_at"]:
        assert getattr(back, name) == getattr(edit_out, name), name
    assert isinstance(back.image_size, tuple) and isinstance(back.cond_images[0].vit_grid, tuple)
    assert back.cond_images[0].orig_width == IMG.width and back.cond_images[0].orig_height == IMG.height
    # reuse with the KV that travelled separately: bitwise the same image
    res = engine.dit(DiTRequest(back, [IMG], edit_out.prompt_kv, steps=4, guidance_scale=5.0))  # the AR row's seed
    assert res.kv_path == "reuse"
    assert torch.equal(res.latents, edit_dit.latents)
    assert np.array_equal(np.asarray(res.image), np.asarray(edit_dit.image))
    # recompute from the record alone (re-encodes the conditioning image): the same image
    rec_only = engine.dit(DiTRequest(back, [IMG], None, steps=4, guidance_scale=5.0))  # the AR row's seed
    assert rec_only.kv_path == "recompute"
    assert (rec_only.latents - edit_dit.latents).abs().max().item() <= 1e-4
    assert psnr(rec_only.image, edit_dit.image) >= 60


def test_record_without_the_new_fields_still_loads(edit_out):
    rec = edit_out.to_record()
    for name in ("drop_think", "infer_align_image_size", "answer_text", "reencode_diff_at"):
        rec.pop(name)
    for c in rec["cond_images"]:
        c.pop("orig_width"), c.pop("orig_height")
    rec["assistant_ids"] = [1, 2]  # a field of older records: ignored
    back = AROutput.from_record(rec)
    assert back.cot_text == edit_out.cot_text and back.answer_text == "" and back.reencode_diff_at is None


class _DeepcopyProbe:
    copies = 0

    def __deepcopy__(self, memo):
        type(self).copies += 1
        return self


def test_to_record_does_not_copy_the_kv():
    from components.engine import PromptKV
    from components.engine.sequence import CondImage

    kv = PromptKV([torch.zeros(3, 2, 16)], [torch.zeros(3, 2, 16)], [1, 2, 3], 3, 2, meta={"probe": _DeepcopyProbe()})
    out = AROutput("r", "a cat", "", "image", [CondImage(2, 3, 20, (2, 2), 5)], [1, 2, 3], [20], "", 0, (512, 128),
                   prompt_kv=kv)
    rec = out.to_record()
    assert "prompt_kv" not in rec and rec["cond_images"][0]["vit_grid"] == (2, 2)
    assert _DeepcopyProbe.copies == 0


# --------------------------------------------------------------------------- the official vocabulary and fallbacks
def test_ids_past_the_tokenizer_are_sampled_and_decoded_as_officially(engine, monkeypatch):
    """The official pipeline samples with HF `generate` over the whole output vocabulary, so ids at or
    past the tokenizer's length can be picked; its tokenizer (transformers' fast tokenizer) decodes
    them to nothing. Golden: HF's warpers + multinomial, and PreTrainedTokenizerFast.decode."""
    from transformers import PreTrainedTokenizerFast
    from transformers.generation.logits_process import TopKLogitsWarper

    from components.engine.kernels.decode import DeviceSampler

    ar = engine.ar
    known, vocab = ar.tok.vocab_size, engine.model.config.vocab_size
    assert vocab > known
    unknown = known + 5
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    logits[unknown] = 30.0
    greedy = SamplingParams(temperature=0, max_new_tokens=4).resolved(ar.generation_config)
    assert DeviceSampler(greedy, ar.tok.ratio_choice_ids, [torch.Generator()])(logits[None], [True])[0][1] == unknown
    sampled = SamplingParams(temperature=1.0, top_k=20, top_p=1.0, max_new_tokens=4).resolved(ar.generation_config)
    flat = torch.zeros(vocab)
    flat[known - 10:known + 10] = 5.0  # the top 20 straddle the tokenizer's end
    hf = torch.softmax(TopKLogitsWarper(20)(None, flat[None].clone())[0], -1)

    def ours(seed: int) -> int:
        return DeviceSampler(sampled, ar.tok.ratio_choice_ids, [torch.Generator().manual_seed(seed)])(
            flat[None], [True])[0][1]

    for seed in range(8):  # the same draws as HF's sampling from the same stream
        g = torch.Generator().manual_seed(seed)
        assert ours(seed) == int(torch.multinomial(hf, 1, generator=g))
    assert any(ours(s) >= known for s in range(8))

    official = PreTrainedTokenizerFast(tokenizer_object=ar.tok._backend)
    ids = ar.tok.encode("a red fox") + [unknown, known] + ar.tok.encode(" at dawn")
    assert ar.tok.decode(ids) == official.decode(ids, clean_up_tokenization_spaces=False)

    # end to end: a CoT of such ids keeps them as generated and decodes them as the official tokenizer
    logits_of = engine.model.text_logits
    monkeypatch.setattr(engine.model, "text_logits", lambda h: logits_of(h).index_fill(
        -1, torch.tensor([unknown], device=h.device), 1e4))
    out = engine.generate_ar([ARRequest("u", "a cat", [], bot_task="think", seed=1)],
                             SamplingParams(temperature=0, max_new_tokens=6))[0]
    assert unknown in out.generated_ids
    end = out.generated_ids.index(engine.ar.tok.think_end) + 1
    assert out.cot_text == "<think>" + official.decode(out.generated_ids[:end], clean_up_tokenization_spaces=False)


def test_missing_sampling_keys_fall_back_to_transformers_defaults():
    """The official path reads generation_config.json through transformers: a key the file lacks
    takes transformers' GenerationConfig default; a key it has keeps its value."""
    from transformers import GenerationConfig as HFGenerationConfig

    from components.engine.generation_config import GenerationConfig

    hf = HFGenerationConfig()
    if hf.temperature is None:  # transformers >= 5 applies its defaults at generate time
        hf = HFGenerationConfig(**{k: v for k, v in HFGenerationConfig._get_default_generation_params().items()
                                   if k in ("temperature", "top_k", "top_p")})
    gc = GenerationConfig.from_dict({"do_sample": True})
    assert (gc.temperature, gc.top_k, gc.top_p) == (hf.temperature, hf.top_k, hf.top_p) == (1.0, 50, 1.0)
    released = GenerationConfig.from_dict({"do_sample": True, "temperature": 0.6, "top_k": 1024, "top_p": 0.95})
    assert (released.temperature, released.top_k, released.top_p) == (0.6, 1024, 0.95)
    assert (tiny_generation_config().temperature, tiny_generation_config().top_k) == (0.6, 1024)
