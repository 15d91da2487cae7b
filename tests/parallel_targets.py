"""Functions the launcher tests run on several ranks (importable by spawned processes)."""

from __future__ import annotations

import os
import signal
import time


def sum_ranks(value: int, device: str, parallel) -> int:
    import torch

    t = torch.tensor([float(value + parallel.rank)])
    parallel.all_reduce_(t)
    return int(t.item())


def fail_on_rank(bad_rank: int, how: str, device: str, parallel) -> str:
    import torch

    if parallel.rank == bad_rank:
        if how == "raise":
            raise ValueError("row 3: this rank could not read its weights")
        os.kill(os.getpid(), signal.SIGKILL)
    # the healthy ranks block in a collective the failed rank never joins
    t = torch.ones(1)
    parallel.all_reduce_(t)
    time.sleep(30)
    return "should not get here"
