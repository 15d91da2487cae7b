"""A tensor-parallel MLP's down projection with a bias (`RowBiasOnce`, engine/parallel.py): each TP
rank computes a partial sum over its slice of the intermediate dim, the group's all-reduce adds
them, and the bias must be in that sum exactly once, in every TP group: each pipeline stage's and
each CFG group's (the uncond row's group sums on its own). CPU, no process group: the ranks'
partial outputs are summed here as the all-reduce would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from components.engine.parallel import RowBiasOnce, split
from components.runtime.parallel import ParallelContext

TP = 2


def _group_output(full: nn.Linear, h: torch.Tensor, cfg_rank: int, pp_rank: int) -> torch.Tensor:
    """The all-reduced output of one TP group: each rank's RowBiasOnce over its input slice."""
    total = torch.zeros(h.shape[0], full.out_features)
    for rank in range(TP):
        lo, hi = split(full.in_features, TP, rank, "intermediate size")
        local = nn.Linear(hi - lo, full.out_features, bias=True)
        with torch.no_grad():
            local.weight.copy_(full.weight[:, lo:hi])
            local.bias.copy_(full.bias)  # every rank holds the bias (the loader replicates it)
        ctx = ParallelContext(rank, TP, torch.device("cpu"), cfg_parallel=cfg_rank is not None,
                              cfg_rank=cfg_rank or 0, pp_rank=pp_rank, pp_size=2)
        total += RowBiasOnce(local, ctx)(h[:, lo:hi])
    return total


@pytest.mark.parametrize("cfg_rank, pp_rank", [(None, 0), (None, 1), (0, 0), (1, 0), (1, 1)],
                         ids=["stage0", "stage1", "cfg-cond", "cfg-uncond", "cfg-uncond-stage1"])
def test_the_bias_counts_once_in_every_tensor_parallel_group(cfg_rank, pp_rank):
    torch.manual_seed(0)
    full = nn.Linear(8, 4, bias=True)
    with torch.no_grad():
        full.bias.copy_(torch.tensor([1.0, -2.0, 3.0, 0.5]))  # large enough to show once, twice or never
    h = torch.randn(3, 8)
    torch.testing.assert_close(_group_output(full, h, cfg_rank, pp_rank), full(h))
