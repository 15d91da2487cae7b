"""The HunyuanImage-3 transformer: one set of weights for text AR and image denoising.

Module and parameter names follow the official `HunyuanImage3ForCausalMM` (`model.wte`,
`model.layers.N.self_attn.qkv_proj`, `...mlp.gate.wg`, `patch_embed`, `final_layer`, ...), except
that routed experts are stored stacked (`mlp.experts.gate_and_up_proj` [E, 2I, H]) for the grouped
GEMM; `weights.py` maps them to and from the official per-expert names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import HunyuanImage3Config
from .kernels import attention as flex_kernels
from .kernels.compiled_layers import run_layers
from .kernels.moe import choose_impl, moe_fused, sort_by_expert, start_on_side_stream


# -- building blocks ------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """float32 cos/sin [..., T, head_dim] for (y, x) positions [..., T, 2], as the official
    `build_2d_rope`: integer positions (a centred image grid floors its half-integer offset),
    inverse frequencies and angles in float32.

    Rotary pair j uses frequency theta^(-2j/d) on axis y (j even) or x (j odd), the official
    interleaving; text has y == x, so it is exactly ordinary 1-D RoPE.
    """
    device = positions.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    axis = torch.arange(head_dim // 2, device=device) % 2
    angles = positions.floor().long()[..., axis] * inv_freq  # [..., T, half], float32
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] in the model dtype; cos/sin [B, T, D] float32. The result is float32, as in
    the official code (bf16 * fp32 promotes), and QK-norm then runs on it before the cast back."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class KVCache:
    """Preallocated per-layer K/V [B, kv_heads, capacity, head_dim]; `length` slots are filled.

    A forward writes its new K/V at [length, length + T) in every layer; `commit()` then makes
    them part of the prefix (AR decode), while the DiT's per-step image tokens are never committed
    and are overwritten by the next step.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, rows: int | None = None,
                 first_layer: int = 0) -> None:
        # first_layer: a pipeline stage's cache holds layers [first_layer, first_layer + num_layers)
        # only; `update` takes the global layer index, `k[i]` / `v[i]` are the stage's i-th layer
        self.first_layer = first_layer
        # rows > batch: buffers with spare batch rows for the static-shape decode (kernels/decode.py),
        # which pads the batch up to a bucket; `k` / `v` show the first `batch` rows
        shape = (max(rows or batch, batch), kv_heads, capacity, head_dim)
        self.k_rows = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_rows = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        padded = shape[0] > batch
        self.k = [t[:batch] for t in self.k_rows] if padded else self.k_rows
        self.v = [t[:batch] for t in self.v_rows] if padded else self.v_rows
        self.length = 0
        self._pending = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        end = self.length + t
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
        layer -= self.first_layer
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        self._pending = t
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    @classmethod
    def from_rows(cls, rows: list["KVCache"], extra_capacity: int) -> "KVCache":
        """Stack batch-1 caches of equal length into one batch (the DiT's [cond; uncond])."""
        length = rows[0].length
        if any(r.length != length for r in rows):
            raise ValueError("rows must have equal prefix lengths to be stacked")
        k0 = rows[0].k[0]
        out = cls(len(rows[0].k), len(rows), k0.shape[1], k0.shape[3], length + extra_capacity, k0.dtype, k0.device,
                  first_layer=rows[0].first_layer)
        for layer in range(len(out.k)):
            out.k[layer][:, :, :length] = torch.cat([r.k[layer][:, :, :length] for r in rows])
            out.v[layer][:, :, :length] = torch.cat([r.v[layer][:, :, :length] for r in rows])
        out.length = length
        return out


@dataclass
class HeadMask:
    """A mask for the first `rows` queries only; the remaining queries see every key.

    The DiT's denoising step is `<timestep>` (causal) followed by the image block, which attends
    to the whole prefix and itself: its queries need no mask, so SDPA can take its flash kernel.
    """

    mask: torch.Tensor  # bool [B, 1, rows, S]
    rows: int


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over k, v [B, Hkv, S, D] (GQA) under `mask`: None, a bool
    [B, 1, T, S], a HeadMask or a SlotMask. A SlotMask goes to flex attention with its block mask
    when the `attention` kernel setting selects flex (causal SDPA where the rule is plain causal),
    else to SDPA with its dense bool mask, exactly as a bool mask would."""
    if isinstance(mask, HeadMask):
        head = F.scaled_dot_product_attention(q[:, :, :mask.rows], k, v, attn_mask=mask.mask, enable_gqa=True)
        tail = F.scaled_dot_product_attention(q[:, :, mask.rows:], k, v, enable_gqa=True)
        return torch.cat([head, tail], dim=2)
    if hasattr(mask, "attend"):  # a kernel's own mask type computes the attention (kernels/decode.py)
        return mask.attend(q, k, v)
    if isinstance(mask, SlotMask):
        if kernels.enabled("attention", q, "flex"):
            if flex_kernels.CAUSAL_SDPA and mask.is_causal():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if kernels.settings().attention == "flex" or flex_kernels.worth_flex(q, k):
                slot_mask = mask  # a failed compile or launch at this shape: SDPA with the dense mask
                return kernels.run_fast(
                    "flex_attention", flex_kernels.shape_key(q, k),
                    lambda: flex_kernels.flex_attend(q, k, v, slot_mask.block_mask()),
                    lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=slot_mask.dense(), enable_gqa=True))
        mask = mask.dense()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    """GQA with QK-norm (RMSNorm on Q and K after RoPE, as in the official code)."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        # head counts are per rank once tensor parallelism has sliced the projections
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim)
        self.groups = self.num_heads // self.num_kv_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.query_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        return self.output(attend(q, k, v, mask))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> q [B, Hq, T, D], k and v [B, Hkv, T, D] (RoPE and QK-norm applied)."""
        b, t, _ = x.shape
        # Official fused layout: per KV head, [groups query heads, 1 key, 1 value].
        qkv = self.qkv_proj(x).view(b, t, self.num_kv_heads, self.groups + 2, self.head_dim)
        q, k, v = qkv.split([self.groups, 1, 1], dim=3)
        q = q.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = self.query_layernorm(apply_rope(q, cos, sin)).to(v.dtype)
        k = self.key_layernorm(apply_rope(k, cos, sin)).to(v.dtype)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU with the official fused `gate_and_up_proj`: down(x1 * silu(x2)) on its two halves."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.gate_and_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(x1 * F.silu(x2))


class TopKGate(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)  # kept in fp32, as in the checkpoint


class Experts(nn.Module):
    """All routed experts' weights stacked: [E, 2I, H] and [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_and_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        nn.init.normal_(self.gate_and_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x, weights, experts, impl: str) -> torch.Tensor:
        """Routed output for tokens x [N, H] sent to `experts` [N, k] with `weights` [N, k];
        impl: loop | grouped | fused (kernels/moe.py). Quantized experts (quant.Fp8Experts)
        replace this module with the same call."""
        args = (x, weights, experts, self.gate_and_up_proj, self.down_proj)
        if impl == "fused":  # a failure of the fused dispatch at this size: the grouped GEMMs (or the loop)
            plain = moe_grouped if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") else moe_loop
            return kernels.run_fast("moe", kernels.moe_key(x), lambda: moe_fused(*args), lambda: plain(*args))
        return {"loop": moe_loop, "grouped": moe_grouped}[impl](*args)


class MoE(nn.Module):
    """Softmax router, top-k renormalised, plus the shared expert.

    Tokens are never dropped unless `drop_tokens` is set (the official eager path's capacity
    rule: an expert takes at most max(k, k*N/E) * capacity_factor tokens, top-1 choices first).
    """

    # "auto": the `moe` kernel setting decides (kernels.moe.choose_impl: fused for CUDA bf16, else
    # the per-expert loop); "loop" | "grouped" | "fused" force one path
    impl: str = "auto"

    def __init__(self, cfg: HunyuanImage3Config, layer: int = 0) -> None:
        super().__init__()
        self.top_k = cfg.layer("moe_topk", layer)
        self.num_experts = cfg.layer("num_experts", layer)
        intermediate = cfg.layer("moe_intermediate_size", layer)
        self.shared_mlp = (MLP(cfg.hidden_size, intermediate * cfg.layer("num_shared_expert", layer), cfg.mlp_bias)
                           if cfg.use_mixed_mlp_moe else None)
        self.gate = TopKGate(cfg.hidden_size, self.num_experts)
        self.experts = Experts(self.num_experts, cfg.hidden_size, intermediate)
        self.norm_topk_prob = cfg.norm_topk_prob
        self.capacity_factor = cfg.capacity_factor
        self.drop_tokens = False  # set by Engine.load(moe_drop_tokens=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate.wg(x.float()).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).eps)
        if self.drop_tokens:
            weights = weights * _within_capacity(experts, self.num_experts, self.capacity_factor)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        impl = choose_impl(flat) if self.impl == "auto" else self.impl
        shared = None
        if self.shared_mlp is not None and impl == "fused":  # on a side stream, beside the routed experts
            shared = start_on_side_stream(self.shared_mlp, x)
        weights, experts = self.route(flat)
        routed = self.experts(flat, weights, experts, impl).view(shape)
        if self.shared_mlp is None:
            return routed
        return (shared() if shared is not None else self.shared_mlp(x)) + routed


def _within_capacity(experts: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """[N, k] 1/0: whether each (token, slot) choice fits its expert's capacity. Priority follows
    the official `topkgating`: all tokens' first choices, then all second choices, ..."""
    n, k = experts.shape
    capacity = int(max(k, k * n // num_experts) * capacity_factor)
    slot_major = experts.t().reshape(-1)  # [k * N]: slot 0 of every token first
    one_hot = F.one_hot(slot_major, num_experts)
    priority = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place of this choice in its expert's queue
    return (priority < capacity).view(k, n).t().to(torch.float32)


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    a, b = h.chunk(2, dim=-1)
    return a * F.silu(b)


@torch.compiler.disable  # per-expert token counts are data-dependent: a compiled layer runs this eagerly
def moe_loop(x, weights, experts, w_gate_up, w_down) -> torch.Tensor:
    """Reference path: one GEMM pair per expert over the tokens routed to it."""
    n, k = experts.shape
    per_slot = torch.zeros(n, k, x.shape[1], dtype=x.dtype, device=x.device)
    for e in range(w_gate_up.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        per_slot[token, slot] = _swiglu(x[token] @ w_gate_up[e].T) @ w_down[e].T
    return _combine(per_slot, weights)


def _combine(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each token's k expert outputs [N, k, H] as one batched matmul in the model
    dtype (fp32 accumulation): no atomics, so results are bitwise reproducible on GPUs
    (index_add_ is not), and no fp32 copy of the N*k*H outputs."""
    return torch.bmm(weights.unsqueeze(1).to(per_slot.dtype), per_slot).squeeze(1)


def moe_grouped(x, weights, experts, w_gate_up, w_down) -> torch.Tensor:
    """Grouped-GEMM path (`torch._grouped_mm`): tokens sorted by expert, one launch per GEMM."""
    order, token, offs = sort_by_expert(experts, w_gate_up.shape[0])
    xs = x[token]
    h = _swiglu(torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)
    per_slot = torch.empty_like(y)
    per_slot[order] = y  # back to (token, slot) order
    return _combine(per_slot.view(*experts.shape, -1), weights)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the first moe_layer_num_skipped layers are dense (none in the released model)
        self.mlp = MoE(cfg, index) if cfg.is_moe_layer(index) else MLP(cfg.hidden_size, cfg.intermediate_size,
                                                                       cfg.mlp_bias)

    def forward(self, x, cos, sin, mask, cache, layer):
        q, k, v = self.attention_inputs(x, cos, sin)
        return self.finish(x, self.cached_attention(q, k, v, mask, cache, layer))

    # The layer around its attention call, in two parts that depend only on x's shape (not on the
    # cache length or the layer index): what `kernels.compiled_layers` compiles, once for all layers.
    # The middle, `cached_attention`, stays eager.
    def attention_inputs(self, x, cos, sin):
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    @staticmethod
    def cached_attention(q, k, v, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        """The step's K/V written to the cache (when there is one), then attention over it."""
        if cache is not None:
            k, v = cache.update(layer, k, v)
        return attend(q, k, v, mask)

    def finish(self, x, attention_out):
        x = x + self.self_attn.output(attention_out)
        return x + self.mlp(self.post_attention_layernorm(x))


class HunyuanImage3Model(nn.Module):
    """The decoder stack (`model.` in the checkpoint)."""

    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# -- timestep and image heads ---------------------------------------------------------------------
def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """256-d sinusoid -> Linear -> GELU -> Linear."""

    def __init__(self, hidden: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.freq_dim).to(self.mlp[0].weight.dtype))


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, channels), channels)


class ResBlock(nn.Module):
    """Timestep-conditioned residual block (adaptive GroupNorm scale/shift), official names."""

    def __init__(self, in_channels: int, emb_channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_layers = nn.Sequential(_group_norm(in_channels), nn.SiLU(),
                                       nn.Conv2d(in_channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels))
        self.out_layers = nn.Sequential(_group_norm(out_channels), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(out_channels, out_channels, 3, padding=1))
        self.skip_connection = (nn.Identity() if in_channels == out_channels
                                else nn.Conv2d(in_channels, out_channels, 1))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb)[..., None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1 + scale) + shift
        h = self.out_layers[3](self.out_layers[2](self.out_layers[1](h)))
        return self.skip_connection(x) + h


class UNetDown(nn.Module):
    """Patch embed (patch size 1): 3x3 conv to the hidden channels, then a ResBlock to the model width."""

    def __init__(self, in_channels: int, emb_channels: int, hidden_channels: int, out_channels: int) -> None:
        super().__init__()
        self.model = nn.ModuleList([nn.Conv2d(in_channels, hidden_channels, 3, padding=1),
                                    ResBlock(hidden_channels, emb_channels, out_channels)])

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = self.model[1](self.model[0](x), emb)
        return x.flatten(2).transpose(1, 2)  # [B, h*w, C]


class UNetUp(nn.Module):
    """Image output head: ResBlock back to the hidden channels, GroupNorm + SiLU + 3x3 conv to latents."""

    def __init__(self, in_channels: int, emb_channels: int, hidden_channels: int, out_channels: int) -> None:
        super().__init__()
        self.model = nn.ModuleList([
            ResBlock(in_channels, emb_channels, hidden_channels),
            nn.Sequential(_group_norm(hidden_channels), nn.SiLU(),
                          nn.Conv2d(hidden_channels, out_channels, 3, padding=1)),
        ])

    def forward(self, x: torch.Tensor, emb: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)
        return self.model[1](self.model[0](x, emb))


# -- the whole model ------------------------------------------------------------------------------
class HunyuanImage3ForCausalMM(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config, with_conditioning: bool = True) -> None:
        super().__init__()
        self.config = cfg
        hidden, latent = cfg.hidden_size, cfg.vae.latent_channels
        if with_conditioning:  # VAE and ViT; performance runs of the layer stack leave them out
            from .vae import build_vae
            from .vit import LightProjector, build_vision_model

            self.vae = build_vae(cfg.vae)
            self.vision_model = build_vision_model(cfg.vit)
            self.vision_aligner = LightProjector(cfg.vit.hidden_size, hidden, cfg.vit.aligner_depth)
        self.timestep_emb = TimestepEmbedder(hidden)
        if cfg.cfg_distilled:  # Instruct-Distil: the guidance scale enters as a token
            self.guidance_emb = TimestepEmbedder(hidden)
        if cfg.use_meanflow:  # Instruct-Distil: the next timestep r enters as a token
            self.timestep_r_emb = TimestepEmbedder(hidden)
        self.patch_embed = UNetDown(latent, hidden, cfg.patch_embed_hidden_dim, hidden)
        self.time_embed = TimestepEmbedder(hidden)
        self.final_layer = UNetUp(hidden, hidden, cfg.patch_embed_hidden_dim, latent)
        self.time_embed_2 = TimestepEmbedder(hidden)
        self.model = HunyuanImage3Model(cfg)
        self.lm_head = nn.Linear(hidden, cfg.vocab_size, bias=False)
        self.stage_layers = range(cfg.num_hidden_layers)  # the decoder layers this pipeline stage holds
        # the hand-offs around them when the model runs in several pipeline stages (set from outside,
        # by parallel.parallelize: the runtime's PipelineStages), else None
        self.stages = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.wte.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.wte.weight.device

    def new_cache(self, batch: int, capacity: int, rows: int | None = None) -> KVCache:
        attn = self.first_attention()  # per-rank head count under tensor parallelism
        return KVCache(len(self.stage_layers), batch, attn.num_kv_heads, attn.head_dim, capacity,
                       self.dtype, self.device, rows, first_layer=self.stage_layers.start)

    def first_attention(self) -> "Attention":
        """The attention of this stage's first decoder layer (its head counts are this rank's)."""
        return self.model.layers[self.stage_layers.start].self_attn

    @property
    def pipeline(self):
        """This rank's ParallelContext when the model runs in several pipeline stages, else None."""
        parallel = getattr(self, "parallel", None)
        return parallel if parallel is not None and parallel.pp_size > 1 else None

    def kv_hash(self) -> str:
        """What a prompt's K/V depends on besides its tokens: the config, and how the weights are
        stored (FP8 weights give other K/V than bf16 ones, so their payloads are not interchangeable)."""
        import hashlib

        base = self.config.config_hash()
        quantization = getattr(self, "quantization", None)
        return base if not quantization else hashlib.sha256(f"{base}:{quantization}".encode()).hexdigest()[:16]

    def autocast(self):
        """The official pipeline runs the transformer under CUDA autocast in the model dtype (so,
        e.g., the fp32 router projection computes in bf16); the same context makes ardit match it.
        On the CPU and in float32 it does nothing."""
        import contextlib

        if self.device.type != "cuda" or self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.dtype)

    # embeddings of the different token kinds
    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.wte(ids)

    def timestep_tokens(self, t: torch.Tensor) -> torch.Tensor:
        return self.timestep_emb(t)

    def guidance_tokens(self, guidance: torch.Tensor) -> torch.Tensor:
        """Instruct-Distil's `<guidance>` token: the embedding of 1000 x the guidance scale."""
        return self.guidance_emb(guidance)

    def timestep_r_tokens(self, r: torch.Tensor) -> torch.Tensor:
        """Instruct-Distil's `<timestep_r>` token (meanflow): the embedding of the next timestep."""
        return self.timestep_r_emb(r)

    def image_tokens(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(latents.to(self.dtype), self.time_embed(t))

    def image_output(self, hidden: torch.Tensor, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Raw last-layer hidden states of image tokens -> latent-space prediction (no ln_f)."""
        return self.final_layer(hidden, self.time_embed_2(t), h, w)

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.ln_f(hidden)).float()

    def forward_layers(self, x: torch.Tensor, positions: torch.Tensor, mask, cache: KVCache | None,
                       compiled: bool = False, layers: range | None = None, prefill: bool = False) -> torch.Tensor:
        """x [B, T, H]; positions [B, T, 2] (y, x); mask bool [B, 1, T, S], a SlotMask, a HeadMask,
        or None (one mask object for all layers: a SlotMask makes its dense or block mask once).
        `compiled`: run each layer through its torch.compile'd regions (DiT denoising steps).
        `layers`: run only these decoder layers (the DiT step cache runs the first one apart).
        `prefill`: x is a prompt chunk, compiled (with `compiled`) in graphs of any token count."""
        if self.stages is not None and layers is None:  # this stage's layers, between its hand-offs
            return self.stages.across(
                x, lambda h: self.forward_layers(h, positions, mask, cache, compiled, layers=self.stage_layers,
                                                 prefill=prefill))
        cos, sin = rope_cos_sin(positions, self.config.attention_head_dim, self.config.rope_theta)
        indices = layers if layers is not None else self.stage_layers
        if compiled:
            return run_layers(self, x, cos, sin, mask, cache, indices, prefill)
        for i in indices:
            x = self.model.layers[i](x, cos, sin, mask, cache, i)
        return x


def attention_mask(q_slots: torch.Tensor, k_slots: torch.Tensor, q_blocks: torch.Tensor,
                   k_blocks: torch.Tensor, k_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, 1, T, S]: causal over cache slots, plus full attention inside each image block.

    q_slots [B, T] / k_slots [B, S]: cache slot of each query / key; *_blocks: block id or -1;
    k_valid [B, S]: False for padding keys. A query always sees itself, so padding rows stay finite.
    """
    valid = None if k_valid is None else k_valid[:, None, :]
    mask = visible(q_slots[:, :, None], k_slots[:, None, :], q_blocks[:, :, None], k_blocks[:, None, :], valid)
    return mask.unsqueeze(1)


def visible(q: torch.Tensor, k: torch.Tensor, qb: torch.Tensor, kb: torch.Tensor,
            k_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The attention rule, elementwise on broadcastable slot / block id / validity tensors: the
    dense mask (`attention_mask`) and flex attention's mask_mod both evaluate it."""
    see = (k <= q) | ((qb == kb) & (qb >= 0))
    if k_valid is not None:
        see = see & k_valid
    return see | (k == q)


@dataclass(eq=False)
class SlotMask:
    """The inputs of `attention_mask`, kept as structure so attention can choose its kernel: SDPA
    with the dense bool mask (`dense()`), flex attention with a BlockMask (`block_mask()`), or
    causal SDPA where the rule is plain causal (`is_causal()`). Whichever is asked for is made
    once (on the mask's device) and then shared by every layer of the forward."""

    q_slots: torch.Tensor  # [B, T] cache slot of each query
    k_slots: torch.Tensor  # [B, S] cache slot of each key
    q_blocks: torch.Tensor  # [B, T] image block id or -1
    k_blocks: torch.Tensor  # [B, S]
    k_valid: torch.Tensor | None = None  # [B, S] False for padding keys

    def __post_init__(self) -> None:
        self._made: dict = {}

    def to(self, device: torch.device | str) -> "SlotMask":
        return SlotMask(*(None if t is None else t.to(device) for t in
                          (self.q_slots, self.k_slots, self.q_blocks, self.k_blocks, self.k_valid)))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.q_slots.shape[0], 1, self.q_slots.shape[1], self.k_slots.shape[1]

    def dense(self) -> torch.Tensor:
        if "dense" not in self._made:
            self._made["dense"] = attention_mask(self.q_slots, self.k_slots, self.q_blocks, self.k_blocks,
                                                 self.k_valid)
        return self._made["dense"]

    def is_causal(self) -> bool:
        """Whether the rule reduces to causal attention among the same T tokens: queries and keys on
        the same increasing slots, no image block among them, no padding."""
        if "causal" not in self._made:
            qs, ks = self.q_slots, self.k_slots
            self._made["causal"] = (qs.shape == ks.shape and torch.equal(qs, ks)
                                    and bool((qs.diff(dim=1) > 0).all()) and not bool((self.q_blocks >= 0).any())
                                    and (self.k_valid is None or bool(self.k_valid.all())))
        return self._made["causal"]

    def block_mask(self):
        """flex attention's BlockMask of the rule (torch.nn.attention.flex_attention.BlockMask)."""
        if "block" not in self._made:
            # the dense mask only for the tile structure: not kept (it is B*T*S bytes)
            dense = self._made.get("dense")
            if dense is None:
                dense = attention_mask(self.q_slots, self.k_slots, self.q_blocks, self.k_blocks, self.k_valid)
            valid = self.k_valid if self.k_valid is not None else torch.ones_like(self.k_slots, dtype=torch.bool)
            self._made["block"] = flex_kernels.block_mask(
                dense, _slot_mask_mod(self.q_slots, self.k_slots, self.q_blocks, self.k_blocks, valid))
        return self._made["block"]


def _slot_mask_mod(q_slots, k_slots, q_blocks, k_blocks, k_valid):
    """flex attention's mask_mod(b, h, q_idx, kv_idx) for the rule: a closure over the index tensors
    (a new closure per mask does not make the compiled kernel recompile)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(q_slots[b, q_idx], k_slots[b, kv_idx], q_blocks[b, q_idx], k_blocks[b, kv_idx],
                       k_valid[b, kv_idx])

    return mask_mod
