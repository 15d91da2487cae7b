"""Instruct sequence layout: the <cfg> uncond row, reuse boundaries, segment-wise tokenisation
(vLLM-Omni #3499) and the resolution buckets. Builder only: no model forward here."""

from __future__ import annotations

import pytest

from components.engine.sequence import (
    SYSTEM_PROMPTS,
    CondImage,
    ResolutionGroup,
    SequenceBuilder,
    first_difference,
    reuse_boundary,
)
from components.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def builder(tok):
    return SequenceBuilder(tok, 256)


# two conditioning-image footprints of different aspect ratios (token counts are what matter)
COND = [CondImage(latent_h=12, latent_w=20, ratio_index=12, vit_grid=(6, 10), vit_len=64),
        CondImage(latent_h=2, latent_w=3, ratio_index=20, vit_grid=(2, 2), vit_len=5)]


def _cot(tok, text):
    return tok.encode(text)


def _assistant(tok, bot_task, cot1, cot2):
    """Assistant ids as the AR feeds them (trigger, CoT, end tags, answer prefix), written by hand."""
    answer = [tok.answer, tok.boi, tok.size_id(256)]
    return {
        "think_recaption": [tok.think, *cot1, tok.think_end, tok.recaption, *cot2, tok.recaption_end, *answer],
        "think": [tok.think, *cot1, tok.think_end, *answer],
        "recaption": [tok.recaption, *cot2, tok.recaption_end, *answer],
        "image": answer,
    }[bot_task]


def _expected_rows(tok, system, images, user, bot_task, cot1, cot2, ratio, hw):
    """Cond and uncond rows built independently from the layout spec."""
    cfg = tok.cfg
    cond = [tok.bos] + (tok.encode(system) + tok.encode("\n\n") if system else []) + tok.encode("User: ")
    uncond = list(cond)
    for im in images:
        block = ([tok.boi, tok.size_id(256), tok.ratio_ids[im.ratio_index], tok.timestep]
                 + [tok.img] * (im.latent_h * im.latent_w) + [tok.joint_img_sep] + [tok.img] * im.vit_len + [tok.eoi])
        cond += block
        uncond += block
    u = tok.encode(user)
    cond += u
    uncond += [cfg] * len(u)
    tail = tok.encode("\n\n") + tok.encode("Assistant: ")
    cond += tail
    uncond += tail
    answer = [tok.answer, tok.boi, tok.size_id(256)]
    masked1, masked2 = [cfg] * len(cot1), [cfg] * len(cot2)
    cond_a = {
        "think_recaption": ([tok.think, *cot1, tok.think_end, tok.recaption, *cot2, tok.recaption_end],
                            [tok.think, *masked1, tok.think_end, tok.recaption, *masked2, tok.recaption_end]),
        "think": ([tok.think, *cot1, tok.think_end], [tok.think, *masked1, tok.think_end]),
        "recaption": ([tok.recaption, *cot2, tok.recaption_end], [tok.recaption, *masked2, tok.recaption_end]),
        "image": ([], []),
    }[bot_task]
    end = [tok.ratio_ids[ratio], tok.timestep] + [tok.img] * hw + [tok.eoi, tok.answer_end]
    cond += cond_a[0] + answer + end
    uncond += cond_a[1] + answer + end
    return cond, uncond


# --------------------------------------------------------------------------- the <cfg> row
@pytest.mark.parametrize("n_images", [0, 1, 2])
@pytest.mark.parametrize("bot_task", ["think_recaption", "think", "recaption", "image"])
def test_uncond_row_replaces_user_and_cot_text_token_for_token(tok, builder, bot_task, n_images):
    system = SYSTEM_PROMPTS["en_unified"]
    user = "make the sky purple and add a golden bird"
    cot1 = _cot(tok, "The user wants the image to show a bird")
    cot2 = _cot(tok, "a detailed description: purple sky, golden bird")
    images = COND[:n_images]
    ratio = 16  # 256 x 256 -> 16 x 16 latent grid
    assistant = _assistant(tok, bot_task, cot1, cot2)
    seq = builder.dit_sequence(user, images, assistant, system, ratio)
    cond, uncond = _expected_rows(tok, system, images, user, bot_task, cot1, cot2, ratio, 16 * 16)

    assert seq.cond_ids == cond
    assert seq.uncond_ids == uncond
    assert len(seq.uncond_ids) == len(seq.cond_ids)
    # only <cfg> differs; every differing position holds <cfg> in the uncond row
    diff = [i for i, (a, b) in enumerate(zip(cond, uncond)) if a != b]
    assert all(uncond[i] == tok.cfg for i in diff)
    n_user = len(tok.encode(user))
    n_cot = {"think_recaption": len(cot1) + len(cot2), "think": len(cot1), "recaption": len(cot2), "image": 0}
    assert len(diff) == n_user + n_cot[bot_task]
    # boundaries: neg = first <cfg>; pos = </recaption>, else </think>, else <answer>
    assert seq.neg_reuse_len == uncond.index(tok.cfg) == diff[0]
    pos_tag = {"think_recaption": tok.recaption_end, "think": tok.think_end, "recaption": tok.recaption_end,
               "image": tok.answer}[bot_task]
    assert seq.pos_reuse_len == cond.index(pos_tag)
    assert seq.neg_reuse_len < seq.pos_reuse_len
    # the uncond row's first <cfg> comes right after "User: " and the conditioning-image blocks
    prefix_len = 1 + len(tok.encode(system)) + len(tok.encode("\n\n")) + len(tok.encode("User: "))
    prefix_len += sum(4 + im.latent_h * im.latent_w + 1 + im.vit_len + 1 for im in images)
    assert seq.neg_reuse_len == prefix_len
    # the generated image slot
    gen = seq.gen_image
    assert cond[gen.timestep_index] == tok.timestep and cond[gen.timestep_index - 1] == tok.ratio_ids[ratio]
    assert (gen.h, gen.w) == (16, 16) and gen.start == gen.timestep_index + 1
    assert cond[gen.start + gen.h * gen.w:] == [tok.eoi, tok.answer_end]
    # conditioning image slots
    assert len(seq.cond_images) == n_images
    for slot, im in zip(seq.cond_images, images):
        assert cond[slot.timestep_index] == tok.timestep
        assert cond[slot.start - 1] == tok.timestep and slot.start == slot.timestep_index + 1
        assert cond[slot.vit_start - 1] == tok.joint_img_sep
        assert slot.vit_start == slot.start + im.latent_h * im.latent_w + 1
        assert cond[slot.end] == tok.eoi
        assert (slot.h, slot.w, slot.vit_len, slot.vit_grid) == (im.latent_h, im.latent_w, im.vit_len, im.vit_grid)


def test_ratio_token_in_assistant_ids_is_optional(tok, builder):
    cot = _cot(tok, "a cat")
    assistant = _assistant(tok, "think", cot, [])
    a = builder.dit_sequence("a cat", [], assistant, "", 20)
    b = builder.dit_sequence("a cat", [], assistant + [tok.ratio_ids[20]], "", 20)
    assert a.cond_ids == b.cond_ids and a.uncond_ids == b.uncond_ids
    # latent grid of ratio 20 (192 x 320) -> h = 20, w = 12
    assert (a.gen_image.h, a.gen_image.w) == (320 // 16, 192 // 16)


def test_assistant_ids_must_end_with_answer_prefix(tok, builder):
    with pytest.raises(ValueError, match="answer"):
        builder.dit_sequence("a cat", [], [tok.think, *tok.encode("cat"), tok.think_end], "", 16)


def test_no_system_prompt_neg_boundary_is_bos_plus_user_prefix(tok, builder):
    seq = builder.dit_sequence("a dog", [], _assistant(tok, "image", [], []), "", 16)
    assert seq.cond_ids[0] == tok.bos
    assert seq.neg_reuse_len == 1 + len(tok.encode("User: "))


def test_empty_user_text_without_cot_shares_everything_up_to_boundary(tok, builder):
    seq = builder.dit_sequence("", [], _assistant(tok, "image", [], []), SYSTEM_PROMPTS["en_vanilla"], 16)
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


def test_ar_prompt_uncond_row_and_triggers(tok, builder):
    user = "a red cat"
    for bot_task, trigger in [("think_recaption", [tok.think]), ("think", [tok.think]),
                              ("recaption", [tok.recaption]), ("image", [tok.answer, tok.boi, tok.size_id(256)])]:
        seq = builder.ar_prompt(user, COND[:1], bot_task, SYSTEM_PROMPTS["en_unified"])
        assert seq.cond_ids[seq.assistant_start:] == trigger
        assert seq.cond_ids[seq.assistant_start - len(tok.encode("Assistant: ")):seq.assistant_start] == \
            tok.encode("Assistant: ")
        n = len(tok.encode(user))
        assert seq.uncond_ids[seq.neg_reuse_len:seq.neg_reuse_len + n] == [tok.cfg] * n
        assert seq.cond_ids[seq.neg_reuse_len:seq.neg_reuse_len + n] == tok.encode(user)
    with pytest.raises(ValueError, match="bot_task"):
        builder.ar_prompt(user, [], "auto", "")


# --------------------------------------------------------------------------- segment tokenisation (#3499)
def test_bpe_is_not_additive_over_segments(tok):
    """BPE(A + B) != BPE(A) + BPE(B) for the tiny tokenizer, as for the real one."""
    pairs = [("User: ", "a cat"), ("a red", "dish"), ("make the sky ", "purple"), ("sun", "set")]
    for a, b in pairs:
        assert tok.encode(a + b) != tok.encode(a) + tok.encode(b), (a, b)
    # and encoding the whole AR prompt text at once is not the segment-wise encoding
    system, user = SYSTEM_PROMPTS["en_unified"], "make the sky purple"
    whole = tok.encode(system + "\n\n" + "User: " + user + "\n\n" + "Assistant: ")
    segments = (tok.encode(system) + tok.encode("\n\n") + tok.encode("User: ") + tok.encode(user)
                + tok.encode("\n\n") + tok.encode("Assistant: "))
    assert whole != segments


@pytest.mark.parametrize("n_images", [0, 2])
@pytest.mark.parametrize("bot_task", ["think_recaption", "think", "recaption", "image"])
def test_ar_prompt_is_a_prefix_of_the_dit_sequence(tok, builder, bot_task, n_images):
    system, user = SYSTEM_PROMPTS["en_unified"], "make the sky purple"
    ar = builder.ar_prompt(user, COND[:n_images], bot_task, system)
    cot1, cot2 = tok.encode("sunset"), tok.encode("a red dish")
    full_assistant = _assistant(tok, bot_task, cot1, cot2)
    trigger = ar.cond_ids[ar.assistant_start:]
    assert full_assistant[:len(trigger)] == trigger
    dit = builder.dit_sequence(user, COND[:n_images], full_assistant, system, 16)
    n = len(ar.cond_ids)
    assert dit.cond_ids[:n] == ar.cond_ids
    assert dit.uncond_ids[:n] == ar.uncond_ids
    assert dit.neg_reuse_len == ar.neg_reuse_len
    assert dit.assistant_start == ar.assistant_start
    assert [(s.start, s.end) for s in dit.cond_images] == [(s.start, s.end) for s in ar.cond_images]
    assert dit.positions()[:n].tolist() == ar.positions().tolist()
    assert dit.block_ids()[:n].tolist() == ar.block_ids().tolist()


# --------------------------------------------------------------------------- resolution buckets
def _hand_buckets_1024():
    wide = [(1024 + 64 * i, 1024 - 64 * i) for i in range(1, 9)] + [(1536 + 64 * i, 512) for i in range(1, 9)]
    tall = [(h, w) for w, h in wide]
    return list(reversed(wide)) + [(1024, 1024)] + tall


def test_resolution_group_1024():
    g = ResolutionGroup(1024)
    assert len(g) == 37
    sizes = [g.size(i) for i in range(37)]
    assert sizes[:33] == _hand_buckets_1024()
    assert sizes[33:] == [(1024, 768), (1280, 720), (768, 1024), (720, 1280)]
    ratios = [h / w for w, h in sizes[:33]]
    assert ratios == sorted(ratios) and len(set(ratios)) == 33
    assert all(w % 16 == 0 and h % 16 == 0 for w, h in sizes)
    assert sizes[16] == (1024, 1024)
    assert (1216, 832) in sizes and (832, 1216) in sizes
    # index_of: exact sizes only
    assert g.index_of(1024, 1024) == 16
    assert g.index_of(1280, 720) == 34
    assert g.index_of(2048, 512) == 0 and g.index_of(512, 2048) == 32
    assert g.index_of(1000, 1000) is None
    # nearest: closest aspect ratio among the 33 main buckets
    assert g.nearest(1000, 1000) == 16
    assert g.nearest(500, 500) == 16
    assert g.size(g.nearest(2000, 1000)) == (1344, 704)  # 0.5238 is closer to 0.5 than 0.4545
    assert g.size(g.nearest(1000, 2000)) == (704, 1344)
    assert g.nearest(4000, 100) == 0 and g.nearest(100, 4000) == 32
    assert g.size(g.nearest(1280, 720)) == (1280, 768)  # never an extra bucket
    assert g.size(g.nearest(1216, 832)) == (1216, 832)


def test_resolution_group_tiny_base():
    g = ResolutionGroup(256)
    assert len(g) == 37
    sizes = [g.size(i) for i in range(37)]
    assert sizes[16] == (256, 256) and sizes[0] == (512, 128) and sizes[32] == (128, 512)
    assert all(w % 16 == 0 and h % 16 == 0 for w, h in sizes)
    assert sizes[33:] == [(256, 192), (320, 176), (192, 256), (176, 320)]


# --------------------------------------------------------------------------- tokenizer + PromptKV contract
def test_tiny_tokenizer_special_tokens(tok):
    from components.engine.config import tiny_config
    from components.engine.tokenizer import SPECIAL_TOKENS

    ids = [tok.token_id(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) == 17 + 3 + 37
    assert len(tok.ratio_ids) == 37 and tok.ratio_ids == [tok.token_id(f"<img_ratio_{i}>") for i in range(37)]
    assert tok.special_ids == set(ids)
    assert tok.vocab_size <= tiny_config().vocab_size
    # special-token strings in text stay text (no control-token injection); ids decode back to them
    assert not set(tok.encode("<think> </recaption>")) & tok.special_ids
    assert tok.decode([tok.think, tok.recaption_end]) == "<think></recaption>"
    assert not set(tok.encode(SYSTEM_PROMPTS["en_unified"])) & tok.special_ids
    assert tok.decode(tok.encode("a red cat on a boat")) == "a red cat on a boat"
    with pytest.raises(KeyError):
        tok.token_id("<no_such_token>")


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
