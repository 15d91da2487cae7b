"""The AR budget a run goes on with after an out-of-memory error: `{run}/settings/ar_budget.json`.

The scheduler halves its row cap and K/V budget on an OOM (engine/ar_scheduler.py). Under tensor /
pipeline parallelism an OOM inside a forward still fails the step (the other ranks wait in its
collectives), so the halved budget is written here before the step fails, and the resume (the
orchestrator's retry, or the same command again) starts from it instead of running into the same
OOM on every retry. A step that recovered on its own writes the budget that worked too, so the
run's next shards start there. It holds for the layout it was learned on (tensor x pipeline
parallel size, CPU or GPU); another layout sizes its budget afresh.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from components.data.runs import RunLayout, utc_now

BUDGET_NAME = "ar_budget"  # layout.settings_key(BUDGET_NAME)
NO_LIMIT = 1 << 62  # stands for "no limit" where ranks agree on the smallest value


def _layout_of(tensor_parallel_size: int, pipeline_parallel_size: int, device: str) -> dict[str, Any]:
    return {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
            "device": "cuda" if str(device).startswith("cuda") else "cpu"}


def read_budget(layout: RunLayout, tensor_parallel_size: int, pipeline_parallel_size: int,
                device: str) -> dict[str, Any] | None:
    """The budget this run last worked with after an OOM, for this layout; None when there is none
    (or it was learned on another layout)."""
    try:
        saved = layout.read_json(layout.settings_key(BUDGET_NAME))
    except ValueError:  # not JSON (a truncated write): as if none, the next OOM writes it again
        return None
    if not isinstance(saved, dict):
        return None
    if any(saved.get(k) != v for k, v in _layout_of(tensor_parallel_size, pipeline_parallel_size, device).items()):
        return None
    return saved



@dataclass(frozen=True)
class KeptBudget:
    """The budget a run's AR steps start from after an OOM (read_budget's row cap and K/V budget)."""

    max_rows: int | None
    kv_budget_bytes: int | None

    def __str__(self) -> str:  # run_step says what the ranks start again with
        return f"at most {self.max_rows} AR row(s) in flight"


def kept_budget(step_kwargs: dict[str, Any]) -> KeptBudget | None:
    """The AR step's `restart_from` for components.runtime.dispatch.run_step: the budget the run of
    the step's `config` keeps for its layout, or None (none, or no config). Ranks that ran out of
    memory inside a forward fail with a smaller one kept: run_step starts them again from it."""
    config = step_kwargs.get("config")
    if config is None:
        return None
    try:
        saved = read_budget(RunLayout.open(config.output, config.run_id), config.tensor_parallel_size,
                            config.pipeline_parallel_size, config.device)
    except Exception:  # noqa: BLE001 - no budget to go by: the failure stands as it is
        return None
    return None if saved is None else KeptBudget(saved.get("max_rows"), saved.get("kv_budget_bytes"))


def apply_budget(admission: Any, saved: dict[str, Any] | None, parallel: Any = None) -> dict[str, Any] | None:
    """Lower `admission` (an ar_scheduler.Admission) to the saved budget; every rank agrees on the
    smallest (each read the file; none may admit differently). What was applied, or None."""
    rows = saved.get("max_rows") if saved else None
    kv = saved.get("kv_budget_bytes") if saved else None
    if parallel is not None and (parallel.world_size > 1 or parallel.pp_size > 1):
        rows, kv = (parallel.agree_min(NO_LIMIT if v is None else int(v)) for v in (rows, kv))
        rows, kv = (None if v == NO_LIMIT else v for v in (rows, kv))
    if rows is None and kv is None:
        return None
    admission.at_most(rows, kv)
    return {"max_rows": rows, "kv_budget_bytes": kv}


def remember_budget(layout: RunLayout, halved_to: tuple[int, int | None], shard: int, why: str,
                    tensor_parallel_size: int, pipeline_parallel_size: int, device: str) -> None:
    """Write the halved budget for the run's next AR steps. Best effort: a failed write must not hide
    the step's own outcome (the resume then finds the OOM again and halves again)."""
    rows, kv = halved_to
    record = {"max_rows": rows, "kv_budget_bytes": kv, "shard": shard, "why": why, "recorded_at": utc_now(),
              **_layout_of(tensor_parallel_size, pipeline_parallel_size, device)}
    try:
        layout.write_json(layout.settings_key(BUDGET_NAME), record)
    except Exception as e:  # noqa: BLE001 - see the docstring
        print(f"ar: could not keep the halved AR budget ({rows} rows) for the resume: {type(e).__name__}: {e}",
              file=sys.stderr)
