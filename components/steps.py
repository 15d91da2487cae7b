"""What the AR and DiT steps share: engine loading, generation settings, option checks, the
default KV store, and the argparse / error handling of the step programs.

Generation settings (`steps`, `guidance`, ...) default to None, which means "the model's
generation config" (`generation_config.json` of a checkpoint; the tiny preset has its own).
`resolve_generation` fills them in, and the resolved values are what a run remembers, so
`--steps 8` and "no --steps" on a model whose config says 8 are the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from components.errors import ConfigError, config_error_exit, missing_extra

# A prompt longer than this many tokens is an error row (the model's context must also hold the
# conditioning images, the CoT and the generated image).
MAX_PROMPT_TOKENS = {"tiny": 256, "hunyuan-image-3": 2048}

KINDS = ("edit", "generate")
BOT_TASKS = ("image", "recaption", "think", "think_recaption", "auto")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8",)
NO_QUANTIZATION = ("", "none")  # how a sweep spec, a command line or an orchestrator says "no quantization"
DEVICES = ("auto", "cpu", "cuda")

# CLI name -> GenerationConfig field (official generation_config.json keys)
GENERATION_FIELDS = {
    "steps": "diff_infer_steps",
    "guidance": "diff_guidance_scale",
    "flow_shift": "flow_shift",
    "bot_task": "bot_task",
    "system_prompt": "use_system_prompt",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
}
AR_SETTINGS = ("bot_task", "system_prompt", "max_new_tokens", "temperature", "top_k", "top_p")
DIT_SETTINGS = ("steps", "guidance", "flow_shift")

# ------------------------------------------------------------------------------ model and engine


@dataclass(frozen=True)
class ModelRef:
    """A model the engine can load: a preset (`path` None) or a checkpoint directory."""

    kind: str  # "preset" | "dir"
    name: str
    path: Path | None = None


def resolve_model(model: str) -> ModelRef:
    """Preset, checkpoint directory or Hugging Face repo id (local cache) -> ModelRef; ConfigError
    (one line saying how to fix it) otherwise."""
    from components.engine import resolve as engine_resolve

    try:
        r = engine_resolve.resolve_model(model)
    except engine_resolve.ModelNotFound as exc:
        raise ConfigError(f"--model {model}: {exc}") from None
    return ModelRef(r.kind, r.name, Path(r.path) if r.kind == "dir" else None)


def _engine_load_kwargs(dummy_weights: bool, tensor_parallel_size: int, quantization: str | None,
                        pipeline_parallel_size: int = 1) -> dict:
    """The Engine.load keywords of CONTRACTS.md, passed only when they differ from their
    defaults (so an engine that predates them still loads the default configuration)."""
    extra: dict[str, Any] = {}
    if dummy_weights:
        extra["dummy_weights"] = True
    if tensor_parallel_size != 1:
        extra["tensor_parallel_size"] = tensor_parallel_size
    if pipeline_parallel_size != 1:
        extra["pipeline_parallel_size"] = pipeline_parallel_size
    if quantization:
        extra["quantization"] = quantization
    return extra


def load_engine(model: str, weights: str | None, device: str, dtype: str | None, seed: int = 0,
                dummy_weights: bool = False, tensor_parallel_size: int = 1, quantization: str | None = None,
                parallel: Any = None, pipeline_parallel_size: int = 1):
    """One engine per process, whatever number of shards it serves. `parallel`: this rank's
    ParallelContext when the step runs on tensor- / pipeline-parallel ranks (components.ranks passes it)."""
    if parallel is not None:  # a rank of a RankPool: it keeps its engine for the job's next steps
        key = (model, weights, device, dtype, seed, dummy_weights, tensor_parallel_size, quantization, id(parallel),
               pipeline_parallel_size)
        if key not in _rank_engines:
            from components.engine import Engine

            if parallel.is_first:
                announce_load(model, weights, dummy_weights, quantization, tensor_parallel_size, device,
                              pipeline_parallel_size)
            _rank_engines.clear()  # one engine per rank process: a new model replaces the old one
            _rank_engines[key] = Engine.load(model, weights=weights, device=device, dtype=dtype, seed=seed,
                                             parallel=parallel,
                                             **_engine_load_kwargs(dummy_weights, tensor_parallel_size, quantization,
                                                                   pipeline_parallel_size))
        return _rank_engines[key]
    return _cached_engine(model, weights, device, dtype, seed, dummy_weights, tensor_parallel_size, quantization)


_rank_engines: dict[tuple, Any] = {}


@lru_cache(maxsize=2)
def _cached_engine(model: str, weights: str | None, device: str, dtype: str | None, seed: int,
                   dummy_weights: bool, tensor_parallel_size: int, quantization: str | None):
    from components.engine import Engine

    announce_load(model, weights, dummy_weights, quantization, tensor_parallel_size, device)
    return Engine.load(model, weights=weights, device=device, dtype=dtype, seed=seed,
                       **_engine_load_kwargs(dummy_weights, tensor_parallel_size, quantization))


def announce_load(model: str, weights: str | None, dummy_weights: bool, quantization: str | None,
                  tensor_parallel_size: int = 1, device: str = "cuda", pipeline_parallel_size: int = 1) -> None:
    """One line before the engine loads (a real checkpoint takes minutes): which model, how big,
    from where."""
    what = describe_load(model, weights, dummy_weights, quantization, tensor_parallel_size, device,
                         pipeline_parallel_size)
    print(f"loading model {what} …", file=sys.stderr, flush=True)


def describe_load(model: str, weights: str | None, dummy_weights: bool, quantization: str | None = None,
                  tensor_parallel_size: int = 1, device: str = "cuda", pipeline_parallel_size: int = 1) -> str:
    """'NAME (SIZE, from WHERE)': the checkpoint's safetensors bytes and directory, or the preset
    and its seeded random weights."""
    ref = resolve_model(model)
    ranks = tensor_parallel_size * pipeline_parallel_size  # a model copy's ranks: GPUs, or CPU processes
    extras = ([f"quantized to {quantization} at load"] if quantization else []) + \
        ([f"{ranks} {'GPUs' if device.startswith('cuda') else 'CPU processes'}"] if ranks > 1 else [])
    directory = Path(weights).expanduser() if weights else ref.path
    if directory is None or dummy_weights:
        config = f", config from {ref.path}" if ref.path is not None else ""
        size = "tiny test size" if ref.name == "tiny" else "80B full size"
        return f"{ref.name} ({', '.join([size, *extras])}, from seeded random weights{config}: nothing read)"
    from components.engine.weights import checkpoint_files

    files = checkpoint_files(directory)
    size = f"{sum(f.stat().st_size for f in files) / 1e9:.1f} GB in {len(files)} safetensors file(s)"
    return f"{ref.name} ({', '.join([size, *extras])}, from {directory})"


def describe_model(model: str) -> tuple[ModelRef, Any, Any, Any]:
    """(ref, config, tokenizer, generation config or None) of a model, without its weights;
    ConfigError when it cannot be described (no tokenizer files, unreadable config, ...)."""
    ref = resolve_model(model)
    try:
        from components.engine.engine import describe
        from components.engine.resolve import ResolvedModel

        config, tokenizer, generation_config, _ = describe(ResolvedModel(ref.kind, ref.path, ref.name))
        return ref, config, tokenizer, generation_config
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--model {model}: cannot load its config/tokenizer/generation config ({first}); pass "
                          "a checkpoint directory with config.json, generation_config.json and the tokenizer "
                          "files") from None


def model_validators(model: str) -> tuple[Callable[[str], int], Callable[[int, int], bool], int]:
    """(count_tokens, is_supported_size, max_prompt_tokens) for a model, without loading weights."""
    from components.data.datasets import SizeRule
    from components.engine.sequence import ResolutionGroup

    ref, config, tokenizer, _ = describe_model(model)
    max_tokens = MAX_PROMPT_TOKENS.get(ref.name, MAX_PROMPT_TOKENS["hunyuan-image-3"]) if ref.kind == "preset" \
        else MAX_PROMPT_TOKENS["hunyuan-image-3"]
    buckets = ResolutionGroup(config.image_base_size)
    sizes = SizeRule(lambda w, h: buckets.index_of(w, h) is not None,
                     ", ".join(f"{r.width}x{r.height}" for r in buckets.data))
    return (lambda text: len(tokenizer.encode(text)), sizes, max_tokens)


# ----------------------------------------------------------------------------- generation config


def generation_defaults(model: str) -> dict[str, Any]:
    """The model's generation config, under the CLI's names (steps, guidance, ...)."""
    _, _, _, gc = describe_model(model)
    values = {cli: getattr(gc, field) for cli, field in GENERATION_FIELDS.items()}
    if getattr(gc, "do_sample", True) is False:
        values["temperature"] = 0.0
    return values


def resolve_generation(model: str, greedy: bool = False, **given: Any) -> dict[str, Any]:
    """Generation settings with None filled from the model's generation config; checked."""
    unknown = set(given) - set(GENERATION_FIELDS)
    if unknown:
        raise TypeError(f"unknown generation settings {sorted(unknown)}")
    check_generation_options(**given)
    values = generation_defaults(model)
    values.update({k: v for k, v in given.items() if v is not None})
    if greedy:
        values["temperature"] = 0.0
    if values.get("system_prompt") is None:
        values["system_prompt"] = "none"
    check_generation_options(**values)  # a checkpoint's own config can be wrong too
    return values


# ---------------------------------------------------------------------------------- option checks


def _bad(option: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{option} {value!r}: {rule}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_generation_options(*, steps=None, guidance=None, flow_shift=None, bot_task=None, system_prompt=None,
                             max_new_tokens=None, temperature=None, top_k=None, top_p=None) -> None:
    """Run-wide generation options; None means "from the generation config" and is not checked."""
    if steps is not None and not (_is_int(steps) and steps >= 1):
        raise _bad("--steps", steps, "must be a whole number >= 1 (denoising steps)")
    if guidance is not None and not (isinstance(guidance, (int, float)) and math.isfinite(guidance)
                                     and guidance >= 0):
        raise _bad("--guidance", guidance, "must be a number >= 0 (CFG scale; values <= 1 turn CFG off)")
    if flow_shift is not None and not (isinstance(flow_shift, (int, float)) and math.isfinite(flow_shift)
                                       and flow_shift > 0):
        raise _bad("--flow-shift", flow_shift, "must be a number > 0")
    if bot_task is not None and bot_task not in BOT_TASKS:
        raise _bad("--bot-task", bot_task, f"must be one of {', '.join(BOT_TASKS)}")
    if system_prompt is not None and not str(system_prompt).strip():
        raise _bad("--system-prompt", system_prompt, "must be a preset name (en_unified, none, ...) or the text")
    if max_new_tokens is not None and not (_is_int(max_new_tokens) and max_new_tokens >= 1):
        raise _bad("--max-new-tokens", max_new_tokens, "must be a whole number >= 1")
    if temperature is not None and not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                                        and temperature >= 0):
        raise _bad("--temperature", temperature, "must be a number >= 0 (0 = greedy)")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise _bad("--top-k", top_k, "must be a whole number >= 0 (0 = off)")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise _bad("--top-p", top_p, "must be a number in (0, 1]")


def auto_or_int(text: str | int) -> int | str:
    """An option that takes "auto" or a whole number (--batch-size, --num-shards), as the step
    programs and the CLI take it; anything else comes back as given, for the checks to name
    (check_engine_options, check_job)."""
    text = str(text).strip()
    if text.lower() in ("", "auto", "none", "null"):  # orchestrators pass empty placeholders
        return "auto"
    return int(text) if text.lstrip("-").isdigit() else text


def quantization_option(value: str | None) -> str | None:
    """The quantization a job runs with: None for "none" (or ""), else the value as given (checked
    by check_engine_options). The one place where "none" is read, so every entry (`ardit edit
    --quantization none`, a sweep's `quantization: none`, a step program) means the same run."""
    return None if value is None or value.strip().lower() in NO_QUANTIZATION else value


def check_engine_options(*, dtype=None, quantization=None, tensor_parallel_size=1, seed=0,
                         batch_size=1, device="auto", step_cache=0.0, pipeline_parallel_size=1,
                         gpu_memory_utilization=0.9, max_num_batched_tokens=None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise _bad("--dtype", dtype, f"must be one of {', '.join(DTYPES)} (default: the model config's)")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise _bad("--quantization", quantization, f"must be none or {' or '.join(QUANTIZATIONS)} (default: none)")
    if not (_is_int(tensor_parallel_size) and tensor_parallel_size >= 1):
        raise _bad("--tensor-parallel-size", tensor_parallel_size, "must be a whole number >= 1")
    if not (_is_int(pipeline_parallel_size) and pipeline_parallel_size >= 1):
        raise _bad("--pipeline-parallel-size", pipeline_parallel_size, "must be a whole number >= 1")
    if not (_is_int(seed) and 0 <= seed < 2**63):
        raise _bad("--seed", seed, "must be a whole number in [0, 2**63)")
    if batch_size != "auto" and not (_is_int(batch_size) and batch_size >= 1):
        raise _bad("--batch-size", batch_size, "must be auto (rows in flight sized to GPU memory) or a whole "
                   "number >= 1 (a hard cap on AR rows in flight)")
    if not (isinstance(gpu_memory_utilization, (int, float)) and not isinstance(gpu_memory_utilization, bool)
            and 0 < gpu_memory_utilization <= 1):
        raise _bad("--gpu-memory-utilization", gpu_memory_utilization,
                   "must be a number in (0, 1]: the share of GPU memory the AR step may fill (default 0.9)")
    if max_num_batched_tokens is not None and not (_is_int(max_num_batched_tokens) and max_num_batched_tokens >= 1):
        raise _bad("--max-num-batched-tokens", max_num_batched_tokens,
                   "must be a whole number >= 1 (prompt tokens prefilled per step; default 2048)")
    if not (isinstance(step_cache, (int, float)) and not isinstance(step_cache, bool)
            and math.isfinite(step_cache) and 0 <= step_cache < 1):
        raise _bad("--step-cache", step_cache, "must be a number in [0, 1) (first-block change threshold; 0 = off, "
                   "typical 0.05-0.15)")
    if step_cache and pipeline_parallel_size > 1:
        raise _bad("--step-cache", step_cache, "does not combine with --pipeline-parallel-size > 1 (the step cache "
                   "runs the first layer apart); drop one of them")
    check_device_name(device)
    check_kernel_settings()


def check_bench_cot(model: str, weights: str | None, dummy_weights: bool) -> Any:
    """ARDIT_BENCH_COT_TOKENS (benchmarks): the parsed ForcedCot, or None when unset. Only with
    dummy weights (a preset without --weights is random too): real weights must write their
    own CoT."""
    spec = os.environ.get("ARDIT_BENCH_COT_TOKENS")
    if not spec:
        return None
    from components.engine.ar import ForcedCot

    if not (dummy_weights or (weights is None and resolve_model(model).kind == "preset")):  # presets: random
        raise ConfigError(f"ARDIT_BENCH_COT_TOKENS={spec!r}: forces CoT lengths for benchmarks on dummy weights "
                          "only; unset it, or pass --dummy-weights")
    try:
        return ForcedCot(spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_kernel_settings() -> None:
    """The ARDIT_KERNELS environment variable, parsed before any work (the engine reads it later)."""
    spec = os.environ.get("ARDIT_KERNELS")
    if not spec:
        return
    from components.engine import kernels

    try:
        kernels.parse(spec)
    except ValueError as exc:
        raise ConfigError(f"environment variable ARDIT_KERNELS={spec!r}: {exc} (or unset it: the defaults "
                          "are right for most runs)") from None


def check_device_name(device: str) -> None:
    if device in DEVICES or (device.startswith("cuda:") and device[5:].isdigit()):
        return
    hint = " (did you mean cuda?)" if device.lower() in ("gpu", "nvidia", "cuda0") else ""
    raise _bad("--device", device, f"must be auto, cpu, cuda or cuda:N{hint}")


def check_cuda_present(device: str) -> None:
    """A cuda device asked for on a machine that shows no NVIDIA GPU: a ConfigError, found without
    importing torch or initialising CUDA (resolve_device asks torch later)."""
    check_device_name(device)
    if not device.startswith("cuda"):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")
    if hidden or not (Path("/dev/nvidiactl").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))):
        why = f"CUDA_VISIBLE_DEVICES={visible!r}" if hidden else "no NVIDIA driver device in /dev"
        raise ConfigError(f"--device {device}: no CUDA GPU is visible ({why}); use --device cpu or auto")


def resolve_device(device: str) -> str:
    """auto -> cuda if there is one, else cpu; cuda without a GPU is a ConfigError."""
    check_device_name(device)
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible to torch {torch.__version__} "
                          f"(CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible")
    return device


# ------------------------------------------------------------------------------------- KV store


def default_kv_store(output: str, run_id: str) -> str:
    """The embedded KV store: a directory beside the outputs (or in the temp dir for s3:// outputs,
    in which case AR and DiT must run on the same machine)."""
    if "://" in output and not output.startswith("file://"):
        return "local://" + os.path.join(tempfile.gettempdir(), "ardit-kv", run_id)
    root = output.removeprefix("file://")
    return "local://" + os.path.abspath(os.path.join(root, run_id, "_kv"))


def expire_other_runs_kv(output: str, run_id: str, ttl_s: float) -> int:
    """Expire the K/V older than `ttl_s` in the embedded stores of the other runs beside this one
    (`<output>/<run>/_kv`, or the temp dir's `ardit-kv/<run>` for s3:// outputs): a killed run that
    is never resumed left its payloads there, and no later run opens that directory. Empty store
    directories go too. Payloads counted; best effort (a directory that cannot be read is skipped)."""
    from components.kvstore.local import LocalStore

    root = Path(default_kv_store(output, run_id).removeprefix("local://"))
    if root.name == "_kv":  # <output>/<run>/_kv
        others = [d / "_kv" for d in _subdirs(root.parent.parent)]
    else:  # <tmp>/ardit-kv/<run>
        others = _subdirs(root.parent)
    expired = 0
    for store_dir in others:
        if store_dir == root or not store_dir.is_dir():
            continue
        try:
            expired += LocalStore(store_dir, ttl_s, min_free_bytes=0).expire(ttl_s)
            store_dir.rmdir()  # only ever removes an empty directory
        except OSError:
            pass  # not empty (payloads younger than the TTL), or not ours to touch
    return expired


def _subdirs(path: Path) -> list[Path]:
    try:
        return [d for d in path.iterdir() if d.is_dir()]
    except OSError:
        return []


def kv_key(run_id: str, shard: int, row_id: str) -> str:
    """The row's KV key: any row id works (row_key encodes ids that are not plain)."""
    from components.data.runs import row_key
    from components.kvstore.base import make_key

    return make_key(run_id, shard, row_key(row_id))


def open_kv_store(url: str):
    """open_store, with a missing optional extra or a bad URL as a ConfigError."""
    from components.kvstore.factory import open_store

    try:
        return open_store(url)
    except ImportError as exc:
        raise (missing_extra(exc, f"--kv-store {url}") or exc) from None
    except ValueError as exc:
        raise ConfigError(f"--kv-store: {exc}") from None


# ------------------------------------------------------------------------ step program plumbing


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


def run_step(target: str, kwargs: dict[str, Any], progress: Any = None, cfg_parallel: bool = False,
             pool: Any = None) -> Any:
    """Call a step's `run` (`module:function`) in this process, or, with tensor_parallel_size N and
    pipeline_parallel_size P, N * P > 1 (or a CFG-parallel DiT), on N * P rank processes: every
    rank computes, rank 0 reads and writes. `pool`: a components.ranks.RankPool that outlives this
    step (a job's shards then share the ranks' engines; a data-parallel replica is one, even of one
    rank); without one the ranks start and stop with the step. Returns rank 0's result. An AR OOM
    inside a forward of the ranks fails them with a halved budget kept in the run: the ranks (the
    pool's too) start again and run the step from it, at most MAX_OOM_RESTARTS times."""
    import importlib

    world = int(kwargs.get("tensor_parallel_size") or 1)
    stages = int(kwargs.get("pipeline_parallel_size") or 1)
    if stages > 1:
        check_pipeline_stages(kwargs.get("model", "tiny"), stages)
    if not cfg_parallel:  # CFG-parallel ranks form two groups of world / 2
        check_tensor_parallel(kwargs.get("model", "tiny"), world)
    global _running_step
    _running_step = kwargs  # what an interrupted step program says was committed (step_main)
    if pool is None and world == 1 and stages == 1 and not cfg_parallel:
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(**kwargs, progress=progress)
    from components.ranks import RankFailed, run_on_ranks

    restarts = 0
    while True:
        budget = _ar_budget(kwargs)
        try:
            if pool is not None:
                return pool.run(target, kwargs, progress)
            return run_on_ranks(target, kwargs, world, kwargs.get("device", "cpu"), cfg_parallel=cfg_parallel,
                                pipeline_parallel_size=stages)
        except ValueError as exc:  # more ranks than GPUs, an odd CFG-parallel size
            raise ConfigError(str(exc)) from None
        except RankFailed as exc:
            # an AR rank ran out of memory inside a forward (the ranks cannot retry it alone) and
            # left a smaller budget in the run: start the ranks again from it, at most a few times
            # (a job's pool too: its ranks are gone, the rows its earlier shards committed stay)
            smaller = _ar_budget(kwargs)
            if smaller is None or smaller == budget or restarts >= MAX_OOM_RESTARTS:
                raise
            restarts += 1
            print(f"{exc}; starting the ranks again with at most {smaller[0]} AR row(s) in flight "
                  f"(restart {restarts} of at most {MAX_OOM_RESTARTS})", file=sys.stderr, flush=True)
            if pool is not None:
                pool.restart()


_running_step: dict[str, Any] | None = None  # the kwargs of the step run_step started last
MAX_OOM_RESTARTS = 6  # each one halves the AR batch: 64 rows in flight come down to 1


def _ar_budget(kwargs: dict[str, Any]) -> tuple[int | None, int | None] | None:
    """The (row cap, K/V budget) the run's AR steps keep after an OOM for this layout
    (components/ar/budget.py), or None (none, or not a step of a run)."""
    if "output" not in kwargs or "run_id" not in kwargs:
        return None
    from components.ar.budget import read_budget
    from components.data.runs import RunLayout

    try:
        saved = read_budget(RunLayout.open(kwargs["output"], kwargs["run_id"]),
                            int(kwargs.get("tensor_parallel_size") or 1), int(kwargs.get("pipeline_parallel_size") or 1),
                            kwargs.get("device", "cpu"))
    except Exception:  # noqa: BLE001 - no budget to go by: the failure stands as it is
        return None
    return None if saved is None else (saved.get("max_rows"), saved.get("kv_budget_bytes"))


def check_tensor_parallel(model: str, ranks: int) -> None:
    """--tensor-parallel-size against the model's heads, experts and MLP widths (each rank gets an
    equal slice); names the sizes that would work."""
    from components.engine.parallel import tensor_parallel_problem

    if ranks <= 1:
        return
    cfg = describe_model(model)[1]
    problem = tensor_parallel_problem(cfg, ranks)
    if problem is not None:
        fits = [n for n in range(1, max(2, cfg.num_attention_heads) + 1) if tensor_parallel_problem(cfg, n) is None]
        raise _bad("--tensor-parallel-size", ranks, f"{problem}; this model splits over {', '.join(map(str, fits))}")


def check_pipeline_stages(model: str, stages: int) -> None:
    """--pipeline-parallel-size against the model's decoder layers (each stage needs one)."""
    layers = describe_model(model)[1].num_hidden_layers
    if stages > layers:
        raise _bad("--pipeline-parallel-size", stages, f"the model has {layers} decoder layers: at most {layers} "
                   "stages")


def rank_pool(tensor_parallel_size: int, device: str, pipeline_parallel_size: int = 1, *,
              device_ids: list[int] | None = None, cpu_threads: int | None = None, own_process: bool = False) -> Any:
    """A context manager: a RankPool for a job's tensor- / pipeline-parallel steps (tp x pp ranks on
    `device_ids`), or nothing at TP 1 x PP 1, where the steps run in this process, unless
    `own_process` (a data-parallel replica runs in a process of its own, even at one rank)."""
    import contextlib

    if tensor_parallel_size * pipeline_parallel_size <= 1 and not own_process:
        return contextlib.nullcontext(None)
    from components.ranks import RankPool

    try:
        return RankPool(tensor_parallel_size, device, pipeline_parallel_size=pipeline_parallel_size,
                        device_ids=device_ids, cpu_threads=cpu_threads)
    except ValueError as exc:  # more ranks than GPUs
        raise ConfigError(str(exc)) from None


class Terminated(KeyboardInterrupt):
    """SIGTERM: what a pod gets on eviction and a workflow step at its deadline. A step program
    stops as on Ctrl-C (what is committed stays, it says how to resume), with exit code 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    import multiprocessing

    # a terminal's Ctrl-C reaches the rank processes too; a SIGTERM reaches only this process, and a
    # pod's grace period would end before the ranks finish their step: stop them now
    for child in multiprocessing.active_children():
        child.terminate()
    raise Terminated()


def _committed_so_far() -> str:
    """What the interrupted step leaves committed, in words (its shard's rows recorded so far)."""
    step = _running_step
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
    import signal
    import threading

    from components.ranks import dump_stacks_on_signal, gpu_env_defaults, rank_timeout_s

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm) if on_main_thread else None
    try:
        gpu_env_defaults()  # before anything starts CUDA
        dump_stacks_on_signal()
        rank_timeout_s(0)  # a bad ARDIT_RANK_TIMEOUT_S is one line now, not a rank's error later
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
        from components.ranks import RankFailed

        if not isinstance(exc, RankFailed) or debug:
            raise
        print(f"{prog}: error: {exc}; nothing of this shard was committed, run the same command again to "
              "resume", file=sys.stderr)
        return 1
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_sigterm is None else previous_sigterm)
