"""The `sweep` and `report` commands (typer), built around a job runner:

    app = make_app(lambda: my_job_runner)    # pipeline/sweep.py passes pipeline.local.run_job

`ardit sweep` / `ardit report` and `python -m pipeline.sweep` are that app. The runner factory is
called only when a sweep really runs, so `--dry-run` and `report` never load an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from components.extras import MissingExtra, needs_extra, require_extra

if TYPE_CHECKING:
    from components.sweep.runner import JobRunner

DOCS = "docs/sweeps.md"


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


def make_app(job_runner: Callable[[], JobRunner]) -> typer.Typer:
    app = typer.Typer(help="Accuracy sweeps and reports.", no_args_is_help=True, add_completion=False)

    @app.command("sweep")
    def sweep(
        spec: Annotated[Path, typer.Argument(help=f"sweep spec (YAML, keys in {DOCS})", exists=True, dir_okay=False)],
        output: Annotated[Path, typer.Option("--output", "-o", help="where sweeps are written")] = Path("sweeps"),
        sweep_id: Annotated[str | None, typer.Option(help="sweep directory name (default: NAME-UTCTIME)")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="print the expanded grid and exit")] = False,
        resume: Annotated[
            bool,
            typer.Option(help="keep configs whose run finished with the same settings; rerun changed ones "
                              "(needs --sweep-id)"),  # fmt: skip
        ] = False,
    ) -> None:
        """Run every config of SPEC, evaluate it against the reference, write the tables and the report.

        Writes OUTPUT/SWEEP_ID/{sweep.parquet, rows.parquet, budget.parquet, report.html}; exits 1 when
        a gated config fails its thresholds or a run fails (after writing the report), 2 on a bad spec."""
        from components.sweep.spec import SpecError, expanded_grid_text, load_spec

        try:
            parsed = load_spec(spec)
        except SpecError as exc:
            raise _fail(f"invalid spec {spec}: {exc} (spec keys: {DOCS})") from None
        typer.echo(f"sweep {parsed.name}: {len(parsed.configs)} configs, reference {parsed.reference}, "
                   f"dataset {parsed.base['dataset']}")  # fmt: skip
        typer.echo(expanded_grid_text(parsed))
        if dry_run:
            return
        if resume and not sweep_id:
            raise _fail("--resume needs --sweep-id (the directory name under --output to resume)")
        try:
            require_extra("sweep", "ardit sweep")  # before any job runs, not after the last one
            with needs_extra("sweep", "ardit sweep"):
                from components.sweep.runner import ResumeError, run_sweep
        except MissingExtra as exc:
            raise _fail(str(exc)) from None
        try:
            result = run_sweep(parsed, output, sweep_id, runner=job_runner(), resume=resume, log=typer.echo)
        except ResumeError as exc:
            raise _fail(str(exc)) from None
        typer.echo(f"sweep written to {result.sweep_dir}")
        typer.echo(result.verdict_line)
        if not result.passed:
            for f in result.failures:
                typer.echo(f"FAIL {f}", err=True)
            raise typer.Exit(1)

    @app.command("report")
    def report(
        sweep_dir: Annotated[
            Path, typer.Argument(help="a job run (OUT/RUN of `ardit edit|generate`) or a sweep directory "
                                      "({output}/{sweep_id})", exists=True, file_okay=False)
        ],
        out: Annotated[Path | None, typer.Option("--output", "-o", "--out", help="HTML file (default DIR/report.html)")] = None,
        max_rows: Annotated[int | None, typer.Option(
            help="rows shown as image grids (sweep: worst first, default 24; job run: in order, default 60)")] = None,
    ) -> None:
        """Write the self-contained HTML report of a job run (inputs, outputs, CoT, error rows, time) or
        of a finished sweep."""
        try:
            with needs_extra("report", "ardit report"):
                from components.report.job import is_job_run, write_job_report
                from components.report.render import write_report
        except MissingExtra as exc:
            raise _fail(str(exc)) from None
        try:
            if is_job_run(sweep_dir):
                path = write_job_report(sweep_dir, out, max_rows=max_rows or 60)
            else:
                path = write_report(sweep_dir, out, max_rows=max_rows or 24)
        except FileNotFoundError as exc:
            raise _fail(f"{exc}; nor a job run (no inputs/manifest.json): pass OUT/RUN of `ardit edit|generate`"
                        if not is_job_run(sweep_dir) else str(exc)) from None
        typer.echo(f"report: {path}")

    return app
