"""Attention mask, 2-D RoPE positions and rotary tables on small hand-computed layouts."""

from __future__ import annotations

import math

import pytest
import torch

from components.engine.sequence import CondImage, ImageSlot, Sequence, SequenceBuilder, grid_positions
from components.engine.tokenizer import load_tokenizer
from components.engine.transformer import apply_rope, attention_mask, rope_cos_sin


def _mask_from_rows(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r] for r in rows])


# --------------------------------------------------------------------------- attention mask
def test_attention_mask_text_image_block_and_padding():
    """8 slots: 0 = left padding, 1-2 text, 3-6 a 2x2 image block, 7 text."""
    slots = torch.arange(8).unsqueeze(0)
    blocks = torch.tensor([[-1, -1, -1, 0, 0, 0, 0, -1]])
    valid = torch.tensor([[False, True, True, True, True, True, True, True]])
    mask = attention_mask(slots, slots, blocks, blocks, valid)
    assert mask.shape == (1, 1, 8, 8) and mask.dtype == torch.bool
    expected = _mask_from_rows([
        # keys 01234567
        "10000000",  # pad query: only itself (keeps the softmax finite)
        "01000000",  # text: causal, padding key masked
        "01100000",
        "01111110",  # image tokens: everything before + the whole block
        "01111110",
        "01111110",
        "01111110",
        "01111111",  # text after the image: causal
    ])
    assert torch.equal(mask[0, 0], expected)


def test_attention_mask_query_subset_two_blocks():
    """DiT-style: queries are slots 4..8 over keys 0..8; two full blocks (1-2 and 5-7), slot 4 causal."""
    q = torch.arange(4, 9).unsqueeze(0)
    k = torch.arange(9).unsqueeze(0)
    kb = torch.tensor([[-1, 0, 0, -1, -1, 1, 1, 1, -1]])
    qb = kb[:, 4:]
    mask = attention_mask(q, k, qb, kb)
    expected = _mask_from_rows([
        # keys 012345678
        "111110000",  # slot 4 (a <timestep>-like causal token): not the block after it
        "111111110",  # slot 5..7: block 1 in full
        "111111110",
        "111111110",
        "111111111",  # slot 8
    ])
    assert torch.equal(mask[0, 0], expected)


def test_attention_mask_batch_rows_are_independent():
    slots = torch.arange(4).expand(2, 4)
    blocks = torch.tensor([[-1, 0, 0, -1], [-1, -1, -1, -1]])
    valid = torch.tensor([[True] * 4, [False, False, True, True]])
    mask = attention_mask(slots, slots, blocks, blocks, valid)[:, 0]
    assert torch.equal(mask[0], _mask_from_rows(["1000", "1110", "1110", "1111"]))
    assert torch.equal(mask[1], _mask_from_rows(["1000", "0100", "0010", "0011"]))


# --------------------------------------------------------------------------- positions
def test_positions_text_and_2x3_image_block():
    """An h=2, w=3 image block at index L=3: y = 3 + (6-2)/2 + row = 5 + row, x = 3 + (6-3)/2 + col = 4.5 + col;
    text resumes at L + w*h = 9."""
    seq = Sequence(cond_ids=[0] * 11, uncond_ids=[0] * 11, gen_image=ImageSlot(timestep_index=2, start=3, h=2, w=3))
    expected = [(0, 0), (1, 1), (2, 2),
                (5, 4.5), (5, 5.5), (5, 6.5),
                (6, 4.5), (6, 5.5), (6, 6.5),
                (9, 9), (10, 10)]
    assert seq.positions().tolist() == [list(map(float, p)) for p in expected]
    assert seq.block_ids().tolist() == [-1, -1, -1, 0, 0, 0, 0, 0, 0, -1, -1]
    assert seq.full_blocks() == [(3, 9)]
    # the <timestep> token (index 2) is outside the full block: causal
    assert seq.block_ids()[2] == -1


def test_grid_positions_formula():
    g = grid_positions(10, 3, 2)  # h = 3, w = 2, wh = 6: y = 10 + 1.5 + row, x = 10 + 2 + col
    assert g.tolist() == [[11.5, 12], [11.5, 13], [12.5, 12], [12.5, 13], [13.5, 12], [13.5, 13]]


def test_positions_conditioning_image_vit_block():
    """Joint block: timestep 1 (causal), latent 1x2 at 2-3, <joint_img_sep> 4, ViT 5-9 (2x2 valid + 1 pad), <eoi> 10.

    Latent grid: y = 2 + (2-1)/2 = 2.5, x = 2 + 0 + col. ViT valid: y = 5 + (4-2)/2 + row, x = 5 + 1 + col.
    Separator, ViT padding and text keep flat positions."""
    slot = ImageSlot(timestep_index=1, start=2, h=1, w=2, vit_start=5, vit_len=5, vit_grid=(2, 2))
    seq = Sequence(cond_ids=[0] * 12, uncond_ids=[0] * 12, cond_images=[slot])
    expected = [(0, 0), (1, 1), (2.5, 2), (2.5, 3), (4, 4),
                (6, 6), (6, 7), (7, 6), (7, 7), (9, 9),
                (10, 10), (11, 11)]
    assert seq.positions().tolist() == [list(map(float, p)) for p in expected]
    assert seq.block_ids().tolist() == [-1, -1, 0, 0, 0, 0, 0, 0, 0, 0, -1, -1]
    assert slot.end == 10


def test_builder_sequence_positions_and_blocks():
    """The real builder: a conditioning image, then the generated image; each block's positions centred."""
    tok = load_tokenizer(None)
    b = SequenceBuilder(tok, 256)
    im = CondImage(latent_h=2, latent_w=3, ratio_index=20, vit_grid=(2, 2), vit_len=5)
    seq = b.dit_sequence("a cat", [im], None, "", 16)
    pos, blocks = seq.positions(), seq.block_ids()
    c, g = seq.cond_images[0], seq.gen_image
    L = c.start
    assert pos[L:L + 6].tolist() == [[L + 2 + r, L + 1.5 + col] for r in range(2) for col in range(3)]
    V = c.vit_start
    assert pos[V:V + 4].tolist() == [[V + 1 + r, V + 1 + col] for r in range(2) for col in range(2)]
    assert pos[V + 4].tolist() == [V + 4, V + 4]  # ViT padding: flat
    G = g.start  # 16 x 16 generated grid: wh - h = 240 -> y = G + 120 + row, x = G + 120 + col
    assert pos[G].tolist() == [G + 120, G + 120] and pos[G + 17].tolist() == [G + 121, G + 121]
    assert pos[G + 256].tolist() == [G + 256, G + 256]  # <eoi> resumes at L + w*h
    assert blocks[c.timestep_index] == -1 and blocks[g.timestep_index] == -1
    assert blocks[c.start:c.end].eq(0).all() and blocks[c.end] == -1
    assert blocks[g.start:g.end].eq(1).all() and seq.cond_ids[g.end:g.end + 2] == [tok.eoi, tok.answer_end]
    # the DiT's per-step mask (queries <timestep> + image): <timestep> sees only the prefix and itself
    q = torch.arange(g.timestep_index, g.end).unsqueeze(0)
    k = torch.arange(g.end).unsqueeze(0)
    m = attention_mask(q, k, blocks[g.timestep_index:g.end].unsqueeze(0), blocks[:g.end].unsqueeze(0))[0, 0]
    assert m[0, :g.timestep_index + 1].all() and not m[0, g.start:].any()
    assert m[1:].all()  # image tokens see everything before them and the whole image


# --------------------------------------------------------------------------- rotary tables
D, THETA = 16, 10000.0


def _inv_freq():
    return [THETA ** (-2 * j / D) for j in range(D // 2)]


def test_rope_text_positions_are_1d_rope():
    p = torch.tensor([0.0, 1.0, 5.0, 37.0])
    cos, sin = rope_cos_sin(torch.stack([p, p], -1), D, THETA)
    assert cos.dtype == torch.float32  # official build_2d_rope: float32 tables
    inv = _inv_freq()
    for t, pos in enumerate(p.tolist()):
        ang = [pos * f for f in inv] * 2  # rotate_half convention: the half repeats
        assert cos[t].tolist() == pytest.approx([math.cos(a) for a in ang], abs=1e-5)
        assert sin[t].tolist() == pytest.approx([math.sin(a) for a in ang], abs=1e-5)


def test_rope_image_positions_interleave_y_and_x_and_floor_the_centring():
    # a centred grid starts at L + (wh - w)/2, a half-integer for odd w: official positions are
    # integers (`.long()` of the float grid), so 7.5 acts as 7
    cos, sin = rope_cos_sin(torch.tensor([[3.0, 7.5]]), D, THETA)
    inv = _inv_freq()
    ang = [(3.0 if j % 2 == 0 else 7.0) * inv[j] for j in range(D // 2)] * 2
    assert cos[0].tolist() == pytest.approx([math.cos(a) for a in ang], abs=1e-6)
    assert sin[0].tolist() == pytest.approx([math.sin(a) for a in ang], abs=1e-6)


def test_rope_tables_are_bitwise_the_official_formula():
    """The official `build_2d_rope` arithmetic (float32 theta reshaped [1, d/4, 2], long (y, x)
    positions times theta, then repeated), written out here, equals ours bit for bit."""
    d = 128
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 22800, (300, 2), generator=gen).double() + 0.5 * torch.randint(0, 2, (300, 2), generator=gen)
    theta = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    theta = theta.reshape(1, d // 4, 2)
    all_pos = pos.long().unsqueeze(1)  # [T, 1, 2]
    idx_theta = (all_pos * theta).reshape(pos.shape[0], d // 2).repeat(1, 2)
    cos, sin = rope_cos_sin(pos, d, 10000.0)
    assert torch.equal(cos, torch.cos(idx_theta)) and torch.equal(sin, torch.sin(idx_theta))


def test_apply_rope_rotate_half_and_relative_property():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)
    pos = 4.0
    cos, sin = rope_cos_sin(torch.tensor([[[pos, pos]]]), D, THETA)
    out = apply_rope(x, cos.double(), sin.double())[0, 0, 0]
    v = x[0, 0, 0]
    h = D // 2
    exp = torch.empty(D, dtype=torch.float64)
    for j, f in enumerate(_inv_freq()):
        c, s = math.cos(pos * f), math.sin(pos * f)
        exp[j] = v[j] * c - v[j + h] * s
        exp[j + h] = v[j + h] * c + v[j] * s
    assert torch.allclose(out, exp, atol=1e-12)

    # text RoPE: q.k depends only on the position difference
    q = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)

    def dot(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[[pq, pq]]]), D, THETA)
        ck, sk = rope_cos_sin(torch.tensor([[[pk, pk]]]), D, THETA)
        return (apply_rope(q, cq.double(), sq.double()) * apply_rope(k, ck.double(), sk.double())).sum().item()

    assert dot(10.0, 3.0) == pytest.approx(dot(107.0, 100.0), abs=1e-5)  # float32 tables
    assert dot(10.0, 3.0) != pytest.approx(dot(10.0, 4.0), abs=1e-6)


def test_head_mask_attention_equals_full_boolean_mask():
    """`attend` with a HeadMask (mask on the first rows only, the rest unmasked) == SDPA with the full mask."""
    from components.engine.transformer import HeadMask, attend

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, t, s, d = 2, 4, 2, 5, 9, 16
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    head = torch.arange(s) <= 4  # the first query (a <timestep>) sees keys 0..4 only
    full = torch.ones(b, 1, t, s, dtype=torch.bool)
    full[:, :, 0] = head
    out = attend(q, k, v, HeadMask(head.view(1, 1, 1, s).expand(b, 1, 1, s), rows=1))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-6)
    unmasked = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert not torch.allclose(out[:, :, 0], unmasked[:, :, 0], atol=1e-3)  # the head mask is applied
