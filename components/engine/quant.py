"""FP8 weights (`--quantization fp8`, vLLM's name): E4M3 with one scale per output channel.

What is quantized (as in vLLM-Omni and the community FP8 converters): in every decoder layer the
attention projections (`qkv_proj`, `o_proj`), the shared expert (`shared_mlp.gate_and_up_proj`,
`down_proj`) and the routed experts. Everything else keeps the model dtype: the router `wg` (fp32),
norms, `wte`, `lm_head`, the timestep embedders, patch embed, final layer, VAE, ViT and aligner.

One definition of the numbers, two ways to compute them:

    weight   W[n, :] ~ Wq[n, :] * sw[n]     Wq e4m3, sw[n] = max|W[n, :]| / 448     (at load)
    input    X[m, :] ~ Xq[m, :] * sx[m]     the same rule per token, at run time  ("dynamic")
    output   Y = (Xq @ Wq^T) * sx[:, None] * sw[None, :]

- fused (CUDA, bf16 activations, SM90/SM100): Xq from a compiled quantize kernel, the product by
  `torch._scaled_mm` (dense) or `torch._scaled_grouped_mm` (experts), bf16 out; fp32 accumulation,
  or the tensor cores' fast accumulation for compute-bound GEMMs (`kernels.fast_accumulation`);
- reference (any device and dtype; the CPU path): the same Xq and Wq, dequantized to fp32 and
  multiplied in fp32.
The two differ only in accumulation (order, and precision in the fast mode) and the bf16 rounding
of the fused output.

Applied from outside, module by module: `quantize_model_fp8_(model)` swaps `Fp8Linear` /
`Fp8Experts` (and `Fp8RowParallelLinear` under tensor parallelism) in for the plain modules of every
decoder layer; `engine.materialize(quantize=True)` calls it one layer at a time while loading.
`MoE.forward` hands routing to `self.experts(x, weights, experts, impl)`, which is the seam
`Fp8Experts` plugs into. `engine.build_model_fp8` gives an FP8 model that never exists whole in bf16.

Checkpoint format (written by `save_pretrained_fp8`, read by `load_pretrained_fp8`): the official
names; each quantized weight is `NAME.weight` in float8_e4m3fn plus `NAME.weight_scale` in float32
(routed experts per expert: `model.layers.L.mlp.experts.E.gate_and_up_proj.weight[_scale]`);
config.json carries `quantization_config = {"quant_method": "fp8", ...}`. The loader also accepts a
per-tensor `weight_scale` ([] or [1]), a per-channel one of shape [out, 1] (compressed-tensors), a
block-wise `weight_scale_inv` [ceil(out/B), ceil(in/B)] (DeepSeek-style; re-quantized per channel at
load), ignores static `input_scale`s (activations are scaled dynamically), and quantizes plain
bf16/fp32 weights on the fly, so one loader serves FP8 and bf16 checkpoints alike.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import HunyuanImage3Config
from .kernels.compiled import call_compiled
from .kernels.moe import combine_sorted, inverse_order, sort_by_expert
from .transformer import MLP, Attention, Experts, _combine
from .weights import CheckpointError, LoadSlices, _expert_spec, _read, checkpoint_files, write_checkpoint

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
AMAX_FLOOR = 1e-12  # all-zero rows get a tiny scale and quantize to zeros, never NaN
QUANT_METHOD = "fp8"


# -- the numbers ----------------------------------------------------------------------------------
def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3: (q [..., K] float8_e4m3fn, scale [...] float32) with x ~ q * scale[..., None]."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def swiglu_quantize_rowwise(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x1 * silu(x2) on the two halves of h (the official SwiGLU), in fp32, then `quantize_rowwise`."""
    a, b = h.float().chunk(2, dim=-1)
    return quantize_rowwise(a * F.silu(b))


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype: the W8A8 numbers computed in fp32 (any device)."""
    qx, sx = quantize_rowwise(x)
    y = dequantize(qx, sx) @ dequantize(weight, weight_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# -- fused CUDA path ------------------------------------------------------------------------------
def _cuda_bf16(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16


def dense_fused_supported(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Rowwise-scaled `torch._scaled_mm`: SM89+, bf16 out, both GEMM dims multiples of 16."""
    return (_cuda_bf16(x) and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and in_features % 16 == 0 and out_features % 16 == 0)


def grouped_fused_supported(x: torch.Tensor, hidden: int, intermediate: int) -> bool:
    """Rowwise-scaled `torch._scaled_grouped_mm` exists for SM90 and SM100 only."""
    return (_cuda_bf16(x) and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
            and hidden % 16 == 0 and intermediate % 16 == 0)


def fp8_linear_fused(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """x [M, K] bf16 (CUDA) -> [M, N] bf16 via `torch._scaled_mm` with rowwise scales."""
    qx, sx = call_compiled(quantize_rowwise, x)
    y = torch._scaled_mm(qx, weight.t(), scale_a=sx.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                         out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    return y if bias is None else y + bias


def _gather_rows(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # index through a byte view: gathers move 1 byte per element and need no float8 kernel
    return q.view(torch.uint8)[index].view(q.dtype)


def _scaled_grouped_mm(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_w: torch.Tensor,
                       offs: torch.Tensor, use_fast_accum: bool) -> torch.Tensor:
    """Rows a [M, K] of each expert times its weight w [E, N, K]^T with rowwise scales -> [M, N] bf16:
    for few rows (AR decode) the Triton kernel of kernels/fp8_grouped.py (`expert_gemm=auto`), which
    does not pad each expert's rows to CUTLASS's tile; else, or where it fails, `torch._scaled_grouped_mm`."""
    from .kernels import fp8_grouped

    def cutlass() -> torch.Tensor:
        return torch._scaled_grouped_mm(a, w.transpose(1, 2), scale_a, scale_w, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=use_fast_accum)

    if kernels.settings().expert_gemm != "cutlass" and fp8_grouped.supported(a, w):
        return kernels.run_fast("expert_gemm", (w.shape[1], w.shape[2]),
                                lambda: fp8_grouped.grouped_mm_few_rows(a, w, scale_a, scale_w, offs), cutlass)
    return cutlass()


def fp8_moe_fused(x, weights, experts, w1, s1, w2, s2, use_fast_accum: bool = False,
                  combine: str = "compiled") -> torch.Tensor:
    """Routed experts, W8A8: quantize tokens once, gather FP8 rows in expert order, two rowwise
    scaled grouped GEMMs with SwiGLU + re-quantization fused in between, weighted combine."""
    order, token, offs = sort_by_expert(experts, w1.shape[0])
    qx, sx = call_compiled(quantize_rowwise, x)
    xs, ss = _gather_rows(qx, token), sx[token]
    h = _scaled_grouped_mm(xs, w1, ss, s1, offs, use_fast_accum)
    qh, sh = call_compiled(swiglu_quantize_rowwise, h)
    y = _scaled_grouped_mm(qh, w2, sh, s2, offs, use_fast_accum)
    if combine == "bmm":  # the bf16 path's combine: scatter back to (token, slot) order, batched matmul
        per_slot = torch.empty_like(y)
        per_slot[order] = y
        return _combine(per_slot.view(*experts.shape, -1), weights)
    return call_compiled(combine_sorted, y, inverse_order(order), weights, dynamic=3)


def fp8_moe_reference(x, weights, experts, w1, s1, w2, s2) -> torch.Tensor:
    """The same numbers as `fp8_moe_fused`, per expert in fp32 (any device; the CPU path)."""
    n, k = experts.shape
    xd = dequantize(*quantize_rowwise(x))
    per_slot = torch.zeros(n, k, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = (xd[token] @ dequantize(w1[e], s1[e]).T).to(x.dtype)  # the fused GEMM's output dtype
        per_slot[token, slot] = dequantize(*swiglu_quantize_rowwise(h)) @ dequantize(w2[e], s2[e]).T
    return (per_slot * weights.unsqueeze(-1).float()).sum(1).to(x.dtype)


# -- modules --------------------------------------------------------------------------------------
def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _KeepsStorageDtypes(nn.Module):
    """`model.to(torch.bfloat16)` / `.float()` must move FP8 weights and fp32 scales, never cast them
    (float8 counts as floating point, so nn.Module would). Pinned tensors go through the conversion
    as same-size integer views, which dtype casts leave alone and device moves carry over."""

    _RAW = {1: torch.uint8, 4: torch.int32}  # element size -> an integer dtype of that size

    def _pinned(self) -> tuple[nn.Parameter, ...]:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        pinned = {id(t) for t in self._pinned()}

        def keep(t):
            if id(t) in pinned:
                return fn(t.view(self._RAW[t.element_size()])).view(t.dtype)
            return fn(t)

        return super()._apply(keep, recurse)


class Fp8Linear(_KeepsStorageDtypes):
    """nn.Linear with an E4M3 weight [out, in] and a float32 scale per output channel [out]."""

    impl: str = "auto"  # "auto": fused where supported, else reference | "fused" | "reference"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.orig_dtype = dtype or torch.get_default_dtype()  # what the weight was quantized from
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.weight_scale = _frozen(torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = _frozen(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def _pinned(self):
        return (self.weight, self.weight_scale)

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "Fp8Linear":
        """From an nn.Linear (or any module with a [out, in] `weight` and an optional `bias`)."""
        w, bias = linear.weight, getattr(linear, "bias", None)
        m = cls(w.shape[1], w.shape[0], bias is not None, w.device, w.dtype)
        m.set_weight_(w.detach())
        if bias is not None:
            m.bias = _frozen(bias.detach())
        return m

    @torch.no_grad()
    def set_weight_(self, weight: torch.Tensor) -> None:
        """Quantize a full-precision [out, in] weight into this module."""
        if self.weight.is_meta:  # structure only (building on the meta device)
            return
        q, s = quantize_rowwise(weight)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.impl == "fused" or (self.impl == "auto"
                                    and dense_fused_supported(flat, self.in_features, self.out_features)):
            y = fp8_linear_fused(flat, self.weight, self.weight_scale, bias,
                                 kernels.fast_accumulation(flat.shape[0]))
        else:
            y = fp8_linear_reference(flat, self.weight, self.weight_scale, bias)
        return y.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Fp8RowParallelLinear(Fp8Linear):
    """`parallel.RowParallelLinear` (o_proj under tensor parallelism) in FP8: this rank's input columns
    times its weight columns, the all-reduce, then the bias once. Activation scales are per token
    over the rank's own slice, so results differ from TP1 at FP8 rounding, not beyond."""

    ctx = None  # the rank's ParallelContext, set by `quantize_model_fp8_`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce_(self.product(x, None))
        return y if self.bias is None else y + self.bias


class Fp8Experts(_KeepsStorageDtypes):
    """Drop-in for `transformer.Experts`: stacked E4M3 weights [E, 2I, H] / [E, H, I] with float32
    per-output-channel scales [E, 2I] / [E, H]; same call as `Experts.forward`."""

    impl: str = "auto"  # "auto": fused where supported, else reference | "fused" | "reference"
    combine: str = "compiled"  # "compiled" (gather + weighted sum in one kernel) | "bmm"

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device=None,
                 orig_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.orig_dtype = orig_dtype or torch.get_default_dtype()  # what the weights were quantized from
        f8 = dict(dtype=FP8, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.gate_and_up_proj = _frozen(torch.zeros(num_experts, 2 * intermediate, hidden, **f8))
        self.gate_and_up_proj_scale = _frozen(torch.ones(num_experts, 2 * intermediate, **f32))
        self.down_proj = _frozen(torch.zeros(num_experts, hidden, intermediate, **f8))
        self.down_proj_scale = _frozen(torch.ones(num_experts, hidden, **f32))

    def _pinned(self):
        return (self.gate_and_up_proj, self.gate_and_up_proj_scale, self.down_proj, self.down_proj_scale)

    @property
    def num_experts(self) -> int:
        return self.gate_and_up_proj.shape[0]

    @classmethod
    def from_experts(cls, experts: Experts) -> "Fp8Experts":
        e, two_i, h = experts.gate_and_up_proj.shape
        m = cls(e, h, two_i // 2, experts.gate_and_up_proj.device, experts.gate_and_up_proj.dtype)
        m.set_weights_("gate_and_up_proj", experts.gate_and_up_proj.detach())
        m.set_weights_("down_proj", experts.down_proj.detach())
        return m

    @torch.no_grad()
    def set_weights_(self, which: str, weight: torch.Tensor, expert: int | None = None) -> None:
        """Quantize full-precision weights of one expert ([N, K]) or of all ([E, N, K]), one expert
        at a time so the fp32 temporaries stay one expert's size."""
        q_all, s_all = getattr(self, which), getattr(self, f"{which}_scale")
        if q_all.is_meta:  # structure only (building on the meta device)
            return
        targets = [expert] if expert is not None else range(self.num_experts)
        for i, e in enumerate(targets):
            q, s = quantize_rowwise(weight if expert is not None else weight[i])
            q_all[e].copy_(q)
            s_all[e].copy_(s)

    def forward(self, x, weights, experts, impl: str = "auto") -> torch.Tensor:
        # `impl` is the MoE's bf16 choice (grouped vs loop); FP8 decides on its own kernels
        args = (x, weights, experts, self.gate_and_up_proj, self.gate_and_up_proj_scale, self.down_proj,
                self.down_proj_scale)
        if self.impl == "fused" or (self.impl == "auto"
                                    and grouped_fused_supported(x, self.hidden, self.intermediate)):
            fast = kernels.fast_accumulation(experts.numel())  # the GEMMs' rows: (token, expert) pairs
            return kernels.run_fast("fp8_moe", kernels.moe_key(x),
                                    lambda: fp8_moe_fused(*args, use_fast_accum=fast, combine=self.combine),
                                    lambda: fp8_moe_reference(*args))
        return fp8_moe_reference(*args)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}"


# -- applying it to a model -----------------------------------------------------------------------
@torch.no_grad()
def quantize_model_fp8_(model: nn.Module) -> None:
    """Swap FP8 modules in for every decoder layer's attention projections, shared expert and routed
    experts, in place, module by module (works on a whole model, one `DecoderLayer`, or a model on
    the meta device, which gives the FP8 structure without data). Idempotent."""
    from .parallel import RowParallelLinear

    for module in list(model.modules()):
        if isinstance(module, Attention):
            names = ("qkv_proj", "o_proj")
        elif isinstance(module, MLP):  # the shared expert (and dense layers, if a config has any)
            names = ("gate_and_up_proj", "down_proj")
        else:
            continue
        for name in names:
            child = getattr(module, name)
            if isinstance(child, nn.Linear):
                setattr(module, name, Fp8Linear.from_linear(child))
            elif isinstance(child, RowParallelLinear):
                fp8 = Fp8RowParallelLinear.from_linear(child)
                fp8.ctx = child.ctx
                setattr(module, name, fp8)
    for module in list(model.modules()):
        if isinstance(getattr(module, "experts", None), Experts):
            module.experts = Fp8Experts.from_experts(module.experts)


def fp8_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            yield name, module


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# -- FP8 checkpoints ------------------------------------------------------------------------------
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<which>gate_and_up_proj|down_proj)\."
                     r"(?P<kind>weight|weight_scale|weight_scale_inv|input_scale)$")
_LINEAR = re.compile(r"^(?P<prefix>.*)\.(?P<kind>weight|weight_scale|weight_scale_inv|input_scale)$")


def is_fp8_checkpoint(directory: str | Path) -> bool:
    """True when config.json says `quantization_config.quant_method == "fp8"`."""
    cfg = Path(directory) / "config.json"
    if not cfg.exists():
        return False
    q = json.loads(cfg.read_text()).get("quantization_config") or {}
    return q.get("quant_method") == QUANT_METHOD


def fp8_checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of a quantized model: official names, experts split per expert."""
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Experts)}
    slices: LoadSlices = getattr(model, "load_slices", None) or LoadSlices()
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in experts:
            which = leaf.removesuffix("_scale")
            kind = "weight_scale" if leaf.endswith("_scale") else "weight"
            first = slices.experts.get(f"{owner}.{which}", (0, 0))[0]  # expert parallel: global ids
            for e in range(tensor.shape[0]):
                yield f"{owner}.{first + e}.{which}.{kind}", tensor[e]
        else:
            yield name, tensor


def save_pretrained_fp8(model: nn.Module, config: HunyuanImage3Config, directory: str | Path,
                        max_shard_bytes: int = 2 << 30) -> Path:
    """Write an FP8 checkpoint: config.json (with quantization_config), shards and the index."""
    cfg = config.to_dict()
    cfg["quantization_config"] = {
        "quant_method": QUANT_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_granularity": "channel",
        "modules": ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.shared_mlp", "mlp.experts"],
    }
    return write_checkpoint(fp8_checkpoint_tensors(model), cfg, directory, max_shard_bytes)


def _per_channel_scale(scale: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    out = weight.shape[0]
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1).expand(out)
    if scale.shape in ((out,), (out, 1)):
        return scale.reshape(out)
    raise CheckpointError(f"{name}: scale shape {tuple(scale.shape)} fits neither per-tensor nor per-channel "
                     f"for weight {tuple(weight.shape)} (block-wise scales are named weight_scale_inv)")


def _dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, name: str, spec=None) -> torch.Tensor:
    """q (this rank's slice of the weight when `spec` says which) times its block scales."""
    out, inp = list(q.shape)
    if spec is not None:  # the blocks tile the full weight
        out, inp = (spec[2], inp) if spec[0] == 0 else (out, spec[2])
    bo, bi = scale_inv.shape
    block_o, block_i = math.ceil(out / bo), math.ceil(inp / bi)
    if math.ceil(out / block_o) != bo or math.ceil(inp / block_i) != bi:
        raise CheckpointError(f"{name}: block scale {tuple(scale_inv.shape)} does not tile weight {(out, inp)}")
    full = scale_inv.float().repeat_interleave(block_o, 0)[:out].repeat_interleave(block_i, 1)[:, :inp]
    if spec is not None:
        dim, ranges = spec[0], spec[1]
        full = torch.cat([full.narrow(dim, start, end - start) for start, end in ranges], dim=dim)
    return q.float() * full.to(q.device)


def _scale_spec(weight_spec, scale_shape) -> tuple | None:
    """How to slice a per-channel scale: with the weight's output rows (dim 0), never along its
    input columns (a row-parallel slice keeps every output channel's scale)."""
    if weight_spec is None or weight_spec[0] != 0 or len(scale_shape) == 0 or scale_shape[0] == 1:
        return None
    return weight_spec


@torch.no_grad()
def load_pretrained_fp8(model: nn.Module, directory: str | Path, strict: bool = True) -> None:
    """Fill an already quantized model (see `engine.build_model_fp8`) from an FP8 or a plain checkpoint.

    Plain weights of quantized modules are quantized tensor by tensor as they are read; FP8 weights
    are copied and paired with their scale once all files are read."""
    from safetensors import safe_open

    directory = Path(directory)
    slices: LoadSlices = getattr(model, "load_slices", None) or LoadSlices()  # this rank's part (TP/EP)
    params = model.state_dict()
    linears = {n: m for n, m in fp8_modules(model) if isinstance(m, Fp8Linear)}
    experts = {n: m for n, m in fp8_modules(model) if isinstance(m, Fp8Experts)}
    expected = {name for name, _ in fp8_checkpoint_tensors(model)}
    seen: set[str] = set()
    unexpected: list[str] = []
    raw_fp8: dict[str, tuple] = {}  # weight name -> (module, which, expert, spec) awaiting its scale
    scales: dict[str, torch.Tensor] = {}

    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if slices.skip and name.startswith(slices.skip):
                    continue  # another pipeline stage's decoder layer
                m = _EXPERT.match(name)
                target = None
                if m and m["prefix"] in experts:
                    stacked = f"{m['prefix']}.{m['which']}"
                    first, end = slices.experts.get(stacked, (0, experts[m["prefix"]].num_experts))
                    if not first <= int(m["e"]) < end:
                        continue  # another rank's expert
                    target = (experts[m["prefix"]], m["which"], int(m["e"]) - first, m["kind"])
                    stem, spec = f"{m['prefix']}.{m['e']}.{m['which']}", _expert_spec(slices.ranges.get(stacked))
                else:
                    m = _LINEAR.match(name)
                    if m and m["prefix"] in linears:
                        target = (linears[m["prefix"]], None, None, m["kind"])
                        stem, spec = m["prefix"], slices.ranges.get(f"{m['prefix']}.weight")
                if target is None:  # a plain tensor
                    if name not in params:
                        unexpected.append(name)
                        continue
                    tensor = _read(f, name, slices.ranges.get(name))
                    if tensor.shape != params[name].shape:
                        raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                         f"{tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    seen.add(name)
                    continue
                module, which, e, kind = target
                if kind == "input_scale":  # static activation scales: we scale activations dynamically
                    continue
                if kind == "weight_scale":
                    shape = f.get_slice(name).get_shape()
                    scales[f"{stem}.{kind}"] = _read(f, name, _scale_spec(spec, shape))
                    continue
                if kind == "weight_scale_inv":  # block-wise: kept whole, the blocks tile the full weight
                    scales[f"{stem}.{kind}"] = f.get_tensor(name)
                    continue
                tensor = _read(f, name, spec)
                dest = module.weight if which is None else getattr(module, which)[e]
                if tensor.shape != dest.shape:
                    raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
                if tensor.dtype == FP8:
                    dest.copy_(tensor)
                    raw_fp8[stem] = (module, which, e, spec)
                elif which is None:
                    module.set_weight_(tensor.to(dest.device))
                else:
                    module.set_weights_(which, tensor.to(dest.device), expert=e)
                seen.add(f"{stem}.weight")
                seen.add(f"{stem}.weight_scale")

    missing_scale = []
    for stem, (module, which, e, spec) in raw_fp8.items():
        q = module.weight if which is None else getattr(module, which)[e]
        s = module.weight_scale if which is None else getattr(module, f"{which}_scale")[e]
        if f"{stem}.weight_scale" in scales:
            s.copy_(_per_channel_scale(scales[f"{stem}.weight_scale"], q, stem))
        elif f"{stem}.weight_scale_inv" in scales:
            w = _dequantize_blockwise(q, scales[f"{stem}.weight_scale_inv"], stem, spec)
            q2, s2 = quantize_rowwise(w)
            q.copy_(q2)
            s.copy_(s2)
        else:
            missing_scale.append(stem)
    if missing_scale:
        raise CheckpointError(f"FP8 checkpoint {directory}: {len(missing_scale)} FP8 weights without a weight_scale "
                         f"(e.g. {missing_scale[:3]})")
    missing = sorted(expected - seen)
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint {directory} does not match the model: {len(missing)} missing "
                              f"(e.g. {missing[:3]}), "
                              f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
