"""Run a step program on N tensor-parallel ranks: the step owns its workers.

    python -m components.ar ... --tensor-parallel-size 4
        -> 4 processes (torch.distributed: NCCL on GPUs, gloo on the CPU), rank r on cuda:r
           (with --pipeline-parallel-size P: tp * P processes, rank = stage * tp + tp rank)
        -> each calls the step function (`components.ar.run.run(..., parallel=ParallelContext)`,
           sent by reference: a module-level function); all ranks compute, rank 0
           reads the shard and writes the outputs
        -> a rank that fails (exception, signal, killed) fails the whole step: the others are
           stopped, the step exits non-zero naming the rank, nothing of the shard in flight is
           committed (rank 0 commits only after every rank finished its collectives)

A local job's data-parallel replicas are RankPools too, each on its own GPUs (`device_ids`); a
replica of one rank is one process without a process group. Rank 0's progress (bars, log lines)
travels back to the parent with the results, so one process draws it.

NVLink multicast stays off for NCCL and PyTorch's symmetric memory (it can take shared GPUs out of
service), unless the environment already says otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The caching allocator maps and returns memory in pages instead of fixed segments, so a segment
# that a few live tensors pin cannot keep the rest of it from the next step. Without it, a job's
# second AR shard found less free memory after the first shard's DiT: its K/V pool held fewer rows
# and the rest decoded alone afterwards (docs/benchmarks.md, `--pp 2` third look).
ALLOCATOR_CONF = "expandable_segments:True"


def gpu_env_defaults() -> None:
    """Settings a GPU process needs before CUDA starts, each unless the user set it: NCCL without
    NVLink multicast (SAFE_NCCL_ENV) and the allocator's expandable segments (ALLOCATOR_CONF).
    Spawned ranks inherit them."""
    for key, value in SAFE_NCCL_ENV.items():
        os.environ.setdefault(key, value)
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_CONF  # the name every torch 2.x reads


class RankFailed(RuntimeError):
    """A rank of a tensor-parallel step failed; the message names it and its error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_devices(world_size: int, device: str, pipeline_parallel_size: int = 1,
                  device_ids: list[int] | None = None) -> None:
    """One line when the machine cannot hold `world_size` x `pipeline_parallel_size` ranks on `device`
    (on `device_ids`, one per rank)."""
    if world_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world_size}")
    if pipeline_parallel_size < 1:
        raise ValueError(f"--pipeline-parallel-size must be >= 1, got {pipeline_parallel_size}")
    need = world_size * pipeline_parallel_size
    if device_ids is not None and len(device_ids) != need:
        raise ValueError(f"{need} ranks need {need} device ids, got {device_ids}")
    if device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if have < need:
            what = (f"--tensor-parallel-size {world_size}" if pipeline_parallel_size == 1 else
                    f"--tensor-parallel-size {world_size} x --pipeline-parallel-size {pipeline_parallel_size}")
            raise ValueError(f"{what} needs {need} GPUs, this machine has {have}")
        if device_ids is not None and max(device_ids) >= have:
            raise ValueError(f"GPU {max(device_ids)} is not visible: this machine has {have} GPU(s)")


def run_on_ranks(step: Callable[..., Any], kwargs: dict[str, Any], world_size: int, device: str,
                 timeout_s: float = 1800.0, cfg_parallel: bool = False, pipeline_parallel_size: int = 1) -> Any:
    """Call `step(**kwargs, parallel=ctx)` on `world_size` x `pipeline_parallel_size` ranks; return
    rank 0's result. `step` is a module-level function (the ranks import it by name).

    world_size 1 calls it in this process with parallel=None. cfg_parallel: the ranks form two
    tensor-parallel groups of world_size/2, one per CFG row (a DiT step layout).
    """
    if world_size == 1 and not cfg_parallel and pipeline_parallel_size == 1:
        return step(**kwargs, parallel=None)
    with RankPool(world_size, device, timeout_s, cfg_parallel, pipeline_parallel_size) as pool:
        return pool.run(step, kwargs)


class RankPool:
    """`world_size` (tensor-parallel size) x `pipeline_parallel_size` rank processes that stay up
    across calls, so a job of many shards loads its parallel engine once per rank (each rank keeps
    the engines it loaded) instead of once per shard step. `run` calls a step on every rank and
    returns rank 0's result; a failed rank fails that call with RankFailed and ends the pool (its
    process group is gone).

    device_ids: the GPUs of this pool (rank r on cuda:device_ids[r]; default 0..ranks-1), so
    data-parallel replicas each get their own. A pool of one rank (a replica at TP 1 x PP 1) runs
    the step in its own process without a process group (parallel=None, as in one process).
    cpu_threads: torch threads per rank (default: the host's cores shared by the ranks)."""

    def __init__(self, world_size: int, device: str, timeout_s: float = 1800.0, cfg_parallel: bool = False,
                 pipeline_parallel_size: int = 1, *, device_ids: list[int] | None = None,
                 cpu_threads: int | None = None):
        if cfg_parallel and world_size % 2:
            raise ValueError(f"--cfg-parallel needs an even number of ranks, got {world_size}")
        if cfg_parallel and pipeline_parallel_size > 1:
            raise ValueError("--cfg-parallel does not combine with --pipeline-parallel-size > 1 (use one of them)")
        check_devices(world_size, device, pipeline_parallel_size, device_ids)
        self.pipeline_parallel_size = pipeline_parallel_size
        world_size *= pipeline_parallel_size  # processes: tp ranks in each of the pp stages
        self.world_size, self.device, self.timeout_s, self.cfg_parallel = world_size, device, timeout_s, cfg_parallel
        self.device_ids = list(device_ids) if device_ids is not None else list(range(world_size))
        self.cpu_threads = cpu_threads or max(1, (os.cpu_count() or 1) // world_size)
        self.procs: list = []
        self.broken = False
        self.progress: Any = None  # where rank 0's progress of the running call goes
        self.tasks_seen: dict[int, Any] = {}

    def __enter__(self) -> "RankPool":
        import torch.multiprocessing as mp

        gpu_env_defaults()
        ctx = mp.get_context("spawn")
        self.results = ctx.SimpleQueue()
        self.tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(self.tasks[rank], rank, self.world_size, port, self.device,
                                                        self.timeout_s, self.results, self.cfg_parallel,
                                                        self.pipeline_parallel_size),
                                  kwargs={"device_id": self.device_ids[rank], "cpu_threads": self.cpu_threads},
                                  daemon=False) for rank in range(self.world_size)]
        for p in self.procs:
            p.start()
        return self

    def run(self, step: Callable[..., Any], kwargs: dict[str, Any], progress: Any = None) -> Any:
        """Call `step(**kwargs, parallel=ctx)` on every rank (a module-level function: it travels
        by name). `progress`: a components.progress object of this process; rank 0's step reports
        to it (add_task / advance / finish / skip travel back with the results)."""
        if self.broken:
            raise RankFailed("the tensor-parallel ranks were stopped by an earlier failure")
        self.progress, self.tasks_seen = progress, {}
        for rank, queue in enumerate(self.tasks):
            queue.put((step, kwargs, progress is not None and rank == 0))
        outcome: dict[int, tuple[str, Any]] = {}
        while len(outcome) < self.world_size:
            self._collect(outcome)
            if any(status == "error" for status, _ in outcome.values()):
                self.broken = True
                _settle(self.procs, outcome, lambda: self._collect(outcome))
                rank, why = _root_cause(outcome)
                kind = "tensor-parallel" if self.pipeline_parallel_size == 1 else "pipeline-parallel"
                raise RankFailed(f"{kind} rank {rank} of {self.world_size} failed: {why}")
            time.sleep(0.05)
        return outcome[0][1]

    def restart(self) -> None:
        """Stop the ranks (a failed call broke their process group) and start fresh ones on the same
        devices; each loads its engines again. A job's step that an AR OOM failed goes on so."""
        self.__exit__(None, None, None)
        self.broken = False
        self.__enter__()

    def _collect(self, outcome: dict) -> None:
        """Record every reported result, and every rank that died without reporting."""
        while not self.results.empty():
            self._record(outcome, *self.results.get())
        for rank, p in enumerate(self.procs):
            if rank not in outcome and not p.is_alive():
                p.join()
                while not self.results.empty():  # it may have reported just before exiting
                    self._record(outcome, *self.results.get())
                outcome.setdefault(rank, ("error", f"exited with code {p.exitcode} {DIED}"))

    def _record(self, outcome: dict, rank: int, status: str, value: Any) -> None:
        if status != "progress":
            outcome[rank] = (status, value)
            return
        method, handle, args = value  # rank 0's step reporting progress (see _ForwardedProgress)
        if self.progress is None:
            return
        if method == "add_task":
            self.tasks_seen[handle] = self.progress.add_task(*args)
        elif method == "skip":
            self.progress.skip(*args)
        elif handle in self.tasks_seen:
            getattr(self.progress, method)(self.tasks_seen[handle], *args)

    def __exit__(self, *exc) -> None:
        if not self.broken:
            for queue, p in zip(self.tasks, self.procs):
                if p.is_alive():
                    queue.put(None)  # leave the loop, tear the process group down
        deadline = time.monotonic() + (30 if not self.broken else 0)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def env_seconds(name: str, default: float) -> float:
    """A duration in seconds from the environment variable `name` (unset or empty: `default`)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        from components.errors import ConfigError

        raise ConfigError(f"{name}={value!r} is not a number of seconds: unset it or give one, e.g. {name}=60")
    return seconds


def rank_timeout_s(default: float) -> float:
    """How long a collective may wait for the other ranks before the step fails (ARDIT_RANK_TIMEOUT_S;
    a short one turns a stalled collective into an error that names it, e.g. NCCL's watchdog message)."""
    return env_seconds("ARDIT_RANK_TIMEOUT_S", default) or default


def dump_stacks_on_signal() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to stderr (a stalled job or rank shows
    where it waits; benchmarks/layouts.py --stall-s sends it to the whole job); ARDIT_STACK_DUMP_S=N
    prints them every N seconds without a signal (a process busy in native code may not see one)."""
    import faulthandler
    import signal

    stream = sys.__stderr__  # the process's own stderr: faulthandler writes to its file descriptor
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # none (e.g. pythonw) or not a real file
        return
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    every_s = env_seconds("ARDIT_STACK_DUMP_S", 0)  # and/or every N seconds, by a watchdog thread
    if every_s > 0:
        faulthandler.dump_traceback_later(every_s, repeat=True, file=stream)


class Terminated(KeyboardInterrupt):
    """SIGTERM: what a pod gets on eviction and a workflow step at its deadline. A job or step
    program stops as on Ctrl-C (what is committed stays, it says how to resume), with exit code 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    import multiprocessing

    # A terminal's Ctrl-C reaches the rank processes too; a SIGTERM reaches only this process, and a
    # pod's grace period (30 s by default) would end before the ranks finish their step: stop them now
    for child in multiprocessing.active_children():
        child.terminate()
    raise Terminated()


@contextlib.contextmanager
def program_setup() -> Iterator[None]:
    """What the `ardit` CLI and every step program do first: SIGTERM raises Terminated (on the main
    thread; the previous handler comes back after), the GPU environment's defaults, stacks on
    SIGUSR1, and ARDIT_RANK_TIMEOUT_S checked (a bad one is a ConfigError now, not a rank's error later)."""
    import signal
    import threading

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm) if on_main_thread else None
    try:
        gpu_env_defaults()  # before anything starts CUDA
        dump_stacks_on_signal()
        rank_timeout_s(0)
        yield
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_sigterm is None else previous_sigterm)


def _context(rank: int, world: int, device, cfg_parallel: bool, pipeline_parallel_size: int = 1):
    """This rank's ParallelContext; under CFG parallelism, two tensor-parallel groups (ranks
    [0, N/2) compute the cond row, [N/2, N) the uncond row) and N/2 twin pairs that trade rows.
    Under pipeline parallelism (P stages of tp = N/P ranks, rank = stage * tp + tp rank): a
    tensor-parallel group per stage, and per tp rank a pipeline group of that tp rank in every
    stage, twice (hand-offs forward, and a second communicator for the way back, so the two
    directions never queue behind each other). Every rank creates every group, in the same order,
    as torch.distributed requires."""
    import torch.distributed as dist

    from components.runtime.parallel import ParallelContext

    if pipeline_parallel_size > 1:
        pp, tp = pipeline_parallel_size, world // pipeline_parallel_size
        tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)] if tp > 1 else None
        chains = [[s * tp + r for s in range(pp)] for r in range(tp)]
        pp_groups = [dist.new_group(chain) for chain in chains]
        return_groups = [dist.new_group(chain) for chain in chains]
        stage, tp_rank = divmod(rank, tp)
        ctx = ParallelContext(tp_rank, tp, device, group=tp_groups[stage] if tp_groups else None, pp_rank=stage,
                              pp_size=pp, pp_group=pp_groups[tp_rank], pp_return_group=return_groups[tp_rank])
        ctx.open_stage_links()
        return ctx
    if not cfg_parallel:
        return ParallelContext(rank, world, device)
    tp = world // 2
    tp_groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(2)]
    twin_groups = [dist.new_group([i, i + tp]) for i in range(tp)]
    return ParallelContext(rank % tp, tp, device, group=tp_groups[rank // tp], cfg_parallel=True,
                           cfg_rank=rank // tp, cfg_group=twin_groups[rank % tp])


DIED = "(killed or crashed)"  # how a rank that ended without reporting is described
# A healthy rank whose peer died fails inside a collective; those errors are consequences.
_COLLECTIVE_ERRORS = ("Connection reset", "Connection closed", "Broken pipe", "gloo", "NCCL", "ProcessGroup",
                      "DistBackendError", "timed out")


def _settle(procs, outcome: dict, collect, seconds: float = 3.0) -> None:
    """After a first failure, give the other ranks a moment to report, so the root cause is known."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(outcome) < len(procs):
        collect()
        time.sleep(0.05)


def _root_cause(outcome: dict) -> tuple[int, str]:
    """The failed rank to report: one that died without a word (killed, crashed), then one that raised
    on its own, before one that only saw a peer disappear from a collective. A killed pipeline stage's
    neighbours may fail with any error on what they never received (an AttributeError was reported
    for a stage that was killed)."""
    failed = sorted((r, v) for r, (s, v) in outcome.items() if s == "error")
    died = [(r, v) for r, v in failed if v.endswith(DIED)]
    own = [(r, v) for r, v in failed if not any(marker in v for marker in _COLLECTIVE_ERRORS)]
    return (died or own or failed)[0]


class _ForwardedProgress:
    """Rank 0's progress object: each call travels to the parent with the results, where the
    pool hands it to the parent's progress (one bar per step, drawn by one process)."""

    def __init__(self, results, rank: int):
        self.results, self.rank, self.handles = results, rank, 0

    def _send(self, method: str, handle: int | None, *args: Any) -> None:
        self.results.put((self.rank, "progress", (method, handle, args)))

    def add_task(self, label: str, total: int) -> int:
        self.handles += 1
        self._send("add_task", self.handles, label, total)
        return self.handles

    def advance(self, task: int, n: int = 1) -> None:
        self._send("advance", task, n)

    def finish(self, task: int) -> None:
        self._send("finish", task)

    def skip(self, label: str, why: str) -> None:
        self._send("skip", None, label, why)


def _worker(tasks, rank: int, world: int, port: int, device: str, timeout_s: float, results,
            cfg_parallel: bool = False, pipeline_parallel_size: int = 1, *, device_id: int | None = None,
            cpu_threads: int | None = None) -> None:
    """A rank: join the process group once, then run each (step, kwargs) from `tasks` until None.
    A lone rank (world 1, a data-parallel replica at TP 1 x PP 1) has no process group: parallel=None."""
    import torch
    import torch.distributed as dist

    dump_stacks_on_signal()
    try:
        on_gpu = device.startswith("cuda")
        # the ranks share the host's cores, GPU ranks too: torch's default (every core in every
        # process) let two pipeline stages' host work spin ~11 cores each on a 2 x H200 host
        torch.set_num_threads(cpu_threads or max(1, (os.cpu_count() or 1) // world))
        if on_gpu:
            gpu = rank if device_id is None else device_id
            torch.cuda.set_device(gpu)
            dev = torch.device("cuda", gpu)
        else:
            dev = torch.device("cpu")
        grouped = world > 1 or cfg_parallel
        if grouped:
            dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=rank_timeout_s(timeout_s)))
        ctx = _context(rank, world, dev, cfg_parallel, pipeline_parallel_size) if grouped else None
        while (task := tasks.get()) is not None:
            step, kwargs, reports = task
            extra = {"progress": _ForwardedProgress(results, rank)} if reports else {}
            value = step(**on_device(kwargs, str(dev)), **extra, parallel=ctx)
            results.put((rank, "ok", value if rank == 0 else None))
        if grouped:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent, then die
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        if os.environ.get("ARDIT_DEBUG"):
            detail += "\n" + traceback.format_exc()
        results.put((rank, "error", detail))
        sys.exit(1)
    _exit_now()


def on_device(kwargs: dict[str, Any], device: str) -> dict[str, Any]:
    """A step's keywords on this rank's device (its GPU, not the job's "cuda"): a job step's device
    is its JobConfig's (`config`), a plain function's the `device` keyword."""
    from components.jobconfig import JobConfig

    config = kwargs.get("config")
    if isinstance(config, JobConfig):
        return {**kwargs, "config": config.replace(device=device)}
    return {**kwargs, "device": device}


def _exit_now() -> None:
    """End a rank whose work is done without the interpreter's teardown of its modules and tensors,
    which only frees what the process's exit frees anyway (1.5 s a pool of two ranks for the tiny
    model on the CPU, after the job's last commit). The exit handlers still run first: they stop
    Inductor's compile workers. The steps closed their stores and committed their outputs already."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
