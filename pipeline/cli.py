"""The `ardit` command.

Exit codes: 0 ok; 1 the work ran but some rows failed (or an unexpected error); 2 a usage or
configuration error caught before any work (one line on stderr: what, where, how to fix; the
traceback only with --debug or ARDIT_DEBUG=1); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM: stopped
as on Ctrl-C, with the command that resumes the run).

Nothing heavy is imported at module level (no torch, boto3, kfp): `ardit --help` stays fast.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import uuid
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperCommand

from components.errors import one_line
from components.jobconfig import JobConfig
from components.kvstore.cli import app as store_app
from components.runtime.ranks import Terminated, program_setup
from pipeline.sweep import app as sweep_app
from pipeline.cli_orchestration import app as orchestration_app


class _Ardit(typer.Typer):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # the console script calls `app()`
        sys.exit(main())


app = _Ardit(help="ardit: batch image generation and editing with a two-stage AR + DiT model.",
             no_args_is_help=True, add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(store_app, name="store")
app.add_typer(orchestration_app)  # compile, submit, run-local
app.add_typer(sweep_app)  # sweep, report


@app.callback()
def _root(debug: Annotated[bool, typer.Option(
        "--debug", help="show tracebacks of errors (accepted anywhere on the command line; or ARDIT_DEBUG=1)")]
        = False) -> None:
    """ardit: batch image generation and editing with a two-stage AR + DiT model."""


FROM_CONFIG = "default: the model's generation config"
# --help groups a job's options in these panels
DATA, MODEL, GENERATION, SCHEDULING, STORAGE = ("Data and output", "Model and parallelism", "Generation",
                                                "AR scheduling", "Storage")
Output = Annotated[str, typer.Option("--output", "-o", help="output root: a directory or s3://bucket/prefix",
                                     rich_help_panel=DATA)]
RunId = Annotated[Optional[str], typer.Option(
    "--run-id", help="name of the run; pass an existing one to resume it (default: a new id, printed with the "
    "command that resumes it)", rich_help_panel=DATA)]
Shards = Annotated[str, typer.Option("--num-shards", help="shards to split the dataset into: auto (at least one "
                                     "per model copy, at most 64 rows a shard, 2 for small datasets) or a number",
                                     rich_help_panel=DATA)]
Seed = Annotated[int, typer.Option("--seed", help="base seed for rows without their own `seed` column",
                                   rich_help_panel=DATA)]
KVStore = Annotated[Optional[str], typer.Option(
    "--kv-store", help="mooncake://host:port?metadata=... (see `ardit store up`) or local:///dir; default: kept in "
    "the memory of each model copy's process", rich_help_panel=STORAGE)]
NoKVReuse = Annotated[bool, typer.Option(
    "--no-kv-reuse", help="recompute the prompt K/V in the DiT step instead of taking the AR step's",
    rich_help_panel=STORAGE)]
Model = Annotated[str, typer.Option(
    "--model", help="tiny | demo | hunyuan-image-3 | hunyuan-image-3-distil | a checkpoint directory | a Hugging "
    "Face repo id", rich_help_panel=MODEL)]
Weights = Annotated[Optional[str], typer.Option(
    "--weights", help="safetensors directory (default: the checkpoint's; presets: seeded random weights)",
    rich_help_panel=MODEL)]
DummyWeights = Annotated[bool, typer.Option(
    "--dummy-weights", help="seeded random weights with the model's config (implied for the presets)",
    rich_help_panel=MODEL)]
# vLLM's spellings too: -tp, -pp, -dp
TP = Annotated[int, typer.Option("--tensor-parallel-size", "--tp", "-tp", help="GPUs per pipeline stage of a "
                                 "model copy", rich_help_panel=MODEL)]
PP = Annotated[int, typer.Option(
    "--pipeline-parallel-size", "--pp", "-pp", help="pipeline stages per model copy (a model copy takes tp x pp "
    "GPUs)", rich_help_panel=MODEL)]
DP = Annotated[Optional[int], typer.Option(
    "--data-parallel-size", "--dp", "-dp", help="model copies working through the shards side by side (default: "
    "as many as the visible GPUs hold, GPUs / (tp x pp); 1 on the CPU)", rich_help_panel=MODEL)]
Quantization = Annotated[Optional[str], typer.Option("--quantization", help="fp8 (default: none)",
                                                     rich_help_panel=MODEL)]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", help="float32 | bfloat16 | float16 (default: the model config's)", rich_help_panel=MODEL)]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | cuda:N", rich_help_panel=MODEL)]
Steps = Annotated[Optional[int], typer.Option("--steps", help=f"denoising steps ({FROM_CONFIG})",
                                              rich_help_panel=GENERATION)]
Guidance = Annotated[Optional[float], typer.Option(
    "--guidance", help=f"CFG scale, >= 0; <= 1 turns CFG off ({FROM_CONFIG})", rich_help_panel=GENERATION)]
FlowShift = Annotated[Optional[float], typer.Option("--flow-shift", help=f"scheduler shift ({FROM_CONFIG})",
                                                    rich_help_panel=GENERATION)]
StepCache = Annotated[float, typer.Option(
    "--step-cache", help="approximate DiT speed-up: skip the deep layers on steps where the first layer's output "
                         "changed less than this fraction (0 = off, exact; typical 0.05-0.15)",
    rich_help_panel=GENERATION)]
BotTask = Annotated[Optional[str], typer.Option(
    "--bot-task", help=f"image | recaption | think | think_recaption | auto ({FROM_CONFIG})",
    rich_help_panel=GENERATION)]
SystemPrompt = Annotated[Optional[str], typer.Option(
    "--system-prompt", help=f"en_vanilla | en_recaption | en_think_recaption | en_unified | none | dynamic | "
    f"your own text ({FROM_CONFIG})", rich_help_panel=GENERATION)]
MaxNewTokens = Annotated[Optional[int], typer.Option(
    "--max-new-tokens", help=f"CoT token budget per stage ({FROM_CONFIG})", rich_help_panel=GENERATION)]
Temperature = Annotated[Optional[float], typer.Option(
    "--temperature", help=f"AR sampling temperature, 0 = greedy ({FROM_CONFIG})", rich_help_panel=GENERATION)]
TopK = Annotated[Optional[int], typer.Option("--top-k", help=f"AR top-k, 0 = off ({FROM_CONFIG})",
                                             rich_help_panel=GENERATION)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help=f"AR nucleus sampling, (0, 1] ({FROM_CONFIG})",
                                               rich_help_panel=GENERATION)]
Greedy = Annotated[bool, typer.Option("--greedy", help="greedy AR decoding (temperature 0)",
                                      rich_help_panel=GENERATION)]
Dataset = Annotated[str, typer.Argument(metavar="DATASET", help="the dataset: a Parquet file, a directory of "
                                        "them, or s3://bucket/prefix (columns: see the README)")]
BatchSize = Annotated[str, typer.Option("--batch-size", help="AR rows in flight: auto (sized to GPU memory; 8 on "
                                        "the CPU) or a hard cap", rich_help_panel=SCHEDULING)]
GpuMemoryUtilization = Annotated[float, typer.Option(
    "--gpu-memory-utilization", help="share of GPU memory the AR step may fill (weights, K/V, activations)",
    rich_help_panel=SCHEDULING)]
MaxNumBatchedTokens = Annotated[Optional[int], typer.Option(
    "--max-num-batched-tokens", help="AR prompt tokens prefilled per step, between decode steps (default 2048)",
    rich_help_panel=SCHEDULING)]
Overlap = Annotated[str, typer.Option(
    "--overlap", help="run a shard's AR and DiT steps at once on each model copy, the K/V handed over in memory: "
    "auto (on for one GPU a copy) | on | off", rich_help_panel=SCHEDULING)]
BatchInvariant = Annotated[bool, typer.Option(
    "--batch-invariant", help="each row's AR computed alone: its CoT, K/V and image are bitwise independent of "
    "its batch and shard (slower AR decode)", rich_help_panel=SCHEDULING)]


class _Command(TyperCommand):
    """A command of this file as --help shows it: arguments in the usage line as DATASET (typer
    writes {dataset}) and on/off flags without a `<bool>` type."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.+)\}$", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


def _resume_command(run_id: str | None) -> str:
    """This very command line, with --run-id RUN if it had none (and without --debug), starting
    the way this process was started so that it runs when pasted."""
    args = [a for a in sys.argv[1:] if a != "--debug"]
    if run_id and not any(a == "--run-id" or a.startswith("--run-id=") for a in args):
        args += ["--run-id", run_id]
    return shlex.join([*_invoked_as(), *args])


def _invoked_as() -> list[str]:
    """The command that started this process: `ardit` when the shell finds this very script under
    that name, else its path as typed (`.venv/bin/ardit`), or `python -m pipeline.cli`."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "ardit":
        found = shutil.which("ardit")
        return ["ardit"] if found and os.path.samefile(found, argv0) else [argv0]
    orig = getattr(sys, "orig_argv", [])
    prefix = orig[:len(orig) - (len(sys.argv) - 1)]
    return prefix if "-m" in prefix else ["ardit"]  # `python -m pipeline.cli`, as typed


def _new_run_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:8]}"


def _run(config: JobConfig, resume_adds_run_id: bool = True) -> None:
    from pipeline.local import run_job, run_status

    kind, dataset, output, run_id = config.kind, config.dataset, config.output, config.run_id
    resume = _resume_command(run_id if resume_adds_run_id else None)

    def started() -> None:  # after every check passed, before any work
        typer.echo(f"run {run_id}: {kind} {dataset} -> {output.rstrip('/')}/{run_id}")
        typer.echo(f"resume with: {resume}")

    try:
        summary = run_job(config, on_start=started)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (Terminated)
        st = run_status(output, run_id)
        done = (f"committed {len(st['committed'])} of {st['num_shards']} shard(s), plus {st['rows_recorded']} "
                f"row(s) of the others" if st["sharded"] else "nothing was committed")
        how, code = ("terminated (SIGTERM)", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        typer.echo(f"{how}: {done}; resume with: {resume}", err=True)
        raise typer.Exit(code) from None
    if summary.get("nothing_to_do"):
        failed = f", {summary['rows_failed']} of them failed" if summary.get("rows_failed") else ""
        typer.echo(f"run {run_id}: nothing to do: all {summary.get('num_shards')} shard(s) are committed "
                   f"({summary.get('rows_ok')} image(s){failed}); summary: {output.rstrip('/')}/{run_id}/"
                   "summary.json")
        if summary.get("rows_failed"):
            _print_failed_rows(summary)
        raise typer.Exit(1 if summary.get("rows_failed") else 0)
    _print_summary(summary, output, run_id)
    if summary.get("rows_failed"):
        _print_failed_rows(summary)
        raise typer.Exit(1)


FAILED_ROWS_SHOWN = 5
# allocator retries (cudaFree and try again) a job may have before the summary mentions them: one or
# two cost nothing that shows (the DiT's first 32-row group on 2 x H100 at --pp 2 had one)
ALLOC_RETRIES_WORTH_SAYING = 10


def _print_failed_rows(summary: dict) -> None:
    """Which rows failed and why (the first few; all of them are in summary.json and rows.parquet)."""
    errors = summary.get("errors") or []
    failed = summary.get("rows_failed") or len(errors)
    shown = errors[:FAILED_ROWS_SHOWN]
    more = f", first {len(shown)} shown" if failed > len(shown) else ""
    typer.echo(f"{failed} row(s) failed{more}:", err=True)
    for e in shown:
        typer.echo(f"  {e['id']} (shard {e['shard']}): {one_line(e['error'] or 'failed')}", err=True)


# the parts of a job's time split (summary.json's time_split_s), as the closing table names them
TIME_PARTS = {"load": "model loads", "ar": "AR: prefill + decode", "kv": "K/V handoff: put + get",
              "dit": "DiT: denoising + VAE decode", "other": "other: sharding, images, writes, commits"}
KV_PATHS = {"reuse": "taken from the AR step", "recompute": "recomputed by the DiT step"}
KV_STORES = {"memory": "in memory", "local": "through a local directory", "mooncake": "through Mooncake"}


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} s" if value < 600 else f"{value / 60:.1f} min"


def _share(value: float | None, whole: float | None) -> str:
    return f"{value / whole:.0%}" if value is not None and whole else ""


def _print_summary(summary: dict, output: str, run_id: str) -> None:
    """The closing lines of a job, for a person (all of it, and more, is in summary.json): images,
    throughput, the K/V path, and where the time went, per data-parallel replica where they overlap."""
    from rich.console import Console
    from rich.table import Table

    wall = summary.get("wall_s")
    ok, total, failed = summary.get("rows_ok", 0), summary.get("rows_total", 0), summary.get("rows_failed", 0)
    facts = Table.grid(padding=(0, 2))
    images = f"{ok} of {total} ok" + (f", {failed} failed" if failed else "")
    if summary.get("rows_pending"):
        images += f", {summary['rows_pending']} in shards not committed"
    facts.add_row("images", images)
    if summary.get("images_per_minute") is not None:
        facts.add_row("throughput", f"{summary['images_per_minute']:.3g} images/min over {_seconds(wall)} "
                                    "(the shards' creation to the last commit)")
    stores = summary.get("kv_stores") or {}
    via = f" ({', '.join(KV_STORES.get(name, name) for name in stores)})" if stores else ""
    kv = ", ".join(f"{n} {KV_PATHS.get(path, path)}{via if path == 'reuse' else ''}"
                   for path, n in (summary.get("kv_paths") or {}).items())
    if summary.get("kv_wait_fraction"):
        kv += f"; the DiT waited for K/V {summary['kv_wait_fraction']:.1%} of its time"
    if kv:
        facts.add_row("K/V", kv)
    parallel = summary.get("data_parallel") or {}
    replicas = summary.get("time_split_by_replica_s") or {}
    lost = parallel.get("failed") or []
    if replicas:
        facts.add_row("replicas", f"{parallel.get('replicas', len(replicas))} model copies side by side"
                      + (f", {len(lost)} lost on the way (their shards redone by the others)" if lost else ""))
    console = Console()
    console.print(f"run {run_id}", style="bold")
    console.print(facts)

    split = summary.get("time_split_s") or {}
    title = "where the time went"
    if summary.get("shards_overlapped"):  # each copy's AR and DiT at once: their seconds overlap
        title += " (AR and DiT ran at once: their parts add up to more than the wall time)"
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("")
    if replicas:  # each replica's own clock: their steps overlap, so one sum would exceed the wall time
        for name in replicas:
            table.add_column(f"replica {name}", justify="right")
            table.add_column("", justify="right")
        for part, label in TIME_PARTS.items():
            cells = []
            for times in replicas.values():
                cells += [_seconds(times.get(part)), _share(times.get(part), wall)]
            table.add_row(label, *cells)
    else:
        table.add_column("time", justify="right")
        table.add_column("share", justify="right")
        for part, label in TIME_PARTS.items():
            if part in split:
                table.add_row(label, _seconds(split[part]), _share(split[part], wall))
    table.add_section()
    table.add_row("wall", *([_seconds(wall), ""] * max(1, len(replicas))))
    console.print(table)
    for failure in lost:  # the job may end well (exit 0): say it here too, not only in summary.json
        shard = f" on shard {failure['shard']}" if failure.get("shard") is not None else ""
        typer.echo(f"a data-parallel replica was lost{shard}: {one_line(failure['error'])}", err=True)
    ooms, retries = summary.get("ar_oom_retries") or 0, summary.get("gpu_alloc_retries") or 0
    if ooms:  # no row failed for it, but the AR step redid work with fewer rows
        typer.echo(f"GPU memory ran short in the AR step: it went on with fewer rows after {ooms} OOM(s), which "
                   "slows a job; a lower --gpu-memory-utilization (e.g. 0.8) or a smaller --batch-size leaves more "
                   "room (per shard: shards[].steps in summary.json)")
    if retries >= ALLOC_RETRIES_WORTH_SAYING:
        typer.echo(f"GPU memory was tight: the allocator freed its cache and retried {retries} times, each a pause "
                   "of the whole GPU (per shard and step: shards[].steps in summary.json)")
    typer.echo(f"images and rows.parquet under {output.rstrip('/')}/{run_id}/shards/*/")


def _refuse_empty(values: dict[str, str | None]) -> None:
    """An option given as "" (an unset shell variable, `-o "$OUT"`) is a mistake on the command line,
    not its default: -o "" wrote into the current directory, --run-id "" started a new run."""
    from components.errors import ConfigError

    for option, value in values.items():
        if value is not None and not value.strip():
            raise ConfigError(f"{option} {value!r}: empty; give a value, or leave the option out for its default")


def _refuse_contradictions(*, greedy: bool, temperature: float | None, dummy_weights: bool,
                           weights: str | None) -> None:
    """Two options that say opposite things: one line, rather than one of them silently winning."""
    from components.errors import ConfigError

    if greedy and temperature:
        raise ConfigError(f"--greedy and --temperature {temperature}: greedy decoding is temperature 0; drop one")
    if dummy_weights and weights is not None:
        raise ConfigError(f"--dummy-weights and --weights {weights}: seeded random weights or those files; drop one")


def _job_command(kind: str):
    def command(
        dataset: Dataset,
        output: Output = "outputs", run_id: RunId = None, num_shards: Shards = "auto", seed: Seed = 0,
        model: Model = "tiny", weights: Weights = None, dummy_weights: DummyWeights = False,
        tensor_parallel_size: TP = 1, pipeline_parallel_size: PP = 1, data_parallel_size: DP = None,
        quantization: Quantization = None, dtype: Dtype = None, device: Device = "auto", steps: Steps = None,
        guidance: Guidance = None, flow_shift: FlowShift = None, step_cache: StepCache = 0.0,
        bot_task: BotTask = None, system_prompt: SystemPrompt = None, max_new_tokens: MaxNewTokens = None,
        temperature: Temperature = None, top_k: TopK = None, top_p: TopP = None, greedy: Greedy = False,
        batch_size: BatchSize = "auto", gpu_memory_utilization: GpuMemoryUtilization = 0.9,
        max_num_batched_tokens: MaxNumBatchedTokens = None, batch_invariant: BatchInvariant = False,
        overlap: Overlap = "auto", kv_store: KVStore = None, no_kv_reuse: NoKVReuse = False,
    ) -> None:
        from components.options import auto_or_int

        _refuse_empty({"DATASET": dataset, "--output": output, "--run-id": run_id, "--num-shards": num_shards,
                       "--model": model, "--weights": weights, "--quantization": quantization, "--dtype": dtype,
                       "--device": device, "--batch-size": batch_size, "--kv-store": kv_store})
        _refuse_contradictions(greedy=greedy, temperature=temperature, dummy_weights=dummy_weights, weights=weights)
        _run(JobConfig(
            dataset=dataset, output=output, run_id=run_id or _new_run_id(kind), kind=kind,
            num_shards=auto_or_int(num_shards), kv_store=kv_store, model=model, weights=weights,
            dummy_weights=dummy_weights, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
            quantization=quantization, dtype=dtype, device=device, steps=steps, guidance=guidance,
            flow_shift=flow_shift, bot_task=bot_task, system_prompt=system_prompt, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, kv_reuse=not no_kv_reuse, seed=seed,
            batch_size=auto_or_int(batch_size), step_cache=step_cache, batch_invariant=batch_invariant,
            overlap=overlap, gpu_memory_utilization=gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens))

    return command


app.command("edit", cls=_Command, help="Edit images: instruction + image per row -> edited image per row "
                         "(shard -> AR -> DiT -> summary, on this machine).")(_job_command("edit"))
app.command("generate", cls=_Command, help="Generate images: prompt per row -> image per row "
                             "(shard -> AR -> DiT -> summary, on this machine).")(_job_command("generate"))


@app.command("sample-data", cls=_Command)
def sample_data(path: Annotated[str, typer.Argument(
                    metavar="PATH", help="where to write the Parquet file (or s3://...)")] = "sample_edit.parquet",
                kind: Annotated[str, typer.Option("--kind", help="edit | generate")] = "edit",
                rows: Annotated[int, typer.Option("--rows", "-n", help="number of rows")] = 8,
                targets: Annotated[bool, typer.Option(
                    "--targets", help="add each row's exact target image and scene (columns target, "
                                      "target_scene) for the semantic judge")] = False) -> None:
    """Write a small dataset of synthetic images and instructions (nothing downloaded)."""
    from components.data.sample import write_sample_edit_dataset, write_sample_generate_dataset
    from components.errors import ConfigError

    if kind not in ("edit", "generate"):
        raise ConfigError(f"--kind {kind!r}: must be edit or generate")
    if rows < 1:
        raise ConfigError(f"--rows {rows}: must be >= 1")
    try:
        written = (write_sample_edit_dataset if kind == "edit" else write_sample_generate_dataset)(
            path, n=rows, targets=targets)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write there ({exc.strerror or exc}); choose a path you can write") from None
    typer.echo(f"wrote {rows} {kind} rows to {written}")


@app.command(cls=_Command)
def demo(output: Output = "demo", steps: Steps = None) -> None:
    """Generate a few images and edits with the demo model on CPU (trained by the project on procedural
    scenes), then judge each against its exact target."""
    from components.evaluate.judge import judge_run

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    for kind in ("edit", "generate"):
        dataset = str(out / f"{kind}.parquet")
        sample_data(dataset, kind, 3, targets=True)
        _run(JobConfig(dataset=dataset, output=str(out / "runs"), run_id=f"demo-{kind}", kind=kind, num_shards=1,
                       model="demo", steps=steps, device="cpu"), resume_adds_run_id=False)
        results, _ = judge_run(dataset, str(out / "runs" / f"demo-{kind}"))
        passed = sum(1 for _, verdict in results if verdict is not None and verdict.passed)
        typer.echo(f"demo {kind}: {passed} / {len(results)} rows pass the judge (exact targets in {dataset})")


# ------------------------------------------------------------------------------- error handling


def _quiet_torch_warnings() -> None:
    """torch's C++ warnings stay out of the terminal unless --debug: NCCL's note on the pipeline
    stages' point-to-point links ("unbatched P2P op ... lazy initialization") came once per rank and
    link, noise a user can do nothing about. Errors still show. Read when torch is imported, so set
    before (rank processes inherit it); a value the user set is kept."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    import typer._click.exceptions as click_errors  # typer's click (it vendors one)
    from typer.main import get_command

    from components.errors import ConfigError, config_error_exit

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("ARDIT_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    command = get_command(app)
    if not debug:
        _quiet_torch_warnings()
    try:
        with program_setup():  # SIGTERM raises Terminated while the command runs
            rv = command.main(args=args, prog_name="ardit", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except click_errors.NoArgsIsHelpError:  # `ardit` alone: the help was printed
        return 0
    except click_errors.ClickException as exc:  # bad option, missing argument, unknown command
        ctx = getattr(exc, "ctx", None)
        sub = next((a for a in args if not a.startswith("-")), None)  # `ardit edit x --steps`: no ctx
        where = ctx.command_path if ctx else f"ardit {sub}" if sub in getattr(command, "commands", {}) else "ardit"
        print(f"{where}: error: {one_line(exc.format_message())} (see {where} --help)", file=sys.stderr)
        return exc.exit_code
    except (ConfigError, ImportError) as exc:
        code = None if debug else config_error_exit("ardit", exc, "this command")
        if code is None:
            raise
        return code
    except Terminated:
        print("ardit: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except (KeyboardInterrupt, typer.Abort):
        print("ardit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line; the traceback with --debug
        if debug:
            raise
        print(f"ardit: error: {type(exc).__name__}: {one_line(exc)} (run again with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
