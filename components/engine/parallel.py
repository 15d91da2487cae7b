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
hidden states on with send/recv; see also `components/runtime/pipeline_schedule.py`).

`model.load_slices` records which ranges of each checkpoint tensor this rank holds, so the loader
reads only those (`safe_open(...).get_slice`) and dummy init draws exactly the slices of the full
tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import RankLost  # defined with the kernels (is_kernel_failure lets it through)
from .kernels.moe import choose_impl
from .transformer import MLP, Attention, Experts, HunyuanImage3ForCausalMM, MoE, _combine
from .weights import LoadSlices


def _collective(fn):
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RankLost:
            raise
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            raise RankLost(f"a tensor-parallel collective failed ({type(e).__name__}: {e})") from e
    return wrapped


@dataclass
class ParallelContext:
    """This rank's place in the tensor-parallel group (and, for a CFG-parallel DiT step, which CFG
    row its group computes: the cond row on group 0, the uncond row on group 1)."""

    rank: int  # within the tensor-parallel group
    world_size: int  # tensor-parallel group size
    device: torch.device
    group: object = None  # a torch.distributed ProcessGroup; None = the default group
    cfg_parallel: bool = False
    cfg_rank: int = 0  # 0: cond row, 1: uncond row
    cfg_group: object = None  # the 2-rank group {this rank, its twin in the other CFG group}
    local_only: bool = False  # all_reduce_ leaves tensors as they are (see collectives_off)
    pp_rank: int = 0  # pipeline stage
    pp_size: int = 1  # pipeline stages
    pp_group: object = None  # this tp rank in every stage: activations go stage to stage in it
    pp_return_group: object = None  # the same ranks on a second communicator: the last stage -> stage 0

    @property
    def is_first(self) -> bool:
        """The rank that reads the shard and writes the outputs (TP rank 0 of stage 0)."""
        return self.rank == 0 and self.cfg_rank == 0 and self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of this tp rank in pipeline stage `stage`."""
        return stage * self.world_size + self.rank

    @_collective
    def send_stage(self, tensor: torch.Tensor, stage: int) -> None:
        """Send `tensor` to this tp rank of `stage`, any dtype and shape: a small header (dtype,
        shape) goes first, so the receiver allocates exactly what comes (`recv_any_stage`). A
        buffer guessed on the receiving side could differ in dtype (a stage's output may be wider
        than its input), and NCCL send/recv of different byte counts hangs rather than failing."""
        self.isend_any_stage(tensor, stage).wait()

    @_collective
    def recv_any_stage(self, stage: int, back: bool = False) -> torch.Tensor:
        """What `send_stage` (or `isend_any_stage`) on `stage` sent."""
        import torch.distributed as dist

        group = self.pp_return_group if back else self.pp_group
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.recv(header, self.stage_rank(stage), group=group)
        tensor = _empty_from_header(header, self.device)
        dist.recv(tensor, self.stage_rank(stage), group=group)
        return tensor

    @_collective
    def isend_any_stage(self, tensor: torch.Tensor, stage: int, back: bool = False) -> "Sending":
        """`send_stage` without waiting (`back`: on the way-back communicator, from the last stage):
        the header and the tensor go out in the background; wait on the returned Sending (it keeps
        them alive until then). The receiver calls `recv_any_stage(.., back)`."""
        import torch.distributed as dist

        group = self.pp_return_group if back else self.pp_group
        tensor = tensor.contiguous()
        header = _wire_header(tensor)
        works = [dist.isend(t, self.stage_rank(stage), group=group) for t in (header, tensor)]
        return Sending(works, (header, tensor))

    @_collective
    def isend_stage(self, tensor: torch.Tensor, stage: int, back: bool = False):
        """Send without a header and without waiting, where both sides agree on dtype and shape (the
        DiT wavefront casts explicitly); the receiver calls `recv_stage` with such a buffer. Returns the
        torch.distributed Work (keep `tensor` until it is done)."""
        import torch.distributed as dist

        return dist.isend(tensor, self.stage_rank(stage), group=self.pp_return_group if back else self.pp_group)

    @_collective
    def open_stage_links(self) -> None:
        """Make the point-to-point links of both directions now, every stage together, before any
        work. NCCL makes a pair's link at its first send/recv and blocks the caller until the peer
        calls on that pair too: in the DiT wavefront the last stage's first send back comes long
        before stage 0's first receive back, and a stage blocked there while the other had a send
        out to it was how the 80B model at --pp 2 hung in its first DiT step (docs/benchmarks.md)."""
        import torch.distributed as dist

        if self.pp_size == 1:
            return
        t = torch.zeros(1, device=self.device)
        if self.pp_rank > 0:  # forward, as a chain 0 -> 1 -> ... -> last (each blocks in order)
            dist.recv(t, self.stage_rank(self.pp_rank - 1), group=self.pp_group)
        if not self.is_last_stage:
            dist.send(t, self.stage_rank(self.pp_rank + 1), group=self.pp_group)
        if self.pp_rank >= 2:  # stage s -> stage 0 (the DiT's decoded images; 1 -> 0 is the pair above)
            dist.send(t, self.stage_rank(0), group=self.pp_group)
        elif self.pp_rank == 0:
            for stage in range(2, self.pp_size):
                dist.recv(t, self.stage_rank(stage), group=self.pp_group)
        if self.is_last_stage:  # the way back: last -> every other stage (the AR wavefront's tokens)
            for stage in range(self.pp_size - 1):
                dist.send(t, self.stage_rank(stage), group=self.pp_return_group)
        else:
            dist.recv(t, self.stage_rank(self.pp_size - 1), group=self.pp_return_group)

    @_collective
    def wait_all(self, works: list) -> None:
        for work in works:
            work.wait()

    @_collective
    def recv_stage(self, tensor: torch.Tensor, stage: int, back: bool = False) -> torch.Tensor:
        import torch.distributed as dist

        dist.recv(tensor, self.stage_rank(stage), group=self.pp_return_group if back else self.pp_group)
        return tensor

    @_collective
    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's `tensor` on every stage (so every stage returns the same hidden states);
        the other stages' `tensor` only says which device. Header first, as in `send_stage`."""
        import torch.distributed as dist

        src, group = self.stage_rank(self.pp_size - 1), self.pp_group
        if self.is_last_stage:
            tensor = tensor.contiguous()
            dist.broadcast(_wire_header(tensor), src, group=group)
        else:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.broadcast(header, src, group=group)
            tensor = _empty_from_header(header, self.device)
        dist.broadcast(tensor, src, group=group)
        return tensor

    @_collective
    def gather_cfg(self, row: torch.Tensor) -> torch.Tensor:
        """[cond; uncond] from this group's row and the twin group's row (same on every rank)."""
        import torch.distributed as dist

        parts = [torch.empty_like(row) for _ in range(2)]
        dist.all_gather(parts, row.contiguous(), group=self.cfg_group)
        return torch.cat(parts)

    @contextlib.contextmanager
    def collectives_off(self):
        """all_reduce_ does nothing inside: a trial run of a compiled region on this rank alone
        (`kernels.run_fast`), whose result is discarded; the ranks then agree on the path."""
        self.local_only = True
        try:
            yield
        finally:
            self.local_only = False

    @torch.compiler.disable  # eager inside a compiled layer, so a failure still raises RankLost
    @_collective
    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and not self.local_only:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def _decision_group(self):
        """Where ranks agree on a branch: the TP group, or every rank of the copy under pipeline
        parallelism (the default group: one copy per process group)."""
        return None if self.pp_size > 1 else self.group

    @_collective
    def agree_min(self, value: int) -> int:
        """The smallest `value` over every rank that must decide alike (e.g. the AR's admission budget:
        the rank with the least free memory decides)."""
        if self.world_size == 1 and self.pp_size == 1:
            return value
        t = torch.tensor([value], device=self.device, dtype=torch.int64)
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._decision_group())
        return int(t.item())

    @_collective
    def agree_max(self, values: list[int]) -> list[int]:
        """Each of `values`' largest over every rank of the copy (e.g. the worst rank's memory peak)."""
        if self.world_size == 1 and self.pp_size == 1:
            return list(values)
        t = torch.tensor(values, device=self.device, dtype=torch.int64)
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._decision_group())
        return [int(v) for v in t.tolist()]

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (so ranks take the same branch)."""
        return bool(self.agree_min(1 if flag else 0))


@dataclass
class Sending:
    """Sends in flight (`isend_any_stage`) and the tensors they read."""

    works: list
    tensors: tuple

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


# What goes ahead of a tensor between pipeline stages: [dtype code, ndim, size_0 .. size_5].
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                torch.uint8, torch.bool)
_HEADER_LEN = 8


def _wire_header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _WIRE_DTYPES or tensor.dim() > _HEADER_LEN - 2:
        raise ValueError(f"cannot hand a {tensor.dtype} tensor of {tensor.dim()} dims between pipeline stages")
    sizes = list(tensor.shape) + [0] * (_HEADER_LEN - 2 - tensor.dim())
    values = [_WIRE_DTYPES.index(tensor.dtype), tensor.dim(), *sizes]
    if tensor.device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=tensor.device)
    # from pinned memory without waiting: a plain copy would wait for this stage's queued work, so a
    # stage could not queue its next row group's step before its last one had run
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(tensor.device, non_blocking=True)


def _empty_from_header(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    code, ndim, *sizes = header.tolist()
    return torch.empty(sizes[:ndim], dtype=_WIRE_DTYPES[code], device=device)


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


@dataclass
class StageWork:
    """A forward `PipelineStages.start` began: what this stage still sends on, and on the last stage
    the rows' last hidden states (with `back`, also sent back to every stage)."""

    sends: list
    last: torch.Tensor | None = None
    back: bool = False


class PipelineStages:
    """A pipeline stage's hand-offs around its own layers. The model runs only its layer range
    (`forward_layers`); `parallelize` gives a staged model one of these (`model.stages`), and the
    model and its schedulers run a stage's work between its hand-offs through it."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def across(self, x: torch.Tensor | None, run_stage) -> torch.Tensor:
        """Stage 0 runs `run_stage(x)`, each later stage runs it on what the stage before sent and
        sends its output on; the last stage's output is broadcast, so every stage returns the same
        hidden states (and takes the same decisions from them)."""
        pp = self.ctx
        x = self._own_layers(x, run_stage)
        if not pp.is_last_stage:
            pp.send_stage(x, pp.pp_rank + 1)
        return pp.broadcast_from_last_stage(x)

    def start(self, x: torch.Tensor | None, run_stage, back: bool = True) -> StageWork:
        """`across` without waiting for the later stages: this stage runs `run_stage` (on what the
        stage before sent) and sends its output on in the background; the last stage sends its
        rows' last hidden states [B, hidden] back to every stage (`back`), which `land` then gives.
        So a stage can start other work (another row group's step) while this one is in the later
        stages. Every stage must land in the order it started."""
        pp = self.ctx
        x = self._own_layers(x, run_stage)
        if not pp.is_last_stage:
            return StageWork([pp.isend_any_stage(x, pp.pp_rank + 1)], back=back)
        last = x[:, -1].contiguous()
        sends = [pp.isend_any_stage(last, s, back=True) for s in range(pp.pp_size - 1)] if back else []
        return StageWork(sends, last, back)

    def _own_layers(self, x: torch.Tensor | None, run_stage) -> torch.Tensor:
        """`run_stage` on x at stage 0, on what the stage before sent at a later stage."""
        if self.ctx.pp_rank > 0:
            x = self.ctx.recv_any_stage(self.ctx.pp_rank - 1)
        return run_stage(x)

    def land(self, work: StageWork) -> torch.Tensor | None:
        """The last hidden states [B, hidden] of a forward `start` began (with `back`)."""
        pp = self.ctx
        last = work.last
        if work.back and not pp.is_last_stage:
            last = pp.recv_any_stage(pp.pp_size - 1, back=True)
        pp.wait_all(work.sends)
        return last


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
        model.stages = PipelineStages(ctx)
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
