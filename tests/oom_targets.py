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
