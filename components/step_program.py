"""What every step program (`python -m components.ar`, `.dit`, `.shard`, `.summary`) shares: its
argument parsing (one-line usage errors, the empty placeholders orchestrators pass, the engine
options of the AR and DiT steps and the JobConfig they make: `step_config`) and its main
(`step_main`: exit code 2 for a configuration error, 130 for Ctrl-C, 143 for SIGTERM, what is
committed said)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from components.devices import resolve_device
from components.errors import ConfigError, config_error_exit
from components.jobconfig import JobConfig
from components.options import QUANTIZATIONS, check_engine_options, quantization_option


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
    """Arguments the AR and DiT step programs share. Each flag but --shard, --config and --debug
    (and a step's own switches, PROGRAM_FLAGS) sets the JobConfig field of its name (step_config)."""
    p.add_argument("--config", default=None, metavar="FILE_OR_JSON",
                   help="the whole job config at once: a JobConfig's to_dict() JSON, inline or a file; with it "
                        "give only --shard (and --debug or the step's own switches), not the config flags")
    # --output and --run-id are required without --config (step_config says so, as argparse would)
    p.add_argument("--output", "-o", default=None, help="output root: a directory or s3://bucket/prefix")
    p.add_argument("--run-id", default=None, help="the run (the shard step created it)")
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


# Flags of the AR and DiT step programs that are no JobConfig field: the shard to run, --config
# itself, and switches of the program (they change how it runs, never what it computes).
PROGRAM_FLAGS = ("shard", "config", "debug", "no_prefetch", "cfg_parallel")


def step_config(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> JobConfig:
    """The step's JobConfig: `--config`'s, or the flags' (each named after its field; the DiT's
    --no-kv-reuse is kv_reuse off). --config with a config flag beside it is refused (one line),
    rather than one of them silently overriding the other. Checked and resolved here, before any
    work: the engine options, the device ("auto": cuda if there is one) and "none" quantization.
    The flags give no dataset: a step reads its shard's inputs from the run (the shard step's)."""
    flags = {k: v for k, v in vars(args).items() if k not in PROGRAM_FLAGS}
    if args.config is not None:
        given = sorted(given_flags(p, argv) & flags.keys())
        if given:
            raise ConfigError(f"--config takes the whole job config: drop {', '.join(_flag(k) for k in given)} "
                              "(or put it in the config)")
        config = load_config(args.config)
    else:
        missing = [_flag(k) for k in ("output", "run_id") if flags[k] is None]
        if missing:
            raise ConfigError(f"the following arguments are required: {', '.join(missing)} (or --config "
                              "FILE_OR_JSON)")
        if "no_kv_reuse" in flags:
            flags["kv_reuse"] = not flags.pop("no_kv_reuse")
        config = JobConfig.from_dict({"dataset": "", **flags})
    kv_store = config.kv_store or None
    if kv_store and kv_store.startswith("$("):
        raise ConfigError(f"--kv-store {kv_store!r} is an unexpanded variable: set it in the ardit-endpoints "
                          "ConfigMap")
    config = config.replace(kv_store=kv_store, quantization=quantization_option(config.quantization),
                            step_cache=config.step_cache or 0.0)
    check_engine_options(dtype=config.dtype, quantization=config.quantization,
                         tensor_parallel_size=config.tensor_parallel_size, seed=config.seed,
                         batch_size=config.batch_size, device=config.device, step_cache=config.step_cache,
                         pipeline_parallel_size=config.pipeline_parallel_size,
                         gpu_memory_utilization=config.gpu_memory_utilization,
                         max_num_batched_tokens=config.max_num_batched_tokens)
    return config.replace(device=resolve_device(config.device))


def load_config(text: str) -> JobConfig:
    """--config: a JobConfig's to_dict() JSON, given inline ({...}) or as the path of a file of it.
    Its dataset may be left out (a step does not read it)."""
    import json
    from pathlib import Path

    inline = text.lstrip()[:1] in ("{", "[")  # JSON, not a path (a JSON array is refused below)
    try:
        data = json.loads(text if inline else Path(text).expanduser().read_text())
    except OSError as exc:
        raise ConfigError(f"--config {text}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError("--config: must be a JSON object of JobConfig fields (a JobConfig's to_dict())")
    return JobConfig.from_dict({"dataset": "", **data})


_UNSET = object()


def given_flags(p: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the flags `argv` gives, whatever their values (a flag given its default
    counts): argparse leaves a destination the namespace already has alone unless the flag is given."""
    dests = vars(p.parse_args(argv))
    seen = p.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, _UNSET)))
    return {k for k, v in vars(seen).items() if v is not _UNSET}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _committed_so_far() -> str:
    """What the interrupted step leaves committed, in words (its shard's rows recorded so far)."""
    from components.runtime import dispatch

    step = dispatch.running_step
    if not step or "config" not in step or "shard" not in step:
        return "committed rows are kept"
    run_id = step["config"].run_id
    try:
        from components.data.runs import RunLayout

        layout, shard = RunLayout.open(step["config"].output, run_id), int(step["shard"])
        if layout.is_committed(shard):
            return f"shard {shard} of run {run_id} is committed"
        total, done = len(layout.read_inputs(shard)), len(layout.completed_rows(shard))
    except Exception:  # noqa: BLE001 - the stop is said without the count
        return "committed rows are kept"
    return f"shard {shard} of run {run_id} is not committed; {done} of its {total} row(s) are recorded and kept"


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
