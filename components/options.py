"""Checks of a job's options, before any work: each bad value is one ConfigError line that names
the option, the value and the rule (`--steps 0: must be a whole number >= 1 ...`)."""

from __future__ import annotations

import math
import os
from typing import Any

from components.devices import check_device_name
from components.errors import ConfigError

KINDS = ("edit", "generate")
BOT_TASKS = ("image", "recaption", "think", "think_recaption", "auto")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8",)
NO_QUANTIZATION = ("", "none")  # how a sweep spec, a command line or an orchestrator says "no quantization"


def bad_option(option: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{option} {value!r}: {rule}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_generation_options(*, steps=None, guidance=None, flow_shift=None, bot_task=None, system_prompt=None,
                             max_new_tokens=None, temperature=None, top_k=None, top_p=None) -> None:
    """Run-wide generation options; None means "from the generation config" and is not checked."""
    if steps is not None and not (_is_int(steps) and steps >= 1):
        raise bad_option("--steps", steps, "must be a whole number >= 1 (denoising steps)")
    if guidance is not None and not (isinstance(guidance, (int, float)) and math.isfinite(guidance)
                                     and guidance >= 0):
        raise bad_option("--guidance", guidance, "must be a number >= 0 (CFG scale; values <= 1 turn CFG off)")
    if flow_shift is not None and not (isinstance(flow_shift, (int, float)) and math.isfinite(flow_shift)
                                       and flow_shift > 0):
        raise bad_option("--flow-shift", flow_shift, "must be a number > 0")
    if bot_task is not None and bot_task not in BOT_TASKS:
        raise bad_option("--bot-task", bot_task, f"must be one of {', '.join(BOT_TASKS)}")
    if system_prompt is not None and not str(system_prompt).strip():
        raise bad_option("--system-prompt", system_prompt, "must be a preset name (en_unified, none, ...) or the text")
    if max_new_tokens is not None and not (_is_int(max_new_tokens) and max_new_tokens >= 1):
        raise bad_option("--max-new-tokens", max_new_tokens, "must be a whole number >= 1")
    if temperature is not None and not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                                        and temperature >= 0):
        raise bad_option("--temperature", temperature, "must be a number >= 0 (0 = greedy)")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise bad_option("--top-k", top_k, "must be a whole number >= 0 (0 = off)")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise bad_option("--top-p", top_p, "must be a number in (0, 1]")


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
        raise bad_option("--dtype", dtype, f"must be one of {', '.join(DTYPES)} (default: the model config's)")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise bad_option("--quantization", quantization,
                         f"must be none or {' or '.join(QUANTIZATIONS)} (default: none)")
    if not (_is_int(tensor_parallel_size) and tensor_parallel_size >= 1):
        raise bad_option("--tensor-parallel-size", tensor_parallel_size, "must be a whole number >= 1")
    if not (_is_int(pipeline_parallel_size) and pipeline_parallel_size >= 1):
        raise bad_option("--pipeline-parallel-size", pipeline_parallel_size, "must be a whole number >= 1")
    if not (_is_int(seed) and 0 <= seed < 2**63):
        raise bad_option("--seed", seed, "must be a whole number in [0, 2**63)")
    if batch_size != "auto" and not (_is_int(batch_size) and batch_size >= 1):
        raise bad_option("--batch-size", batch_size, "must be auto (rows in flight sized to GPU memory) or a whole "
                         "number >= 1 (a hard cap on AR rows in flight)")
    if not (isinstance(gpu_memory_utilization, (int, float)) and not isinstance(gpu_memory_utilization, bool)
            and 0 < gpu_memory_utilization <= 1):
        raise bad_option("--gpu-memory-utilization", gpu_memory_utilization,
                         "must be a number in (0, 1]: the share of GPU memory the AR step may fill (default 0.9)")
    if max_num_batched_tokens is not None and not (_is_int(max_num_batched_tokens) and max_num_batched_tokens >= 1):
        raise bad_option("--max-num-batched-tokens", max_num_batched_tokens,
                         "must be a whole number >= 1 (prompt tokens prefilled per step; default 2048)")
    if not (isinstance(step_cache, (int, float)) and not isinstance(step_cache, bool)
            and math.isfinite(step_cache) and 0 <= step_cache < 1):
        raise bad_option("--step-cache", step_cache, "must be a number in [0, 1) (first-block change threshold; "
                         "0 = off, typical 0.05-0.15)")
    if step_cache and pipeline_parallel_size > 1:
        raise bad_option("--step-cache", step_cache, "does not combine with --pipeline-parallel-size > 1 (the step "
                         "cache runs the first layer apart); drop one of them")
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
    from components.models import resolve_model

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
