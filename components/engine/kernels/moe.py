"""Fused MoE dispatch for the routed experts (`moe=fused`; `auto` picks it for CUDA bfloat16).

    route      MoE.route, unchanged: fp32 gate linear, softmax, top-k, renormalise
    sort       (token, slot) pairs sorted by expert (stable); each expert's end offset by a
               binary search in the sorted ids: no bincount, so no host sync
    gather     one index_select of the token rows in expert order
    gate_up    torch._grouped_mm, one launch for all experts
    SwiGLU     compiled: one element-wise kernel, fp32 math, one rounding to bf16
    down       torch._grouped_mm
    combine    compiled: each token gathers its k expert rows and sums them weighted, in fp32 and
               in slot order: deterministic (no atomics), no scatter back to token order first

No Python loop over experts and no host sync: the whole dispatch can be captured in a CUDA graph.
`MoE.forward` runs the shared expert on a side CUDA stream meanwhile (`start_on_side_stream`, from
1 024 tokens), so its GEMMs can fill the GPU while the memory-bound steps of the routed path run.
Measured at the DiT shape (docs/benchmarks.md): route + dispatch + combine ≈ 18 % over the bare
grouped GEMMs (grouped path: 49 %); what is left is the gather and SwiGLU, which only a grouped GEMM
with an indexed A operand and a SwiGLU epilogue would remove.

Against the grouped path (`moe_grouped`, bitwise equal to the per-expert loop) it differs only in
rounding: SwiGLU rounds once instead of twice and the combine weights stay fp32 (the grouped path
rounds them to bf16 for its batched matmul).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import enabled, settings
from .compiled import call_compiled


def choose_impl(x: torch.Tensor) -> str:
    """The routed-expert path for tokens x from the `moe` kernel setting: loop | grouped | fused;
    `auto` is fused for CUDA bfloat16 (where torch._grouped_mm runs) and the loop elsewhere."""
    if enabled("moe", x, "fused"):
        return "fused"
    value = settings().moe
    if value == "grouped" and not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return "loop"  # torch._grouped_mm runs on CUDA bfloat16 only
    return "loop" if value == "auto" else value


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token, offs) for top-k choices experts [N, k]: the (token, slot) pairs sorted by
    expert (stable, so by token within an expert), their token index, and the int32 end offset of
    each expert's rows (the grouped GEMM's `offs`). No host sync (bincount would need one)."""
    # 16-bit keys: the radix sort makes 2 passes instead of 8 (the permutation is the same)
    key_dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else experts.dtype
    sorted_ids, order = torch.sort(experts.reshape(-1).to(key_dtype), stable=True)
    bounds = torch.arange(num_experts, device=experts.device, dtype=key_dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)
    return order, order // experts.shape[1], offs


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """slot_of_sorted[i] = where (token, slot) pair i sits in expert order."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """x1 * silu(x2) on the two halves of h (the official SwiGLU), in fp32, rounded once."""
    a, b = h.float().chunk(2, dim=-1)
    return (a * F.silu(b)).to(h.dtype)


def combine_sorted(y: torch.Tensor, slot_of_sorted: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * y[slot_of_sorted[n * k + j]] for expert outputs y [N*k, H] in expert
    order, in fp32, slot 0 first. Written as k gathered terms (a loop over the top-k slots, not the
    experts) so that compiled it is one element-wise kernel with k indirect loads per output: it
    reads y once, writes [N, H] once, and sums in a fixed order (deterministic, no atomics)."""
    n, k = weights.shape
    index, w = slot_of_sorted.view(n, k), weights.float()
    out = y[index[:, 0]].float() * w[:, :1]
    for j in range(1, k):
        out = out + y[index[:, j]].float() * w[:, j:j + 1]
    return out.to(y.dtype)


def moe_fused(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor) -> torch.Tensor:
    """Routed output [N, H] for tokens x [N, H] sent to experts [N, k] with weights [N, k];
    stacked expert weights w_gate_up [E, 2I, H], w_down [E, H, I] (`transformer.Experts`)."""
    order, token, offs = sort_by_expert(experts, w_gate_up.shape[0])
    xs = x.index_select(0, token)
    h = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(call_compiled(swiglu, h), w_down.transpose(1, 2), offs=offs)
    return call_compiled(combine_sorted, y, inverse_order(order), weights, dynamic=3)


# -- the shared expert beside the routed ones -----------------------------------------------------
# per device and thread: an overlapped job's AR and DiT threads each have their own (a shared one would
# chain each thread's stream to the other's work)
_side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
SIDE_STREAM_MIN_TOKENS = 1024  # below this (decode) the stream switches cost more than they hide


def start_on_side_stream(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start fn(x) on a side CUDA stream; the returned function makes the current stream wait for
    it and gives its result. Runs fn(x) in place where a side stream does not pay or cannot be
    used: fewer than SIDE_STREAM_MIN_TOKENS tokens, CPU, inside torch.compile, or while a CUDA graph
    is being captured."""
    if (x.numel() < SIDE_STREAM_MIN_TOKENS * x.shape[-1] or not x.is_cuda or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()):
        out = fn(x)
        return lambda: out
    main = torch.cuda.current_stream(x.device)
    key = (x.device, threading.get_ident())
    side = _side_streams.get(key)
    if side is None:
        side = _side_streams[key] = torch.cuda.Stream(x.device, priority=main.priority)
    side.wait_stream(main)  # x is ready
    with torch.cuda.stream(side):
        out = fn(x)

    def join() -> torch.Tensor:
        main.wait_stream(side)
        out.record_stream(main)  # its memory is not reused by the side stream while main reads it
        return out

    return join
