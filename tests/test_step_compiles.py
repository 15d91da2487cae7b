"""A step's record says how many frames Dynamo compiled during it and what that took."""

from __future__ import annotations

import torch

from components.engine.step_memory import StepCompiles


def _scaled_sine(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


def test_a_step_s_compiles_are_counted_and_a_warm_graph_is_not() -> None:
    compiled = torch.compile(_scaled_sine, backend="aot_eager", dynamic=False)
    first = StepCompiles()
    compiled(torch.randn(5))
    compiled(torch.randn(7))  # static shapes: a second frame
    cold = first.stats()
    assert cold["frames"] == 2 and cold["seconds"] > 0

    second = StepCompiles()
    compiled(torch.randn(5))  # both graphs exist in this process now
    compiled(torch.randn(7))
    assert second.stats() == {"frames": 0, "seconds": 0.0}
