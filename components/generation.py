"""Generation settings (`steps`, `guidance`, ...) and the model's generation config.

They default to None, which means "the model's generation config" (`generation_config.json` of a
checkpoint; the tiny preset has its own). `resolve_generation` fills them in, and the resolved
values are what a run remembers, so `--steps 8` and "no --steps" on a model whose config says 8
are the same run.
"""

from __future__ import annotations

from typing import Any

from components.models import describe_model
from components.options import check_generation_options

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
