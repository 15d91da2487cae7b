"""One batch job's options in one object: what `ardit edit/generate`, the sweeps and the tests give
`pipeline.local.run_job`, and what `components.preflight.check_job` checks.

Plain values only (str, int, float, bool, None), so `to_dict()` is JSON and `from_dict()` reads it
back: a container or step program can take the same object later. The values are checked once, by
check_job, before any work; this module only refuses names it does not know.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from components.errors import ConfigError
from components.generation import GENERATION_FIELDS  # the generation settings' names (keys)


@dataclass(frozen=True)
class JobConfig:
    """Everything one batch job runs with (the callbacks `progress` and `on_start` are run_job's own)."""

    # data and output
    dataset: str
    output: str
    run_id: str
    kind: str = "edit"  # edit | generate
    num_shards: int | str = 1  # a number or "auto"
    seed: int = 0  # rows without their own `seed` column
    # model and parallelism
    model: str = "tiny"
    weights: str | None = None
    dummy_weights: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int | None = None  # None: as many model copies as the visible GPUs hold (1 on the CPU)
    quantization: str | None = None  # fp8; None or "none": no quantization
    dtype: str | None = None  # None: the model config's
    device: str = "auto"
    # generation (GENERATION_FIELDS; None: the model's generation config)
    steps: int | None = None
    guidance: float | None = None
    flow_shift: float | None = None
    bot_task: str | None = None
    system_prompt: str | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False
    step_cache: float = 0.0
    # AR scheduling
    batch_size: int | str = "auto"  # a number or "auto"
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None
    batch_invariant: bool = False
    # AR and DiT of a shard at once on one model copy: auto (on a GPU, one rank a copy) | on | off
    overlap: str = "auto"
    # storage and outputs
    kv_store: str | None = None  # None: kept in the memory of the model copy's process (memory://RUN)
    kv_reuse: bool = True
    save_latents: bool = False
    ar_from_run: str | None = None  # take the AR outputs of this run of the same output root

    @property
    def generation(self) -> dict[str, Any]:
        """The generation settings as given (None: from the model's generation config)."""
        return {name: getattr(self, name) for name in GENERATION_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """Every field by name: plain JSON values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """The config of `data` (to_dict's form; fields left out take their defaults). A name that is
        not a field, or a required field left out, is a ConfigError naming it."""
        check_names(data)
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise ConfigError(f"job config: {', '.join(missing)} missing; every job needs "
                              f"{', '.join(REQUIRED_FIELDS)}")
        return cls(**data)

    def replace(self, **changes: Any) -> JobConfig:
        """A copy with `changes` (field names, as from_dict takes them)."""
        check_names(changes)
        return dataclasses.replace(self, **changes)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobConfig))
REQUIRED_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobConfig)
                                         if f.default is dataclasses.MISSING)


def check_names(data: dict[str, Any]) -> None:
    """Refuse a name that is not a JobConfig field, in one line naming it (and the closest field)."""
    for key in data:
        if key not in FIELDS:
            close = difflib.get_close_matches(str(key), FIELDS, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"job config: unknown option {key!r}{hint}; known: {', '.join(FIELDS)}")
