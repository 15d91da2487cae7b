"""`ardit sweep` / `ardit report` wired to this machine's job runner, and the sweep step program
`python -m pipeline.sweep sweep SPEC ...` that the cluster workflows run.

components.sweep knows specs, evaluation, budgets and reports, and takes the job runner as an
argument; pipeline decides how one job runs (here: `pipeline.local.run_job` in this process).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from components.sweep.cli import make_app
from components.sweep.runner import AR_FROM_PARAM, JobOutcome, JobRunner

# Passed only when run_job accepts them; when it does not, the config runs without them and says so.
OPTIONAL_PARAMS = frozenset({"save_latents", AR_FROM_PARAM})
# Settings whose neutral value is what a job does anyway: left out when run_job lacks the parameter;
# any other value is a clear per-config error (e.g. fp8 before the engine supports it).
NEUTRAL_VALUES: dict[str, Any] = {"quantization": "none", "tensor_parallel_size": 1, "step_cache": 0.0}


class UnsupportedSetting(ValueError):
    """A sweep setting this ardit's job runner cannot apply (one line, recorded for the config)."""


def run_job_adapter(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
    """Run one config with `pipeline.local.run_job(**params, output=, run_id=)`.

    Settings absent from the spec (None) are not passed: run_job then takes them from the model's
    generation config."""
    from pipeline.local import run_job  # imported at run time: --dry-run and tests need no engine

    kwargs: dict[str, Any] = {k: v for k, v in params.items() if v is not None}
    kwargs.update(output=str(output), run_id=run_id)
    if ar_from:
        kwargs[AR_FROM_PARAM] = ar_from
    sig = inspect.signature(run_job)
    if "data_parallel_size" in sig.parameters:  # one model copy per config: its timings compare configs
        kwargs.setdefault("data_parallel_size", 1)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    notes: list[str] = []
    if not takes_any:
        for key in list(kwargs):
            if key in sig.parameters:
                continue
            if key in OPTIONAL_PARAMS:
                kwargs.pop(key)
                notes.append(f"run_job does not accept {key}; not passed")
            elif key in NEUTRAL_VALUES and kwargs[key] == NEUTRAL_VALUES[key]:
                kwargs.pop(key)
            elif key in NEUTRAL_VALUES:
                raise UnsupportedSetting(
                    f"{key}={kwargs[key]} is not supported by this ardit's job runner yet "
                    f"(pipeline.local.run_job has no {key} parameter)"
                )
            else:
                raise UnsupportedSetting(f"pipeline.local.run_job does not accept {key!r} (sweep parameter)")
    result = run_job(**kwargs)
    return JobOutcome(result=result if isinstance(result, dict) else {}, notes=notes, ar_pinned=AR_FROM_PARAM in kwargs)


def local_job_runner() -> JobRunner:
    return run_job_adapter


app = make_app(local_job_runner)

if __name__ == "__main__":
    app(prog_name="python -m pipeline.sweep")
