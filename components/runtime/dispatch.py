"""Run a step function: in this process, or on the tensor- / pipeline-parallel rank processes of
components.runtime.ranks; ranks that failed and left the step something new to start from (its
`restart_from`: an AR step's halved budget after an OOM) start again from it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from components.errors import ConfigError
from components.jobconfig import JobConfig
from components.runtime.layout import check_pipeline_stages, check_tensor_parallel


# A step function: `components.ar.run.run`, `components.dit.run.run` (or a test's). It takes the
# step's keywords (`config`, a JobConfig, and `shard`; the step's own, such as `then`), `progress`
# and `parallel`; rank processes get it by reference, so it is a module-level function.
Step = Callable[..., Any]
# What a step would start from, given its keywords (None: nothing to go by), e.g.
# components.ar.budget.kept_budget. run_step reads it before the ranks run and after they failed:
# when the failure changed it, the ranks start again (str() of it is said on stderr).
RestartFrom = Callable[[dict[str, Any]], Any]


def run_step(step: Step, kwargs: dict[str, Any], progress: Any = None, cfg_parallel: bool = False,
             pool: Any = None, restart_from: RestartFrom | None = None) -> Any:
    """Call `step(**kwargs)` in this process, or, with the tensor_parallel_size N and
    pipeline_parallel_size P of `kwargs["config"]` (a JobConfig), N * P > 1 (or a CFG-parallel
    DiT), on N * P rank processes: every rank computes, rank 0 reads and writes. `pool`: a
    components.runtime.ranks.RankPool that outlives this step (a job's shards then share the
    ranks' engines; a data-parallel replica is one, even of one rank); without one the ranks start
    and stop with the step. Returns rank 0's result. Ranks that failed and changed what
    `restart_from` reads (an AR OOM inside a forward halves the budget kept in the run) start again
    (the pool's too) and run the step from it, at most MAX_RESTARTS times."""
    config: JobConfig = kwargs["config"]
    world, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    if stages > 1:
        check_pipeline_stages(config.model, stages)
    if not cfg_parallel:  # CFG-parallel ranks form two groups of world / 2
        check_tensor_parallel(config.model, world)
    global running_step
    running_step = kwargs  # what an interrupted step program says was committed (step_main)
    if pool is None and world == 1 and stages == 1 and not cfg_parallel:
        return step(**kwargs, progress=progress)
    from components.runtime.ranks import RankFailed, run_on_ranks

    restarts = 0
    while True:
        before = restart_from(kwargs) if restart_from is not None else None
        try:
            if pool is not None:
                return pool.run(step, kwargs, progress)
            return run_on_ranks(step, kwargs, world, config.device, cfg_parallel=cfg_parallel,
                                pipeline_parallel_size=stages)
        except ValueError as exc:  # more ranks than GPUs, an odd CFG-parallel size
            raise ConfigError(str(exc)) from None
        except RankFailed as exc:
            # the failed ranks left the step something new to start from (the ranks cannot retry a
            # failed forward alone): start them again from it, at most a few times (a job's pool too:
            # its ranks are gone, the rows its earlier shards committed stay)
            after = restart_from(kwargs) if restart_from is not None else None
            if after is None or after == before or restarts >= MAX_RESTARTS:
                raise
            restarts += 1
            print(f"{exc}; starting the ranks again with {after} (restart {restarts} of at most {MAX_RESTARTS})",
                  file=sys.stderr, flush=True)
            if pool is not None:
                pool.restart()


running_step: dict[str, Any] | None = None  # the kwargs of the step run_step started last (step_program reads it)
MAX_RESTARTS = 6  # enough for an AR budget halved from 64 rows in flight down to 1


def rank_pool(tensor_parallel_size: int, device: str, pipeline_parallel_size: int = 1, *,
              device_ids: list[int] | None = None, cpu_threads: int | None = None, own_process: bool = False) -> Any:
    """A context manager: a RankPool for a job's tensor- / pipeline-parallel steps (tp x pp ranks on
    `device_ids`), or nothing at TP 1 x PP 1, where the steps run in this process, unless
    `own_process` (a data-parallel replica runs in a process of its own, even at one rank)."""
    import contextlib

    if tensor_parallel_size * pipeline_parallel_size <= 1 and not own_process:
        return contextlib.nullcontext(None)
    from components.runtime.ranks import RankPool

    try:
        return RankPool(tensor_parallel_size, device, pipeline_parallel_size=pipeline_parallel_size,
                        device_ids=device_ids, cpu_threads=cpu_threads)
    except ValueError as exc:  # more ranks than GPUs
        raise ConfigError(str(exc)) from None
