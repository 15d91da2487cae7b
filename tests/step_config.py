"""A JobConfig for the tests that call a step (components.ar / .dit / .overlap run) directly."""

from __future__ import annotations

from typing import Any

from components.jobconfig import JobConfig


def step_config(output: Any, run_id: str, **fields: Any) -> JobConfig:
    """Run `run_id` of the output root `output` on the CPU, with `fields` (JobConfig fields) and the
    defaults otherwise. No dataset: a step reads its shard's inputs from the run (the shard step's)."""
    return JobConfig(dataset="", output=str(output), run_id=run_id, device="cpu", **fields)
