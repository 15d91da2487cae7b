"""What every step program (`python -m components.ar`, `.dit`, `.shard`, `.summary`) shares: its
argument parsing (one-line usage errors, the empty placeholders orchestrators pass, the engine
options of the AR and DiT steps) and its main (`step_main`: exit code 2 for a configuration
error, 130 for Ctrl-C, 143 for SIGTERM, what is committed said)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from components.devices import resolve_device
from components.errors import ConfigError, config_error_exit
from components.options import QUANTIZATIONS, quantization_option


class StepArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit code 2, like every config error)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def optional_int(text: str) -> int | None:
    """An int, or None for '' / 'none' / 'auto' (orchestrators pass empty placeholders)."""
    return None if text.strip().lower() in ("", "none", "auto", "null") else int(text)


def optional_float(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none", "auto", "null") else float(text)


def optional_str(text: str) -> str | None:
    return None if text.strip().lower() in ("", "null") else text


def optional_bool(text: str) -> bool:
    """true/false (yes/no, 1/0); '' is false (orchestrators pass empty placeholders)."""
    value = text.strip().lower()
    if value in ("", "false", "no", "0", "off", "none", "null"):
        return False
    if value in ("true", "yes", "1", "on"):
        return True
    raise ValueError(text)


optional_bool.__name__ = "true/false"
optional_int.__name__ = "integer"  # argparse names the type in its "invalid ... value" message
optional_float.__name__ = "number"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Arguments the AR and DiT step programs share."""
    p.add_argument("--output", "-o", required=True, help="output root: a directory or s3://bucket/prefix")
    p.add_argument("--run-id", required=True, help="the run (the shard step created it)")
    p.add_argument("--shard", type=int, required=True, help="shard number, 0 .. num_shards-1")
    p.add_argument("--model", default="tiny",
                   help="preset (tiny, hunyuan-image-3), checkpoint directory or Hugging Face repo id")
    p.add_argument("--weights", type=optional_str, default=None,
                   help="safetensors directory (default: the checkpoint's; presets: seeded random weights)")
    p.add_argument("--dummy-weights", action="store_true", help="seeded random weights with the model's config")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="GPUs per pipeline stage, the layers split by heads and experts (default 1)")
    p.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1,
                   help="pipeline stages, contiguous decoder layers each; a model copy uses tp x pp GPUs (default 1)")
    p.add_argument("--quantization", type=quantization_option, default=None, choices=[None, *QUANTIZATIONS],
                   help="fp8 (default: none)")
    p.add_argument("--kv-store", type=optional_str, default=None,
                   help="local:///dir or mooncake://host:port?metadata=... (default: a directory beside the outputs)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", type=optional_str, default=None, help="float32 | bfloat16 (default: the model config's)")
    p.add_argument("--seed", type=int, default=0, help="base seed for rows without their own (default 0)")
    p.add_argument("--debug", action="store_true", help="show tracebacks of configuration errors")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kv_store = args.kv_store or None
    if kv_store and kv_store.startswith("$("):
        raise ConfigError(f"--kv-store {kv_store!r} is an unexpanded variable: set it in the ardit-endpoints "
                          "ConfigMap")
    device = resolve_device(args.device)
    return {"model": args.model, "weights": args.weights, "dummy_weights": args.dummy_weights,
            "tensor_parallel_size": args.tensor_parallel_size, "quantization": args.quantization,
            **({"pipeline_parallel_size": args.pipeline_parallel_size} if args.pipeline_parallel_size != 1 else {}),
            "kv_store": kv_store, "device": device, "dtype": args.dtype, "seed": args.seed}


def _committed_so_far() -> str:
    """What the interrupted step leaves committed, in words (its shard's rows recorded so far)."""
    from components.runtime import dispatch

    step = dispatch.running_step
    if not step or "output" not in step or "run_id" not in step or "shard" not in step:
        return "committed rows are kept"
    try:
        from components.data.runs import RunLayout

        layout, shard = RunLayout.open(step["output"], step["run_id"]), int(step["shard"])
        if layout.is_committed(shard):
            return f"shard {shard} of run {step['run_id']} is committed"
        total, done = len(layout.read_inputs(shard)), len(layout.completed_rows(shard))
    except Exception:  # noqa: BLE001 - the stop is said without the count
        return "committed rows are kept"
    return f"shard {shard} of run {step['run_id']} is not committed; {done} of its {total} row(s) are recorded and kept"


def step_main(prog: str, body: Callable[[], int], debug: bool = False) -> int:
    """Run a step program's body: a ConfigError (or a missing extra) is one line and exit code 2;
    Ctrl-C is exit code 130, SIGTERM 143 (the rank processes stopped, what is committed said);
    anything else propagates (a traceback in the pod log, exit 1, and the orchestrator retries). Its
    stacks print on SIGUSR1 / ARDIT_STACK_DUMP_S, as the CLI's do."""
    from components.runtime.ranks import Terminated, program_setup

    try:
        with program_setup():  # SIGTERM raises Terminated while the body runs
            return body()
    except (ConfigError, ImportError) as exc:
        code = None if debug else config_error_exit(prog, exc)
        if code is None:
            raise
        return code
    except KeyboardInterrupt as stop:
        how, code = ("terminated (SIGTERM)", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        print(f"{prog}: {how}: {_committed_so_far()}; run the same command again to resume", file=sys.stderr)
        return code
    except Exception as exc:
        from components.runtime.ranks import RankFailed

        if not isinstance(exc, RankFailed) or debug:
            raise
        print(f"{prog}: error: {exc}; nothing of this shard was committed, run the same command again to "
              "resume", file=sys.stderr)
        return 1
