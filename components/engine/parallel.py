"""Tensor + expert parallelism for the HunyuanImage-3 decoder, applied to the plain model from outside.

`parallelize(model, ctx)` rewrites a model built on the meta device so that this rank holds only its
share, the way torchtitan's `parallelize_*` functions or vLLM's parallel linear layers do; the model
code itself knows nothing about ranks. Per decoder layer, over N ranks:

- attention, tensor parallel by heads: rank r keeps KV heads [r*8/N, (r+1)*8/N) with their query
  heads (the fused `qkv_proj` rows of those KV groups). Above 8 ranks a KV head is replicated and
  the rank keeps its 32/N query heads of that group plus the group's K and V rows. `o_proj` is
  row parallel: each rank multiplies its heads' columns and one all-reduce sums the partials;
- MoE, expert parallel: tokens are already replicated after attention, the fp32 router runs on
  every rank (identical choices), and rank r runs experts [r*64/N, (r+1)*64/N) on the tokens routed
  to them. The shared expert (and any dense MLP) is tensor parallel with its fused gate/up
  projection split per half (the official MLP computes x1 * silu(x2) on the two halves). The routed
  and shared partials are added and summed with one all-reduce: two all-reduces per layer in all;
- embeddings, lm_head, norms, timestep embedders, patch embed / final layer, VAE and ViT are
  replicated (sampling sees full logits).

Pipeline parallel (`pp_size` stages, composable with the above): stage s holds the contiguous
decoder layers `stage_layers(L, pp_size, s)` (earlier stages one more when L does not divide);
the other layers are `AbsentLayer` placeholders (no parameters, never read from the checkpoint),
so parameter names stay global. Everything that is not a decoder layer (~4B parameters: wte,
lm_head, ln_f, embedders, patch embed / final layer, ViT, VAE) is replicated on every stage, so
every stage builds the same inputs and takes the same decisions. Ranks of a model copy:
global rank = pp_rank * tp + tp_rank; a stage's TP group is its tp ranks, and a rank's pipeline
neighbours are the same tp rank in the adjacent stages (`transformer.forward_layers` hands the
hidden states on through `model.stages`, the runtime's PipelineStages; see also
`components/runtime/pipeline_schedule.py`). The ranks' collectives and hand-offs themselves are the
runtime's (`components/runtime/parallel.py`).

`model.load_slices` records which ranges of each checkpoint tensor this rank holds, so the loader
reads only those (`safe_open(...).get_slice`) and dummy init draws exactly the slices of the full
tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.moe import choose_impl
from .transformer import MLP, Attention, Experts, HunyuanImage3ForCausalMM, MoE, _combine
from .weights import LoadSlices

# this rank's components.runtime.parallel.ParallelContext: the rank processes hand it over (the engine
# imports nothing of the runtime)
ParallelContext = Any


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers of pipeline stage `pp_rank`: contiguous, earlier stages one more when
    `num_layers` does not divide."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp_size}: the model has {num_layers} decoder layers "
                         f"(at most {num_layers} stages)")
    size, extra = divmod(num_layers, pp_size)
    start = pp_rank * size + min(pp_rank, extra)
    return range(start, start + size + (1 if pp_rank < extra else 0))


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer lives on another pipeline stage")


def split(total: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if total % world:
        raise ValueError(f"{what}: {total} does not divide over {world} ranks")
    size = total // world
    return rank * size, (rank + 1) * size


def kv_head_range(num_kv_heads: int, num_heads: int, world: int, rank: int) -> tuple[int, int]:
    """The KV heads a rank holds (one replicated head when there are more ranks than KV heads)."""
    if world <= num_kv_heads:
        return split(num_kv_heads, world, rank, "num_key_value_heads")
    q0, _ = split(num_heads, world, rank, "num_attention_heads")
    head = q0 // (num_heads // num_kv_heads)
    return head, head + 1


def tensor_parallel_problem(cfg, world: int) -> str | None:
    """Why `cfg`'s layers cannot be split over `world` tensor-parallel ranks (None when they can): the
    rules `parallelize` applies, checked before any rank starts."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    groups = heads // kv_heads
    try:
        for rank in range(world):
            kv_head_range(kv_heads, heads, world, rank)
            if world > kv_heads:
                q0, q1 = split(heads, world, rank, "num_attention_heads")
                if (q1 - 1) // groups != q0 // groups:
                    raise ValueError(f"{world} ranks would split a rank's query heads over two KV groups")
        for i in range(cfg.num_hidden_layers):
            if not cfg.is_moe_layer(i):
                split(cfg.intermediate_size, world, 0, f"layer {i} intermediate size")
                continue
            split(cfg.layer("num_experts", i), world, 0, f"layer {i} num_experts")
            if cfg.use_mixed_mlp_moe:
                shared = cfg.layer("moe_intermediate_size", i) * cfg.layer("num_shared_expert", i)
                split(shared, world, 0, f"layer {i} shared expert intermediate size")
    except ValueError as exc:
        return str(exc)
    return None


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T: this rank's input slice times its weight columns, then one
    all-reduce (the bias, if any, is added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce_(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


# Up to this many tokens (an AR decode step's batch: 1-64 rows, or a multiple of 64 for a large pool)
# a rank's MoE runs all (token, slot) pairs through its own experts at static shapes, the others'
# with weight 0: the sparse path reads the rank's token count back to the host, which a CUDA graph
# cannot hold (every tensor-parallel decode graph capture failed on it). Twice the expert rows
# cost little at decode sizes, where
# reading the experts' weights dominates (measured up to 32 rows; a larger pool, e.g. short T2I
# prompts, reaches 128-256). Prefill chunks of image blocks and the DiT keep the sparse path.
STATIC_ROUTING_TOKENS = 256


class ParallelMoE(nn.Module):
    """This rank's experts and its slice of the shared expert; one all-reduce sums everything."""

    def __init__(self, moe: MoE, ctx: ParallelContext, first_expert: int, local_experts: int,
                 shared: MLP | None) -> None:
        super().__init__()
        self.ctx = ctx
        self.gate = moe.gate  # replicated, fp32
        self.top_k, self.num_experts = moe.top_k, moe.num_experts
        self.norm_topk_prob, self.capacity_factor, self.drop_tokens = (moe.norm_topk_prob, moe.capacity_factor,
                                                                       moe.drop_tokens)
        hidden, intermediate = moe.experts.down_proj.shape[1], moe.experts.down_proj.shape[2]
        dtype = moe.experts.down_proj.dtype
        self.experts = Experts(local_experts, hidden, intermediate).to(dtype)
        self.first_expert = first_expert
        self.shared_mlp = shared
        self.impl = MoE.impl

    route = MoE.route  # the same routing on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        if flat.shape[0] <= STATIC_ROUTING_TOKENS:
            out = self._local_experts_static(flat, weights, experts).view(shape)
        else:
            per_slot = self._local_experts(flat, weights, experts)
            out = _combine(per_slot.view(flat.shape[0], self.top_k, -1), weights).view(shape)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x)
        return self.ctx.all_reduce_(out)

    def _local_experts_static(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[N, H]: the weighted sum of this rank's experts' outputs, with no data-dependent shape (so
        no host sync, and a CUDA graph can hold it): every (token, slot) pair goes through one of
        this rank's experts, those routed to another rank's with weight 0 (spread over the local
        experts, so none takes them all)."""
        local_experts = self.experts.down_proj.shape[0]
        offset = experts - self.first_expert
        local = (offset >= 0) & (offset < local_experts)
        impl = choose_impl(flat) if self.impl == "auto" else self.impl
        return self.experts(flat, weights * local, offset.remainder(local_experts), impl)

    @torch.compiler.disable  # this rank's token count is data-dependent: eager inside a compiled layer
    def _local_experts(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[N * k, H]: this rank's experts' outputs at their (token, slot) places, zeros elsewhere."""
        local = (experts >= self.first_expert) & (experts < self.first_expert + self.experts.down_proj.shape[0])
        slots = local.reshape(-1).nonzero().squeeze(1)  # (token, slot) pairs this rank computes
        per_slot = torch.zeros(flat.shape[0] * self.top_k, flat.shape[-1], dtype=flat.dtype, device=flat.device)
        if slots.numel():
            k = self.top_k
            rows = flat[slots // k]
            which = (experts.reshape(-1)[slots] - self.first_expert).unsqueeze(1)
            ones = torch.ones_like(which, dtype=weights.dtype)
            impl = choose_impl(rows) if self.impl == "auto" else self.impl
            per_slot[slots] = self.experts(rows, ones, which, impl)
        return per_slot


class ReducedMLP(MLP):
    """A dense (non-MoE) layer's tensor-parallel MLP, followed by its all-reduce (same parameter
    names as the plain MLP)."""

    ctx: ParallelContext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce_(super().forward(x))


def _sliced_mlp(mlp: MLP, ctx: ParallelContext, prefix: str, slices: LoadSlices, cls: type = MLP) -> MLP:
    """A SwiGLU MLP holding this rank's slice of the intermediate dim; the fused gate/up projection is
    split per half (rows r of x1 and the same rows of x2), down_proj by input columns. Its output is
    a partial sum."""
    intermediate = mlp.down_proj.in_features
    lo, hi = split(intermediate, ctx.world_size, ctx.rank, f"{prefix} intermediate size")
    bias = mlp.down_proj.bias is not None
    local = cls(mlp.down_proj.out_features, hi - lo, bias).to(mlp.down_proj.weight.dtype)
    local.ctx = ctx
    halves = [(lo, hi), (intermediate + lo, intermediate + hi)]
    slices.ranges[f"{prefix}.gate_and_up_proj.weight"] = (0, halves, 2 * intermediate)
    if bias:
        slices.ranges[f"{prefix}.gate_and_up_proj.bias"] = (0, halves, 2 * intermediate)
        local.down_proj = RowBiasOnce(local.down_proj, ctx)
    slices.ranges[f"{prefix}.down_proj.weight"] = (1, [(lo, hi)], intermediate)
    return local


class RowBiasOnce(nn.Module):
    """A partial-sum linear whose bias must count once in its tensor-parallel group's sum: TP rank 0
    of the group adds it, in every pipeline stage and both CFG groups (each sums on its own)."""

    def __init__(self, linear: nn.Linear, ctx: ParallelContext) -> None:
        super().__init__()
        self.weight, self.bias, self.ctx = linear.weight, linear.bias, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.ctx.rank == 0 else None)


def _parallel_attention(attn: Attention, ctx: ParallelContext, prefix: str, slices: LoadSlices) -> None:
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    groups = heads // kv_heads
    hidden = attn.qkv_proj.in_features
    full_rows = (heads + 2 * kv_heads) * d
    if ctx.world_size <= kv_heads:
        kv0, kv1 = split(kv_heads, ctx.world_size, ctx.rank, "num_key_value_heads")
        rows = [(kv0 * (groups + 2) * d, kv1 * (groups + 2) * d)]
        q0, q1 = kv0 * groups, kv1 * groups
        local_kv = kv1 - kv0
    else:  # more ranks than KV heads: replicate the group's K/V, split its query heads
        q0, q1 = split(heads, ctx.world_size, ctx.rank, "num_attention_heads")
        head = q0 // groups
        if (q1 - 1) // groups != head:
            raise ValueError(f"{ctx.world_size} ranks would split a rank's query heads over two KV groups")
        block = head * (groups + 2) * d
        within = q0 - head * groups
        rows = [(block + within * d, block + (within + q1 - q0) * d), (block + groups * d, block + (groups + 2) * d)]
        local_kv = 1
    local_q = q1 - q0
    dtype = attn.qkv_proj.weight.dtype
    has_bias = attn.qkv_proj.bias is not None
    attn.qkv_proj = nn.Linear(hidden, sum(b - a for a, b in rows), bias=has_bias, dtype=dtype)
    slices.ranges[f"{prefix}.qkv_proj.weight"] = (0, rows, full_rows)
    if has_bias:
        slices.ranges[f"{prefix}.qkv_proj.bias"] = (0, rows, full_rows)
    attn.o_proj = RowParallelLinear(local_q * d, attn.o_proj.out_features, ctx, attn.o_proj.bias is not None, dtype)
    slices.ranges[f"{prefix}.o_proj.weight"] = (1, [(q0 * d, q1 * d)], heads * d)
    attn.num_heads, attn.num_kv_heads, attn.groups = local_q, local_kv, local_q // local_kv


def parallelize(model: HunyuanImage3ForCausalMM, ctx: ParallelContext) -> HunyuanImage3ForCausalMM:
    """Slice a meta-device model for rank ctx.rank of ctx.world_size in stage ctx.pp_rank of
    ctx.pp_size (in place; returns it)."""
    model.parallel = ctx
    if ctx.world_size == 1 and ctx.pp_size == 1:
        return model
    slices = LoadSlices()
    layers = model.model.layers
    if ctx.pp_size > 1:
        model.stage_layers = stage_layers(len(layers), ctx.pp_size, ctx.pp_rank)
        model.stages = ctx.stages()  # the runtime's hand-offs around this stage's layers
        away = [i for i in range(len(layers)) if i not in model.stage_layers]
        for i in away:
            layers[i] = AbsentLayer()
        slices.skip = tuple(f"model.layers.{i}." for i in away)
    with torch.device("meta"):
        for i in model.stage_layers if ctx.world_size > 1 else ():
            layer = layers[i]
            prefix = f"model.layers.{i}"
            _parallel_attention(layer.self_attn, ctx, f"{prefix}.self_attn", slices)
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                e0, e1 = split(mlp.num_experts, ctx.world_size, ctx.rank, f"layer {i} num_experts")
                shared = (None if mlp.shared_mlp is None
                          else _sliced_mlp(mlp.shared_mlp, ctx, f"{prefix}.mlp.shared_mlp", slices))
                layer.mlp = ParallelMoE(mlp, ctx, e0, e1 - e0, shared)
                slices.experts[f"{prefix}.mlp.experts.gate_and_up_proj"] = (e0, e1)
                slices.experts[f"{prefix}.mlp.experts.down_proj"] = (e0, e1)
            else:
                layer.mlp = _sliced_mlp(mlp, ctx, f"{prefix}.mlp", slices, ReducedMLP)
    model.load_slices = slices
    model.parallel = ctx
    return model
