"""The `ardit` command."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer

from components.kvstore.cli import app as store_app
from pipeline.sweep import app as sweep_app
from pipeline.cli_orchestration import app as orchestration_app

app = typer.Typer(help="ardit: batch image generation and editing with a two-stage AR + DiT model.",
                  no_args_is_help=True, add_completion=False)
app.add_typer(store_app, name="store")
app.add_typer(orchestration_app)  # compile, submit, run-local
app.add_typer(sweep_app)  # sweep, report

Output = Annotated[str, typer.Option("--output", "-o", help="output root: a directory or s3://bucket/prefix")]
RunId = Annotated[Optional[str], typer.Option("--run-id", help="re-use a run id to resume it (default: new)")]
Shards = Annotated[int, typer.Option("--num-shards", help="shards to split the dataset into")]
KVStore = Annotated[Optional[str], typer.Option("--kv-store", help="mooncake://host:port?metadata=... "
                                                "(default: a local directory beside the outputs)")]
Model = Annotated[str, typer.Option("--model", help="tiny | hunyuan-image-3 | a checkpoint directory")]
Weights = Annotated[Optional[str], typer.Option("--weights", help="safetensors dir (default: dummy random weights)")]
Steps = Annotated[int, typer.Option("--steps", help="denoising steps")]
Guidance = Annotated[float, typer.Option("--guidance", help="CFG scale (<= 1 turns CFG off)")]
BotTask = Annotated[str, typer.Option("--bot-task", help="image | recaption | think | think_recaption")]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda")]


def _run(kind: str, dataset: str, output: str, run_id: str | None, num_shards: int, kv_store: str | None,
         model: str, weights: str | None, steps: int, guidance: float, bot_task: str, device: str,
         no_kv_reuse: bool, temperature: float, seed: int) -> None:
    from pipeline.local import run_job

    run_id = run_id or f"{kind}-{uuid.uuid4().hex[:8]}"
    typer.echo(f"run {run_id}: {kind} {dataset} -> {output}/{run_id}")
    summary = run_job(dataset, output, run_id, kind=kind, num_shards=num_shards, model=model, weights=weights,
                      kv_store=kv_store, steps=steps, guidance=guidance, bot_task=bot_task, device=device,
                      kv_reuse=not no_kv_reuse, temperature=temperature, seed=seed)
    _print_summary(summary, output, run_id)
    if summary.get("rows_failed"):
        raise typer.Exit(1)


def _print_summary(summary: dict, output: str, run_id: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {run_id}", show_header=False)
    keys = ("rows_total", "rows_ok", "rows_failed", "images_per_minute", "kv_paths", "time_split_s", "wall_s")
    for key in keys:
        if key in summary:
            value = summary[key]
            table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else f"{value}")
    Console().print(table)
    typer.echo(f"images and rows.parquet under {output.rstrip('/')}/{run_id}/shards/*/")


@app.command()
def edit(dataset: Annotated[str, typer.Argument(help="edit dataset: Parquet file/dir or s3://")],
         output: Output = "outputs", run_id: RunId = None, num_shards: Shards = 2, kv_store: KVStore = None,
         model: Model = "tiny", weights: Weights = None, steps: Steps = 20, guidance: Guidance = 5.0,
         bot_task: BotTask = "think_recaption", device: Device = "auto",
         no_kv_reuse: Annotated[bool, typer.Option("--no-kv-reuse")] = False,
         temperature: Annotated[float, typer.Option("--temperature", help="AR sampling; 0 = greedy")] = 0.0,
         seed: Annotated[int, typer.Option("--seed")] = 0) -> None:
    """Edit images: instruction + image per row -> edited image per row (shard -> AR -> DiT -> summary)."""
    _run("edit", dataset, output, run_id, num_shards, kv_store, model, weights, steps, guidance, bot_task, device,
         no_kv_reuse, temperature, seed)


@app.command()
def generate(dataset: Annotated[str, typer.Argument(help="generation dataset: Parquet file/dir or s3://")],
             output: Output = "outputs", run_id: RunId = None, num_shards: Shards = 2, kv_store: KVStore = None,
             model: Model = "tiny", weights: Weights = None, steps: Steps = 20, guidance: Guidance = 5.0,
             bot_task: BotTask = "think_recaption", device: Device = "auto",
             no_kv_reuse: Annotated[bool, typer.Option("--no-kv-reuse")] = False,
             temperature: Annotated[float, typer.Option("--temperature")] = 0.0,
             seed: Annotated[int, typer.Option("--seed")] = 0) -> None:
    """Generate images: prompt per row -> image per row."""
    _run("generate", dataset, output, run_id, num_shards, kv_store, model, weights, steps, guidance, bot_task,
         device, no_kv_reuse, temperature, seed)


@app.command("sample-data")
def sample_data(path: Annotated[str, typer.Argument(help="where to write the Parquet file")] = "sample_edit.parquet",
                kind: Annotated[str, typer.Option("--kind", help="edit | generate")] = "edit",
                rows: Annotated[int, typer.Option("--rows", "-n")] = 8) -> None:
    """Write a small dataset of synthetic images and instructions (nothing downloaded)."""
    from components.data.sample import write_sample_edit_dataset, write_sample_generate_dataset

    written = (write_sample_edit_dataset if kind == "edit" else write_sample_generate_dataset)(path, n=rows)
    typer.echo(f"wrote {rows} {kind} rows to {written}")


@app.command()
def demo(output: Output = "demo", steps: Steps = 12) -> None:
    """Generate a few images and edits with the tiny model on CPU (random weights: noise-like images)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    sample_data(str(out / "edit.parquet"), "edit", 3)
    sample_data(str(out / "generate.parquet"), "generate", 3)
    for kind in ("edit", "generate"):
        _run(kind, str(out / f"{kind}.parquet"), str(out / "runs"), f"demo-{kind}", 1, None, "tiny", None, steps,
             5.0, "think_recaption", "cpu", False, 0.0, 0)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
