"""Sequence layout against the official code: prompt token ids, image blocks, <cfg> rows, ratio buckets,
reuse boundaries, segment-wise tokenisation (vLLM-Omni #3499). Builder only: no model forward here.

Golden values (tests/golden_hunyuan_official.py) were produced by the official HunyuanImage-3.0 Instruct
code at commit 4000b7f/1201fe8 of the fork suryatmodulus/HunyuanImage-3.0, on the tiny tokenizer."""

from __future__ import annotations

import pytest

from components.engine.sequence import (
    CondImage,
    ResolutionGroup,
    SequenceBuilder,
    UserTextError,
    first_difference,
    parse_image_size,
    reuse_boundary,
)
from components.engine.system_prompts import TINY_SYSTEM_PROMPTS, resolve_system_prompt
from components.engine.tokenizer import load_tokenizer

from .golden_hunyuan_official import GOLDEN

UNIFIED = resolve_system_prompt("en_unified", "think_recaption", TINY_SYSTEM_PROMPTS)
VANILLA = resolve_system_prompt("dynamic", "image", TINY_SYSTEM_PROMPTS)
USER = "a red cat on a boat"
COT_TR = "<think>The user wants a red cat.</think><recaption>a red cat on a boat at sunset</recaption>"
COT_R = "<recaption>a purple sky over a red house</recaption>"
# the official footprint of a 160x96 (WxH) conditioning image at base 256 (GOLDEN["cond_footprint"]),
# with a 6x10 ViT grid padded to the tiny preset's 64 slots
COND = CondImage(latent_h=12, latent_w=20, ratio_index=12, vit_grid=(6, 10), vit_len=64)


def rle(ids: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for t in ids:
        if out and out[-1][0] == t:
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return out


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def builder(tok):
    return SequenceBuilder(tok, 256)


# --------------------------------------------------------------------------- golden: the official ids
def _dit_cases(tok):
    plain = SequenceBuilder(tok, 256)
    distil = SequenceBuilder(tok, 256, guidance_token=True, timestep_r_token=True)
    pretrain = SequenceBuilder(tok, 256, sequence_template="pretrain")
    ratio_1280x720 = plain.resolutions.ratio_index(1280, 720)  # ardit WxH; the official "720x1280" HxW
    return {
        "dit_think_recaption_t2i": plain.dit_sequence(USER, [], COT_TR, UNIFIED, 16),
        "dit_recaption_it2i": plain.dit_sequence("make the sky purple", [COND], COT_R, UNIFIED, 12),
        "dit_image_t2i": plain.dit_sequence(USER, [], None, VANILLA, ratio_1280x720),
        "dit_distil_think_recaption": distil.dit_sequence(USER, [], COT_TR, UNIFIED, 16),
        "dit_drop_think": plain.dit_sequence(USER, [], "<recaption>a red cat on a boat at sunset</recaption>",
                                             TINY_SYSTEM_PROMPTS["en_recaption"], 16, drop_think=True),
        "dit_tags_in_text": plain.dit_sequence("draw <think> a cat </recaption>", [], "<think>unfinished thought",
                                               "", 16),
        "dit_pretrain_image": pretrain.dit_sequence(USER, [], None, "", 16),
    }


@pytest.mark.parametrize("case", ["dit_think_recaption_t2i", "dit_recaption_it2i", "dit_image_t2i",
                                  "dit_distil_think_recaption", "dit_drop_think", "dit_tags_in_text",
                                  "dit_pretrain_image"])
def test_dit_sequence_is_the_official_one(tok, case):
    seq = _dit_cases(tok)[case]
    gold = GOLDEN[case]
    assert rle(seq.cond_ids) == gold["rows"][0]
    if len(gold["rows"]) == 2:  # cfg_factor 2: the official uncond row
        assert rle(seq.uncond_ids) == gold["rows"][1]
    else:  # Instruct-Distil: cfg_factor 1, no uncond row
        assert seq.cfg_distilled
    # the official scatter indices of <timestep> (generated and conditioning images), <guidance>, <timestep_r>
    extra = gold["extra"]
    gen = seq.gen_image
    assert [gen.timestep_index] == extra["gen_timestep"]
    assert [s.timestep_index for s in seq.cond_images] == extra.get("cond_timestep", [])
    assert ([gen.guidance_index] if gen.guidance_index is not None else []) == extra.get("guidance", [])
    assert ([gen.timestep_r_index] if gen.timestep_r_index is not None else []) == extra.get("gen_timestep_r", [])
    assert [gen.h, gen.w] == gold["hw"]
    assert seq.cond_ids[gen.start - 1] in (tok.timestep, tok.guidance, tok.timestep_r)
    assert seq.cond_ids[gen.start:gen.start + gen.h * gen.w] == [tok.img] * (gen.h * gen.w)
    assert seq.cond_ids[gen.start + gen.h * gen.w] == tok.eoi


@pytest.mark.parametrize("case,template,user,images,bot_task,system", [
    ("ar_think_t2i", "instruct", USER, [], "think_recaption", UNIFIED),
    ("ar_recaption_it2i", "instruct", "make the sky purple", [COND], "recaption", UNIFIED),
    ("ar_img_ratio_t2i", "instruct", USER, [], "image", VANILLA),
    ("ar_auto_t2t", "instruct", "hello there", [], "auto", UNIFIED),
    ("ar_pretrain_img_ratio", "pretrain", USER, [], "image", ""),
])
def test_ar_prompt_is_the_official_one(tok, case, template, user, images, bot_task, system):
    seq = SequenceBuilder(tok, 256, sequence_template=template).ar_prompt(user, images, bot_task, system)
    assert rle(seq.cond_ids) == GOLDEN[case]


def test_system_prompt_tags_are_special_tokens(tok):
    """Official tokenizer: <think>/<recaption> written in the system prompt are special tokens."""
    ids = tok.encode(UNIFIED)
    assert ids == GOLDEN["ids_system_en_unified"]
    assert tok.think in ids and tok.recaption in ids
    assert UNIFIED == GOLDEN["system_en_unified"]


# --------------------------------------------------------------------------- golden: ratio buckets
@pytest.mark.parametrize("base", [1024, 256])
def test_resolution_table_is_the_official_one(base):
    """The whole table, index -> (height, width): extras parsed as HEIGHT x WIDTH, not rescaled."""
    g = ResolutionGroup(base)
    assert [[r.height, r.width] for r in g.data] == GOLDEN[f"buckets_{base}"]
    assert len(g) == 37 and all(w % 16 == 0 and h % 16 == 0 for w, h in map(g.size, range(37)))
    # written out for base 1024, so a transposed table cannot pass by regenerating the golden file
    if base == 1024:
        assert g.size(16) == (1024, 1024) and g.size(0) == (2048, 512) and g.size(32) == (512, 2048)
        assert [g.size(i) for i in range(33, 37)] == [(768, 1024), (720, 1280), (1024, 768), (1280, 720)]


# official build_gen_image_info keys are HxW (or W:H) strings; ardit takes (width, height)
GEN_TARGETS = {"720x1280": (1280, 720), "1280x720": (720, 1280), "1024x1024": (1024, 1024), "832x1216": (1216, 832),
               "1216x832": (832, 1216), "768x1024": (1024, 768), "1024x768": (768, 1024), "512x2048": (2048, 512),
               "2048x512": (512, 2048), "600x1000": (1000, 600), "1000x600": (600, 1000), "9:16": (9, 16),
               "16:9": (16, 9)}


@pytest.mark.parametrize("official_size", list(GEN_TARGETS))
def test_explicit_target_size_maps_to_the_official_bucket(tok, official_size):
    """Landscape and portrait targets -> the official <img_ratio_k>, image size and image token count."""
    ratio, height, width, token_h, token_w, n_tokens = GOLDEN["gen_targets_1024"][official_size]
    builder = SequenceBuilder(tok, 1024)
    width_height = GEN_TARGETS[official_size]
    assert parse_image_size("{}x{}".format(*width_height)) == width_height  # ardit's WxH form
    k = builder.resolutions.ratio_index(*width_height)
    assert k == ratio
    assert builder.resolutions.size(k) == (width, height)
    assert builder.latent_grid(k) == (token_h, token_w) and token_h * token_w == n_tokens
    seq = builder.dit_sequence("a cat", [], None, "", k)
    assert seq.cond_ids[seq.gen_image.timestep_index - 2:seq.gen_image.timestep_index] == \
        [tok.size_id(1024), tok.ratio_ids[ratio]]
    assert len([t for t in seq.cond_ids if t == tok.img]) == n_tokens


def test_landscape_request_is_a_landscape_image(tok):
    """The bug this issue started from: W1280 x H720 must be 80 wide x 45 high latents, <img_ratio_36>."""
    g = ResolutionGroup(1024)
    k = g.ratio_index(1280, 720)
    assert k == 36 and g.size(k) == (1280, 720)
    assert SequenceBuilder(tok, 1024).latent_grid(k) == (45, 80)


@pytest.mark.parametrize("orig", list(GOLDEN["cond_targets_1024"]))
def test_conditioning_image_bucket_is_the_official_one(orig):
    """get_target_size over every bucket, extras included (a 4:3 photo lands on an extra bucket)."""
    width, height = map(int, orig.split("x"))
    g = ResolutionGroup(1024)
    tw, th, ratio = GOLDEN["cond_targets_1024"][orig]
    assert g.get_target_size(width, height) == (tw, th)
    assert g.ratio_index(width, height) == ratio == g.get_base_size_and_ratio_index(tw, th)[1]


def test_ratio_choice_ids_are_the_official_slices(tok):
    start, end, (other_lo, other_hi) = GOLDEN["ratio_slices"]
    assert tok.ratio_choice_ids == list(range(start, end + 1)) + list(range(other_lo, other_hi))
    assert sorted(tok.ratio_choice_ids) == sorted(tok.ratio_ids)


def test_parse_image_size():
    assert parse_image_size("auto") == parse_image_size(None) == "auto"
    assert parse_image_size("1280x720") == (1280, 720)  # ardit: WIDTH x HEIGHT
    assert parse_image_size((832, 1216)) == (832, 1216)
    assert parse_image_size("16:9") == (16, 9)
    assert parse_image_size("<img_ratio_3>") == "<img_ratio_3>"
    for bad in ["1280", "0x720", "axb", (1, 2, 3), "-5x4"]:
        with pytest.raises(ValueError, match="^image size "):
            parse_image_size(bad)


# --------------------------------------------------------------------------- the <cfg> row, boundaries
@pytest.mark.parametrize("cot", [COT_TR, "<think>thinking</think>", COT_R, None])
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_uncond_row_replaces_user_and_cot_text_token_for_token(tok, builder, cot, n_images):
    images = [COND, CondImage(2, 3, 20, (2, 2), 5)][:n_images]
    user = "make the sky purple and add a golden bird"
    seq = builder.dit_sequence(user, images, cot, UNIFIED, 16)
    cond, uncond = seq.cond_ids, seq.uncond_ids
    assert len(cond) == len(uncond)
    diff = [i for i, (a, b) in enumerate(zip(cond, uncond)) if a != b]
    assert all(uncond[i] == tok.cfg for i in diff)
    # the masked tokens are exactly the user text and the inner CoT texts
    inner = [] if cot is None else [part.split("</")[0] for part in cot.split(">")[1:] if "</" in part]
    assert len(diff) == len(tok.encode(user)) + sum(len(tok.encode(t)) for t in inner)
    # tags, the system prompt, role prefixes and image blocks are kept
    for t in (tok.think, tok.think_end, tok.recaption, tok.recaption_end, tok.answer, tok.answer_end):
        assert cond.count(t) == uncond.count(t)
    assert seq.neg_reuse_len == diff[0]
    # the first <cfg> comes right after "User: " and the conditioning-image blocks
    assert seq.neg_reuse_len == (seq.cond_images[-1].end + 1 if images else
                                 1 + len(tok.encode(UNIFIED)) + len(tok.encode("\n\n")) + len(tok.encode("User: ")))
    boundary_tag = {COT_TR: tok.recaption_end, COT_R: tok.recaption_end}.get(cot, tok.think_end if cot else tok.answer)
    assert cond[seq.pos_reuse_len] == boundary_tag and seq.pos_reuse_len == seq.reuse_boundary
    assert seq.neg_reuse_len < seq.pos_reuse_len
    for slot, im in zip(seq.cond_images, images):
        assert cond[slot.timestep_index - 3:slot.timestep_index] == [tok.boi, tok.size_id(256),
                                                                      tok.ratio_ids[im.ratio_index]]
        assert cond[slot.vit_start - 1] == tok.joint_img_sep and cond[slot.end] == tok.eoi
        assert slot.vit_start == slot.start + im.latent_h * im.latent_w + 1


def test_reuse_is_capped_by_the_ar_ids(tok, builder):
    """Re-encoding the CoT text may change tokens: the AR's K/V is reused up to the first difference."""
    seq = builder.dit_sequence(USER, [], COT_TR, UNIFIED, 16)
    same = builder.dit_sequence(USER, [], COT_TR, UNIFIED, 16, ar_ids=seq.cond_ids[:seq.reuse_boundary + 3])
    assert same.pos_reuse_len == seq.reuse_boundary
    ar_ids = list(seq.cond_ids[:seq.reuse_boundary])
    cut = seq.assistant_start + 5
    ar_ids[cut] = tok.encode("dog")[0]  # the AR generated another tokenisation of the same text
    capped = builder.dit_sequence(USER, [], COT_TR, UNIFIED, 16, ar_ids=ar_ids)
    assert capped.cond_ids == seq.cond_ids  # the DiT sequence itself does not change
    assert capped.pos_reuse_len == cut and capped.neg_reuse_len == seq.neg_reuse_len
    early = builder.dit_sequence(USER, [], COT_TR, UNIFIED, 16, ar_ids=[tok.bos, 5])
    assert early.pos_reuse_len == 1 and early.neg_reuse_len == 1


def test_empty_user_text_without_cot_shares_everything_up_to_boundary(tok, builder):
    seq = builder.dit_sequence("", [], None, VANILLA, 16)
    assert seq.cond_ids == seq.uncond_ids
    assert seq.neg_reuse_len == seq.pos_reuse_len == seq.cond_ids.index(tok.answer)


def test_reuse_boundary_and_first_difference(tok):
    ids = [1, tok.think, 5, tok.think_end, tok.recaption, 6, tok.recaption_end, tok.answer]
    assert reuse_boundary(ids, tok) == 6
    assert reuse_boundary(ids[:6] + [tok.answer], tok) == 3
    assert reuse_boundary([1, 2, tok.answer, 3], tok) == 2
    assert reuse_boundary([1, 2, 3], tok) == 0
    assert reuse_boundary([tok.answer, 1, tok.answer], tok, start=1) == 2  # searches from `start`
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("n_images", [0, 2])
@pytest.mark.parametrize("bot_task,cot", [("think_recaption", COT_TR), ("think", "<think>sunset</think>"),
                                          ("recaption", COT_R), ("image", None)])
def test_ar_prompt_is_a_prefix_of_the_dit_sequence(tok, builder, bot_task, cot, n_images):
    """Segment-wise tokenisation: with a CoT that re-encodes to itself, the AR prompt is the DiT start."""
    images = [COND, CondImage(2, 3, 20, (2, 2), 5)][:n_images]
    ar = builder.ar_prompt(USER, images, bot_task, UNIFIED)
    dit = builder.dit_sequence(USER, images, cot, UNIFIED, 16)
    n = len(ar.cond_ids)
    assert dit.cond_ids[:n] == ar.cond_ids
    assert dit.uncond_ids[:n] == ar.uncond_ids
    assert dit.neg_reuse_len == ar.neg_reuse_len
    assert dit.assistant_start == ar.assistant_start
    assert [(s.start, s.end) for s in dit.cond_images] == [(s.start, s.end) for s in ar.cond_images]
    assert dit.positions()[:n].tolist() == ar.positions().tolist()
    assert dit.block_ids()[:n].tolist() == ar.block_ids().tolist()


def test_bot_task_must_be_known(builder):
    with pytest.raises(ValueError, match="bot_task"):
        builder.ar_prompt(USER, [], "dance", "")


def test_max_length_is_enforced(tok):
    small = SequenceBuilder(tok, 256, max_length=40)
    with pytest.raises(ValueError, match="exceeds max_length 40"):
        small.dit_sequence(USER, [], None, "", 16)


# --------------------------------------------------------------------------- user text
def test_tags_in_user_text_are_special_tokens_as_official(tok, builder):
    """The official tokenizer parses tags anywhere: `<think>` typed by a user is the <think> token."""
    ids = tok.encode("draw <think> a cat </recaption>")
    assert tok.think in ids and tok.recaption_end in ids
    seq = builder.ar_prompt("draw <think> a cat </recaption>", [], "think_recaption", "")
    assert tok.recaption_end in seq.cond_ids[:seq.assistant_start]


@pytest.mark.parametrize("token", ["<boi>", "<eoi>", "<img>", "<joint_img_sep>", "<timestep>", "<guidance>",
                                   "<timestep_r>", "<cfg>", "<img_size_1024>", "<img_ratio_7>", "<img_ratio_36>"])
def test_image_structure_tokens_in_user_text_are_rejected(builder, token):
    for call in (lambda: builder.ar_prompt(f"make the sky {token} purple", [], "think", ""),
                 lambda: builder.dit_sequence(f"make the sky {token} purple", [], None, "", 16)):
        with pytest.raises(UserTextError, match=f"image-structure token '{token}'"):
            call()


def test_plain_brackets_in_user_text_are_fine(tok, builder):
    seq = builder.ar_prompt("a sign that says <hello> and <img_size_huge>", [], "think", "")
    assert tok.img not in seq.cond_ids


# --------------------------------------------------------------------------- segment tokenisation (#3499)
def test_bpe_is_not_additive_over_segments(tok):
    """BPE(A + B) != BPE(A) + BPE(B) for the tiny tokenizer, as for the real one."""
    pairs = [("User: ", "a cat"), ("a red", "dish"), ("make the sky ", "purple"), ("sun", "set")]
    for a, b in pairs:
        assert tok.encode(a + b) != tok.encode(a) + tok.encode(b), (a, b)
    whole = tok.encode(UNIFIED + "\n\n" + "User: " + USER + "\n\n" + "Assistant: ")
    segments = (tok.encode(UNIFIED) + tok.encode("\n\n") + tok.encode("User: ") + tok.encode(USER)
                + tok.encode("\n\n") + tok.encode("Assistant: "))
    assert whole != segments


# --------------------------------------------------------------------------- tokenizer files + PromptKV contract
def test_tiny_tokenizer_special_tokens(tok):
    from components.engine.config import tiny_config
    from components.engine.tokenizer import SPECIAL_TOKENS

    ids = [tok.token_id(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert len(tok.ratio_ids) == 37 and tok.ratio_ids == [tok.token_id(f"<img_ratio_{i}>") for i in range(37)]
    assert tok.vocab_size <= tiny_config().vocab_size
    assert tok.decode([tok.think, tok.recaption_end]) == "<think></recaption>"
    assert tok.decode(tok.encode("a red cat on a boat")) == "a red cat on a boat"
    with pytest.raises(KeyError, match="'<no_such_token>' is not in the tokenizer"):
        tok.token_id("<no_such_token>")


def test_tokenizer_files_in_checkpoint_layout_round_trip(tmp_path, tok):
    import json

    from components.engine.tokenizer import write_tokenizer_files

    paths = write_tokenizer_files(tmp_path)
    assert sorted(p.name for p in paths) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|startoftext|>" and config["eos_token"] == "<|endoftext|>"
    assert "<img_ratio_36>" in config["additional_special_tokens"]
    loaded = load_tokenizer(tmp_path)
    text = UNIFIED + " User: draw <think> a cat"
    assert loaded.encode(text) == tok.encode(text) and loaded.ratio_ids == tok.ratio_ids
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_prompt_kv_validate():
    import torch

    from components.engine import PromptKV

    def kv(n_tokens=5, pos=5, neg=3, layers=2, rows=5):
        return PromptKV([torch.zeros(rows, 2, 16)] * layers, [torch.zeros(rows, 2, 16)] * layers,
                        list(range(n_tokens)), pos, neg)

    good = kv()
    good.validate()
    assert good.num_layers == 2 and good.dtype == torch.float32
    assert good.nbytes() == 2 * 2 * 5 * 2 * 16 * 4
    with pytest.raises(ValueError, match="pos_reuse_len 4 != number of token ids 5"):
        kv(pos=4).validate()
    with pytest.raises(ValueError, match="neg_reuse_len 0"):
        kv(neg=0).validate()
    with pytest.raises(ValueError, match="neg_reuse_len 6"):
        kv(neg=6).validate()
    with pytest.raises(ValueError, match="layer 0"):
        kv(rows=4).validate()
    with pytest.raises(ValueError, match="non-empty"):
        kv(layers=0).validate()


def test_cot_decode_and_reencode_are_the_official_ones(tok):
    """The DiT re-encodes the decoded CoT: decode (special tokens written out, broken UTF-8 as U+FFFD) and
    encode give the official tokenizer's results, including where re-encoding changes the ids."""
    for ids, text, reencoded in GOLDEN["decode_reencode"]:
        assert tok.decode(ids) == text
        assert tok.encode(text) == reencoded
    assert any(ids != reencoded for ids, _, reencoded in GOLDEN["decode_reencode"])
