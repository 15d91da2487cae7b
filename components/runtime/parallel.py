"""How a model copy's ranks talk: this rank's place among them and their collectives
(`ParallelContext`: the tensor-parallel all-reduces, CFG-parallel trades, pipeline-stage sends and
receives), and a pipeline stage's hand-offs around its own layers (`PipelineStages`).

The rank processes (ranks.py) build a ParallelContext and hand it to the engine, whose
`parallelize` (engine/parallel.py) slices the model for this rank and gives a staged model its
`PipelineStages` (`ctx.stages()`): the engine imports nothing of this package, and the model's own
code (transformer.py) talks to no rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from components.engine.kernels import RankLost  # defined with the kernels (is_kernel_failure lets it through)

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

    def stages(self) -> PipelineStages:
        """This pipeline stage's hand-offs around its own layers (engine `parallelize` gives them to
        a staged model as `model.stages`)."""
        return PipelineStages(self)


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
