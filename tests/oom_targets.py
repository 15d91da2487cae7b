"""AR steps with an injected out-of-memory error on one rank (importable by spawned rank processes)."""

from __future__ import annotations


def ar_out_of_memory_allocating(bad_rank: int, parallel, **kwargs):
    """The AR step, where global rank `bad_rank` (only) runs out of memory allocating its first K/V
    pool of more than one row, as a GPU whose free memory was overestimated does."""
    import torch

    from components.ar.run import run
    from components.engine import ar_scheduler

    me = parallel.pp_rank * parallel.world_size + parallel.rank
    fired = []

    def oom(scheduler, rows: int) -> None:
        if me == bad_rank and rows > 1 and not fired:
            fired.append(rows)
            raise torch.OutOfMemoryError(f"CUDA out of memory allocating {rows} rows (injected on rank {me})")

    ar_scheduler.allocation_fault_hook = oom
    try:
        return run(parallel=parallel, **kwargs)
    finally:
        ar_scheduler.allocation_fault_hook = None


def ar_out_of_memory_in_a_forward_once(marker: str, parallel, **kwargs):
    """The AR step, where pipeline stage 0 (only) runs out of memory at its third scheduler step, in
    the middle of the stages' forwards, once: the first process to do so leaves `marker`."""
    import os

    import torch

    from components.ar.run import run
    from components.engine import ar_scheduler

    steps = [0]

    def oom(scheduler) -> None:
        steps[0] += 1
        if parallel.pp_rank == 0 and steps[0] == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            raise torch.OutOfMemoryError("CUDA out of memory (injected on stage 0)")

    ar_scheduler.fault_hook = oom
    try:
        return run(parallel=parallel, **kwargs)
    finally:
        ar_scheduler.fault_hook = None


OOM_MARKER_ENV = "ARDIT_TEST_OOM_MARKER"  # where the first OOM leaves its marker (the job's ranks inherit it)
OOM_RANK_ENV = "ARDIT_TEST_OOM_RANK"  # the global rank that runs out of memory
OOM_SHARD_ENV = "ARDIT_TEST_OOM_SHARD"  # in this shard's AR step


def ar_out_of_memory_in_a_job_forward_once(parallel, **kwargs):
    """A job's AR step (pipeline/local.py's STEP_TARGETS["ar"] in a test), where one global rank
    (OOM_RANK_ENV) of one shard's step (OOM_SHARD_ENV) runs out of memory at its third scheduler step,
    in the middle of the ranks' forwards, once: the first process to do so leaves the marker."""
    import os

    import torch

    from components.ar.run import run
    from components.engine import ar_scheduler

    me = parallel.pp_rank * parallel.world_size + parallel.rank
    fires = me == int(os.environ[OOM_RANK_ENV]) and kwargs["shard"] == int(os.environ[OOM_SHARD_ENV])
    marker, steps = os.environ[OOM_MARKER_ENV], [0]

    def oom(scheduler) -> None:
        steps[0] += 1
        if fires and steps[0] == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {me})")

    ar_scheduler.fault_hook = oom
    try:
        return run(parallel=parallel, **kwargs)
    finally:
        ar_scheduler.fault_hook = None
