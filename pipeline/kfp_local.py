"""The batch_edit pipeline on one machine through ``kfp.local`` (no cluster, no Docker).

kfp.local cannot run container components without Docker, so these are lightweight Python
components that run the same step programs (same argv, from pipeline.cluster.step_args) in a
subprocess. kfp.local limits that shape this file (see the platform notes):
  * no nested ParallelFor (one loop over shards is all we need);
  * ``dsl.Collected`` ints arrive as floats (nothing is collected here; shard ints are re-cast);
  * retries, caching and kfp.kubernetes settings are ignored;
  * each task runs ``pip install kfp==<version> --no-deps`` first, which is a no-op needing no
    network when kfp is already installed in this interpreter's environment.
"""

# no `from __future__ import annotations`: kfp reads the component signatures as real types

import contextlib
import functools
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional


def _build() -> tuple[Callable, Callable]:
    """The local batch_edit pipeline (shard -> ParallelFor(AR -> DiT)) and the summary component.

    kfp.local runs a DAG's plain tasks first and its loops last, so a summary task .after() the loop
    is rejected there (KeyError 'for-loop-1'), and dsl.If conditions evaluate as False. The summary
    therefore runs as its own kfp.local task once the pipeline has returned. Built lazily so that
    importing this module does not import kfp.
    """
    from kfp import dsl

    # base_image is unused by the subprocess runner; set so kfp does not warn about its default.
    component = functools.partial(dsl.component, base_image="python:3.11")

    # Bodies are shipped to a subprocess as source: imports go inside them.
    @component
    def shard_step(dataset: str, output: str, run_id: str, num_shards: int, kind: str, model: str) -> list:
        import subprocess
        import sys

        from pipeline.cluster import step_args, step_command

        args = step_args("shard", dataset=dataset, output=output, run_id=run_id, num_shards=num_shards, kind=kind,
                         model=model)
        command = [sys.executable if a == "python" else a for a in step_command("shard")]
        subprocess.run([*command, *map(str, args)], check=True)
        return list(range(num_shards))

    @component
    def ar_step(output: str, run_id: str, shard: int, model: str, kv_store: str, weights: str):
        import subprocess
        import sys

        from pipeline.cluster import step_args, step_command

        # empty values are dropped by the launcher: the step's defaults (tensor parallel 1, no quantization)
        args = step_args("ar", output=output, run_id=run_id, shard=int(shard), model=model, kv_store=kv_store,
                         tensor_parallel_size="", quantization="", bot_task="")
        args += ["--weights", weights] if weights else []
        command = [sys.executable if a == "python" else a for a in step_command("ar")]
        subprocess.run([*command, *map(str, args)], check=True)

    @component
    def dit_step(output: str, run_id: str, shard: int, model: str, kv_store: str, weights: str, steps: int,
                 guidance: float):
        import subprocess
        import sys

        from pipeline.cluster import step_args, step_command

        args = step_args("dit", output=output, run_id=run_id, shard=int(shard), model=model, kv_store=kv_store,
                         tensor_parallel_size="", quantization="", steps=steps, guidance=guidance)
        args += ["--weights", weights] if weights else []
        command = [sys.executable if a == "python" else a for a in step_command("dit")]
        subprocess.run([*command, *map(str, args)], check=True)

    @component
    def summary_step(output: str, run_id: str):
        import subprocess
        import sys

        from pipeline.cluster import step_args, step_command

        args = step_args("summary", output=output, run_id=run_id)
        command = [sys.executable if a == "python" else a for a in step_command("summary")]
        subprocess.run([*command, *args], check=True)

    @dsl.pipeline(name="ardit-batch-edit-local")
    def batch_edit_local(dataset: str, output: str, run_id: str, num_shards: int, model: str, kv_store: str,
                         weights: str, steps: int, guidance: float):
        shards = shard_step(dataset=dataset, output=output, run_id=run_id, num_shards=num_shards, kind="edit",
                            model=model)
        with dsl.ParallelFor(shards.output) as k:
            ar = ar_step(output=output, run_id=run_id, shard=k, model=model, kv_store=kv_store, weights=weights)
            dit_step(output=output, run_id=run_id, shard=k, model=model, kv_store=kv_store, weights=weights,
                     steps=steps, guidance=guidance).after(ar)

    return batch_edit_local, summary_step


class _TaskLog(io.TextIOBase):
    """kfp.local prints every task's output and colored status lines to stdout: keep all of it
    in a log file, and show only one plain line per finished task on stderr."""

    _ANSI = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, path: Path, echo: Any):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")
        self.echo = echo  # the real stdout (this object stands in for it while kfp runs)

    def write(self, text: str) -> int:
        self.file.write(text)
        for line in self._ANSI.sub("", text).splitlines():
            if "Task " in line and " finished with status " in line:  # "HH:MM:SS.mmm - INFO - Task ..."
                print("run-local: " + line.split(" - ", 2)[-1].strip(), file=self.echo, flush=True)
        return len(text)

    def flush(self) -> None:
        self.file.flush()

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def run_local(output: str, dataset: str | None = None, run_id: str | None = None, num_shards: int = 2,
              model: str = "tiny", kv_store: str | None = None, weights: str | None = None,
              steps: Optional[int] = None, guidance: Optional[float] = None, sample_rows: int = 4) -> dict[str, Any]:
    """Run batch_edit through kfp.local; without ``dataset`` a small sample edit dataset is written first.

    Returns ``{"run_id", "output", "dataset", "summary"}`` (summary: the run's summary.json).
    """
    from kfp import local

    from components.generation import generation_defaults

    defaults = generation_defaults(model)  # None: the model's generation config, as `ardit edit`
    steps = defaults["steps"] if steps is None else steps
    guidance = defaults["guidance"] if guidance is None else guidance
    out = Path(output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if dataset is None:
        from components.data.sample import write_sample_edit_dataset

        dataset = write_sample_edit_dataset(str(out / "sample-edit.parquet"), n=sample_rows, size=64)
    run_id = run_id or time.strftime("local-%Y%m%d-%H%M%S", time.gmtime())
    kv_store = kv_store or f"local://{out / '_kv'}"
    # kfp.local swaps "python3" for this interpreter, but make sure children that look up python on
    # PATH also get it (this venv has kfp, so each task's pip install stays offline).
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # workspace_root: kfp.local would otherwise leave a /tmp/kfp-workspace-* directory per call
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(out / "_kfp_local"),
               workspace_root=str(out / "_kfp_local" / "workspace"), raise_on_error=True)
    pipeline, summary_step = _build()
    log_path = out / "_kfp_local" / f"{run_id}.log"
    print(f"run-local: task logs in {log_path}", flush=True)
    with _TaskLog(log_path, sys.stdout) as log, contextlib.redirect_stdout(log):
        pipeline(dataset=dataset, output=str(out), run_id=run_id, num_shards=num_shards, model=model,
                 kv_store=kv_store, weights=weights or "", steps=steps, guidance=guidance)
        summary_step(output=str(out), run_id=run_id)
    summary = json.loads((out / run_id / "summary.json").read_text())
    return {"run_id": run_id, "output": str(out), "dataset": dataset, "summary": summary}
