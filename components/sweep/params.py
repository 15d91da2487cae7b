"""The job parameters a sweep spec may set (`base`, `grid`, `configs[].params`, `overrides[].match`),
with their checks and how a grid value names a config. docs/sweeps.md documents each of them.

A parameter left out (or null) is not passed to the job: the job then takes it from the model's
generation config (steps, guidance, flow_shift, bot_task, system_prompt, sampling, max_new_tokens)
or from its own default (everything else), exactly as `ardit edit` does without the option.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
QUANTIZATIONS = ("none", "fp8")
BOT_TASKS = ("image", "recaption", "think", "think_recaption", "auto")
KINDS = ("edit", "generate")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Param:
    check: Callable[[Any], str | None]  # an error text for a bad value, None when fine
    grid: bool = False  # may be a grid axis
    short: Callable[[Any], str] | None = None  # how a grid value names a config


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_min(lo: int) -> Callable[[Any], str | None]:
    return lambda v: None if _is_int(v) and v >= lo else f"an integer >= {lo}"


def _num_check(ok: Callable[[float], bool], text: str) -> Callable[[Any], str | None]:
    return lambda v: None if _is_num(v) and ok(float(v)) else text


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"one of {list(choices)}"


def _text(v: Any) -> str | None:
    return None if isinstance(v, str) and v else "a non-empty string"


def _boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _device(v: Any) -> str | None:
    return None if v in DEVICES or (isinstance(v, str) and re.fullmatch(r"cuda:\d+", v)) else "auto, cpu, cuda or cuda:N"


def _prefixed(prefix: str) -> Callable[[Any], str]:
    return lambda v: f"{prefix}{v:g}" if isinstance(v, float) else f"{prefix}{v}"


_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

PARAMS: dict[str, Param] = {
    "dataset": Param(lambda v: None),  # checked by spec._check_dataset (URI or sample mapping)
    "kind": Param(_one_of(KINDS)),
    "model": Param(_text),
    "weights": Param(_text),
    "num_shards": Param(_int_min(1)),
    "kv_store": Param(_text),
    "device": Param(_device),
    "batch_size": Param(_int_min(1)),
    "save_latents": Param(_boolean),
    "kv_reuse": Param(_boolean, grid=True, short=lambda v: "reuse" if v else "recompute"),
    "steps": Param(_int_min(1), grid=True, short=_prefixed("s")),
    "guidance": Param(_num_check(lambda x: x >= 0, "a number >= 0"), grid=True, short=_prefixed("g")),
    "flow_shift": Param(_num_check(lambda x: x > 0, "a number > 0"), grid=True, short=_prefixed("fs")),
    "dtype": Param(_one_of(DTYPES), grid=True, short=lambda v: _DTYPE_SHORT[v]),
    "quantization": Param(_one_of(QUANTIZATIONS), grid=True, short=lambda v: "noquant" if v == "none" else v),
    "tensor_parallel_size": Param(_int_min(1), grid=True, short=_prefixed("tp")),
    "seed": Param(lambda v: None if _is_int(v) else "an integer", grid=True, short=_prefixed("seed")),
    "temperature": Param(_num_check(lambda x: x >= 0, "a number >= 0 (0 = greedy)"), grid=True, short=_prefixed("t")),
    "top_k": Param(_int_min(0), grid=True, short=_prefixed("k")),
    "top_p": Param(_num_check(lambda x: 0 < x <= 1, "a number in (0, 1]"), grid=True, short=_prefixed("p")),
    "bot_task": Param(_one_of(BOT_TASKS), grid=True),
    "system_prompt": Param(_text, grid=True),
    "max_new_tokens": Param(_int_min(1), grid=True, short=_prefixed("m")),
    "step_cache": Param(_num_check(lambda x: 0 <= x < 1, "a number in [0, 1) (0 = off)"), grid=True,
                        short=lambda v: "exact" if v == 0 else f"fbc{v:g}"),
}
JOB_PARAMS: tuple[str, ...] = tuple(PARAMS)
GRID_PARAMS: tuple[str, ...] = tuple(k for k, p in PARAMS.items() if p.grid)

# Names people reach for (other tools, the model's generation_config.json) -> the spec's name.
ALIASES: dict[str, str] = {
    "precision": "dtype", "torch_dtype": "dtype", "quant": "quantization", "tp": "tensor_parallel_size",
    "tp_size": "tensor_parallel_size", "tensor_parallel": "tensor_parallel_size", "num_steps": "steps",
    "diff_infer_steps": "steps", "num_inference_steps": "steps", "cfg": "guidance", "cfg_scale": "guidance",
    "guidance_scale": "guidance", "diff_guidance_scale": "guidance", "reuse": "kv_reuse", "shards": "num_shards",
}  # fmt: skip


def suggestion(key: str, allowed: tuple[str, ...]) -> str:
    """' (did you mean 'dtype'?)' for a misspelt or foreign parameter name, else ''."""
    target = ALIASES.get(key)
    if target is None or target not in allowed:
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
        target = close[0] if close else None
    return f" (did you mean {target!r}?)" if target else ""


def check_value(where: str, key: str, value: Any) -> str | None:
    """An error line for a bad value of a known parameter (None: not set, fine), else None."""
    if value is None:
        return None
    problem = PARAMS[key].check(value)
    if problem is None:
        return None
    hint = " (FP8 is quantization: fp8, not a dtype)" if key == "dtype" and "8" in str(value) else ""
    return f"{where}: {value!r} is not valid; expected {problem}{hint}"


def name_part(key: str, value: Any) -> str:
    """The part of a config name a grid value contributes: reuse, s8, g2.5, bf16, fp8, tp2, ..."""
    short = PARAMS[key].short if key in PARAMS else None
    if short is not None:
        return short(value)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(value))
