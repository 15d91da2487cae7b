"""`ardit sweep` / `ardit report` wired to this machine's job runner, and the sweep step program
`python -m pipeline.sweep sweep SPEC ...` that the cluster workflows run.

components.sweep knows specs, evaluation, budgets and reports, and takes the job runner as an
argument; pipeline decides how one job runs (here: `pipeline.local.run_job` in this process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.sweep.cli import make_app
from components.sweep.runner import AR_FROM_PARAM, JobOutcome, JobRunner


class UnsupportedSetting(ValueError):
    """A sweep setting this ardit's job runner cannot apply (one line, recorded for the config)."""


def run_job_adapter(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
    """Run one config: `pipeline.local.run_job(JobConfig(**params, output=, run_id=))`.

    Settings absent from the spec (None) are not passed: the job then takes them from the model's
    generation config. One model copy per config (data_parallel_size 1 unless the spec says): its
    timings compare configs."""
    from components.errors import ConfigError
    from components.jobconfig import JobConfig
    from pipeline.local import run_job  # imported at run time: --dry-run and tests need no engine

    settings: dict[str, Any] = {"data_parallel_size": 1}
    settings.update({k: v for k, v in params.items() if v is not None})
    settings.update(output=str(output), run_id=run_id)
    if ar_from:
        settings[AR_FROM_PARAM] = ar_from
    try:
        config = JobConfig.from_dict(settings)
    except ConfigError as exc:  # a sweep parameter the job config lacks
        raise UnsupportedSetting(f"sweep parameter: {exc}") from None
    result = run_job(config)
    return JobOutcome(result=result if isinstance(result, dict) else {}, ar_pinned=bool(ar_from))


def local_job_runner() -> JobRunner:
    return run_job_adapter


app = make_app(local_job_runner)

if __name__ == "__main__":
    app(prog_name="python -m pipeline.sweep")
