"""What the AR and DiT steps do around their rows, the same way for both.

    step = begin_step("ar", ..., config, shard, ...)
                                      open the config's run, remember the step's settings (a
                                      resumed run must bring the same ones), pick the progress display
    step.skip(why)                    nothing to do (the shard is committed): say so, return
    engine = step.load_engine(config) load (or reuse) the engine, timed; start measuring GPU
                                      memory and compiles; fetch the job's compile cache
    ... the step's own work on its rows ...
    step.write_timing(**step.usage(), ...)   the step's record: load and wall time, memory, compiles
    step.persist_compiles()           what the step compiled, kept for the next process

Under tensor / pipeline parallelism every rank computes and only the owner (the first rank)
reads and writes the run; `usage()` is a collective, so every rank calls it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from components.data.runs import RunLayout
from components.jobconfig import JobConfig
from components.models import load_engine
from components.progress import LogProgress, NoProgress


@dataclass
class Step:
    """One step of one shard: its run, whether this process writes it, and its progress display.
    The engine part (`engine`, `load_s`, the memory and compile measures) is filled by `load_engine`."""

    name: str  # "ar" or "dit": the step's settings and its record under the shard
    label: str  # what the progress display calls it, e.g. "AR  shard 0"
    output: str
    shard: int
    layout: RunLayout
    owner: bool  # the rank that reads and writes (all ranks compute)
    parallel: Any
    progress: Any
    engine: Any = None
    load_s: float = 0.0
    t_step: float = 0.0  # when the step's work began (after the engine load)
    memory: Any = None
    compiling: Any = None
    compiles: Any = None

    def skip(self, why: str) -> dict[str, Any]:
        """Nothing to do for this shard (resume): said on the progress display, and the step's result."""
        self.progress.skip(self.label, why)
        return {"shard": self.shard, "skipped": why}

    def load_engine(self, config: JobConfig) -> Any:
        """The step's engine for `config`'s model fields (job_engine: this process's, when it has it
        loaded already), and the step's measures started: its load time, GPU memory and compiles from
        here on, and the job's compile cache attached (a fresh container starts warm)."""
        from components.engine import compile_cache
        from components.engine.step_memory import StepCompiles, StepMemory

        t_load = time.perf_counter()
        self.engine = job_engine(config, self.parallel)
        self.t_step = time.perf_counter()
        self.load_s = self.t_step - t_load  # 0 when this process had it loaded (a job's later steps)
        self.memory, self.compiling = StepMemory(self.engine.model.device), StepCompiles()
        self.compiles = compile_cache.attach(self.output, self.engine, log=self.owner)
        return self.engine

    def usage(self) -> dict[str, Any]:
        """The step's GPU memory and compiles; under tensor / pipeline parallelism the worst rank's
        (a collective: every rank calls it)."""
        return {"memory": self.memory.stats(self.parallel), "compile": self.compiling.stats(self.parallel)}

    def write_timing(self, **fields: Any) -> None:
        """The step's record (`shards/<k>/steps/<step>.json`): engine load and wall seconds, and
        `fields` (its `usage()` and what the step adds). Only the owner writes it."""
        if self.owner:
            self.layout.write_json(self.layout.step_timing_key(self.shard, self.name), {
                "load_s": round(self.load_s, 3), "wall_s": round(time.perf_counter() - self.t_step, 3), **fields})

    def persist_compiles(self) -> None:
        if self.compiles is not None:
            self.compiles.persist()  # what this step compiled, for the next process


def job_engine(config: JobConfig, parallel: Any = None) -> Any:
    """components.models.load_engine with the fields of `config` that choose the engine."""
    return load_engine(config.model, config.weights, config.device, config.dtype, config.seed, config.dummy_weights,
                       config.tensor_parallel_size, config.quantization, parallel, config.pipeline_parallel_size)


def begin_step(name: str, label: str, config: JobConfig, shard: int, settings: dict[str, Any],
               parallel: Any = None, progress: Any = None) -> Step:
    """Open `config`'s run and remember the step's `settings` (ConfigError when they differ from
    those the run started with). `progress`: the caller's display; by default log lines on the owner rank of a
    parallel step and nothing elsewhere."""
    owner = parallel is None or parallel.is_first
    layout = RunLayout.open(config.output, config.run_id)
    if owner:
        layout.remember_settings(name, settings)
    progress = progress or (LogProgress() if parallel is not None and owner else NoProgress())
    return Step(name, label, config.output, shard, layout, owner, parallel, progress)
