"""`ardit sweep SPEC` and `ardit report SWEEP_DIR` (typer). Register in pipeline/cli.py with
`app.add_typer(components.sweep.cli.app)` or `app.command("sweep")(sweep)` / `app.command("report")(report)`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Accuracy sweeps and reports.", no_args_is_help=True, add_completion=False)


@app.command("sweep")
def sweep(
    spec: Annotated[Path, typer.Argument(help="sweep spec (YAML)", exists=True, dir_okay=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="where sweeps are written")] = Path("sweeps"),
    sweep_id: Annotated[str | None, typer.Option(help="sweep directory name (default: NAME-UTCTIME)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the expanded grid and exit")] = False,
    resume: Annotated[bool, typer.Option(help="keep configs whose run already finished (needs --sweep-id)")] = False,
) -> None:
    """Run every config of SPEC, evaluate it against the reference, write the tables and the report.

    Writes OUTPUT/SWEEP_ID/{sweep.parquet, rows.parquet, budget.parquet, report.html}; exits 1 when
    a gated config fails its thresholds or a run fails (after writing the report)."""
    from components.sweep.runner import expanded_grid_text, run_sweep
    from components.sweep.spec import SpecError, load_spec

    try:
        parsed = load_spec(spec)
    except SpecError as exc:
        typer.echo(f"invalid spec {spec}: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"sweep {parsed.name}: {len(parsed.configs)} configs, reference {parsed.reference}, "
               f"dataset {parsed.base['dataset']}")  # fmt: skip
    typer.echo(expanded_grid_text(parsed))
    if dry_run:
        return
    if resume and not sweep_id:
        typer.echo("--resume needs --sweep-id", err=True)
        raise typer.Exit(2)
    result = run_sweep(parsed, output, sweep_id, resume=resume, log=typer.echo)
    typer.echo(f"sweep written to {result.sweep_dir}")
    if result.report:
        typer.echo(f"report: {result.report}")
    if not result.passed:
        for f in result.failures:
            typer.echo(f"FAIL {f}", err=True)
        raise typer.Exit(1)
    typer.echo("all gates passed")


@app.command("report")
def report(
    sweep_dir: Annotated[
        Path, typer.Argument(help="a sweep directory ({output}/{sweep_id})", exists=True, file_okay=False)
    ],
    out: Annotated[Path | None, typer.Option("--output", "-o", "--out",
                                             help="HTML file (default SWEEP_DIR/report.html)")] = None,
    max_rows: Annotated[int, typer.Option(help="rows shown as image grids (worst first)")] = 24,
) -> None:
    """Write the self-contained HTML report of a finished sweep."""
    from components.report.render import write_report

    try:
        path = write_report(sweep_dir, out, max_rows=max_rows)
    except FileNotFoundError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"report: {path}")


if __name__ == "__main__":
    app()
