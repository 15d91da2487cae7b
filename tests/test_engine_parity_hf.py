"""Decoder parity against an independent implementation: transformers' `hunyuan_v1_moe`
(HunYuanMoEV1: QK-norm after RoPE, softmax top-k router with renormalised weights, shared MLP).

The same tiny weights are mapped into `HunYuanMoEV1ForCausalLM` and both models score a causal text
sequence in float32. Two true differences between the architectures are handled in the mapping
(docs/fidelity.md lists them):

- the fused projections: HunyuanImage-3 stores Q/K/V interleaved per KV head in one `qkv_proj`
  ([groups x Q, K, V] per KV head), HunYuanMoEV1 has separate q/k/v projections;
- the SwiGLU chunk order: HunyuanImage-3 computes `x1 * silu(x2)` on the two halves of
  `gate_and_up_proj` (the activation on the SECOND half), HunYuanMoEV1 `silu(gate) * up` on
  (first, second): its gate is our second half.
"""

from __future__ import annotations

import pytest
import torch

from components.engine.config import tiny_config
from components.engine.transformer import HunyuanImage3ForCausalMM, attention_mask
from components.engine.weights import init_dummy_weights


def _hf_model(cfg):
    from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM

    hf_cfg = HunYuanMoEV1Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.attention_head_dim, intermediate_size=cfg.layer("moe_intermediate_size", 0),
        num_experts=cfg.layer("num_experts", 0), moe_topk=cfg.layer("moe_topk", 0), rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=False, max_position_embeddings=cfg.max_position_embeddings,
    )
    hf_cfg._attn_implementation = "eager"
    return HunYuanMoEV1ForCausalLM(hf_cfg).eval()


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """Our fused [x1; x2] (activation on x2) -> HF's [gate; up] (activation on gate)."""
    x1, x2 = w.chunk(2, dim=-2)
    return torch.cat([x2, x1], dim=-2)


@torch.no_grad()
def _map_weights(ours: HunyuanImage3ForCausalMM, hf) -> None:
    cfg = ours.config
    kv, groups, d = cfg.num_key_value_heads, cfg.num_kv_groups, cfg.attention_head_dim
    hf.model.embed_tokens.weight.copy_(ours.model.wte.weight)
    hf.model.norm.weight.copy_(ours.model.ln_f.weight)
    hf.lm_head.weight.copy_(ours.lm_head.weight)
    for mine, theirs in zip(ours.model.layers, hf.model.layers):
        attn, hattn = mine.self_attn, theirs.self_attn
        qkv = attn.qkv_proj.weight.view(kv, groups + 2, d, cfg.hidden_size)
        hattn.q_proj.weight.copy_(qkv[:, :groups].reshape(-1, cfg.hidden_size))
        hattn.k_proj.weight.copy_(qkv[:, groups].reshape(-1, cfg.hidden_size))
        hattn.v_proj.weight.copy_(qkv[:, groups + 1].reshape(-1, cfg.hidden_size))
        hattn.o_proj.weight.copy_(attn.o_proj.weight)
        hattn.query_layernorm.weight.copy_(attn.query_layernorm.weight)
        hattn.key_layernorm.weight.copy_(attn.key_layernorm.weight)
        theirs.input_layernorm.weight.copy_(mine.input_layernorm.weight)
        theirs.post_attention_layernorm.weight.copy_(mine.post_attention_layernorm.weight)
        moe, hmoe = mine.mlp, theirs.mlp
        hmoe.gate.wg.weight.copy_(moe.gate.wg.weight)
        hmoe.experts.gate_up_proj.copy_(_swap_halves(moe.experts.gate_and_up_proj))
        hmoe.experts.down_proj.copy_(moe.experts.down_proj)
        x1, x2 = moe.shared_mlp.gate_and_up_proj.weight.chunk(2, dim=0)
        hmoe.shared_mlp.gate_proj.weight.copy_(x2)
        hmoe.shared_mlp.up_proj.weight.copy_(x1)
        hmoe.shared_mlp.down_proj.weight.copy_(moe.shared_mlp.down_proj.weight)


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config()
    with torch.device("meta"):
        ours = HunyuanImage3ForCausalMM(cfg, with_conditioning=False)
    ours = ours.to_empty(device="cpu").float().eval()
    init_dummy_weights(ours, seed=3)
    hf = _hf_model(cfg)
    _map_weights(ours, hf)
    return ours, hf


def _our_logits(model: HunyuanImage3ForCausalMM, ids: torch.Tensor) -> torch.Tensor:
    t = ids.shape[1]
    slots = torch.arange(t).unsqueeze(0)
    none = torch.full((1, t), -1)
    mask = attention_mask(slots, slots, none, none)
    positions = torch.arange(t, dtype=torch.float64).unsqueeze(-1).repeat(1, 2).unsqueeze(0)
    hidden = model.forward_layers(model.embed_ids(ids), positions, mask, None)
    return model.text_logits(hidden)


def test_logits_match_transformers_hunyuan_v1_moe(models):
    ours, hf = models
    ids = torch.randint(0, ours.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = _our_logits(ours, ids)
        theirs = hf(input_ids=ids).logits.float()
    assert mine.shape == theirs.shape
    assert (mine - theirs).abs().max().item() <= 1e-5
    assert mine.abs().max().item() > 0.1  # real signal, not two zero tensors


def test_swiglu_chunk_order_is_a_true_difference(models):
    """Negative control: mapping the fused gate/up halves without the swap breaks the parity, so the
    test above can fail and the chunk order is documented, not assumed."""
    ours, hf = models
    ids = torch.randint(0, ours.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        saved = [layer.mlp.experts.gate_up_proj.clone() for layer in hf.model.layers]
        for layer, mine in zip(hf.model.layers, ours.model.layers):
            layer.mlp.experts.gate_up_proj.copy_(mine.mlp.experts.gate_and_up_proj)
        wrong = hf(input_ids=ids).logits.float()
        for layer, w in zip(hf.model.layers, saved):
            layer.mlp.experts.gate_up_proj.copy_(w)
        right = hf(input_ids=ids).logits.float()
        mine = _our_logits(ours, ids)
    assert (mine - right).abs().max().item() <= 1e-5
    assert (mine - wrong).abs().max().item() > 1e-3
