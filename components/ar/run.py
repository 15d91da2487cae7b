"""AR step: one shard's rows -> CoT, ratio token and prompt KV.

    check the options; remember the settings (a resumed run must bring the same ones)
    the pending rows through the continuous-batching scheduler (engine.ar.stream,
    engine/ar_scheduler.py): rows in flight sized to GPU memory (--batch-size auto) or capped,
    chunked prefill, CoT decode + ratio token; as each row finishes:
        kv.put(run/shard/row, prompt KV)                     in the background, while the other
                                                             rows decode (the DiT step reads it)
    ar.parquet: one row per pending input row (ok with the AR record, or error with its kind)

Error kinds: "input" (the row itself is bad: never retried) and "transient" (out of memory, a
failure that may not recur): the DiT step leaves a transient row unrecorded and fails the shard
retryably after the other rows, so a resume (or the orchestrator's retry) runs it again.

After an OOM the scheduler goes on with half the batch; that budget is kept in the run
(components/ar/budget.py), and a resume starts from it (under --tp / --pp an OOM inside a forward
still fails the step, and the retry must not run into it again).

Rows whose image is already committed by the DiT step are skipped (resume). ar.parquet is written
once, atomically, at the end; a killed AR step leaves nothing the DiT step would trust, and a
failing one deletes the payloads it already put on its way out (what it cannot delete expires).

What both steps do around their rows (settings, engine load, the step record) is in
components/step_lifecycle.py.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from components.ar.budget import apply_budget, read_budget, remember_budget
from components.data.ar_outputs import read_ar_rows, write_ar_rows
from components.data.runs import RunLayout
from components.generation import AR_SETTINGS, resolve_generation
from components.jobconfig import JobConfig
from components.kvstore.base import delete_quietly
from components.kvstore.memory import MemoryStore
from components.options import check_bench_cot, check_engine_options
from components.run_kv import default_kv_store, expire_other_runs_kv, kv_key, open_kv_store
from components.step_lifecycle import begin_step


def ar_settings(config: JobConfig, generation: dict[str, Any]) -> dict[str, Any]:
    """What the AR step computes with (a run remembers it; device and TP size are not part).
    `generation`: the resolved generation settings. batch_invariant: every row computed as its own
    batch (bitwise independent of batch and shard)."""
    return {"model": config.model, "weights": config.weights, "dummy_weights": config.dummy_weights,
            "dtype": config.dtype, "quantization": config.quantization, "seed": config.seed,
            **{k: generation[k] for k in AR_SETTINGS}, "batch_invariant": config.batch_invariant}


def run(config: JobConfig, shard: int, *, progress: Any = None, parallel: Any = None,
        handoff: Any = None) -> dict[str, Any]:
    """Run the AR step of shard `shard` of `config`'s run (a JobConfig: its model, generation and AR
    scheduling fields; `kv_reuse`: the rows' K/V is stored for the DiT step, in `kv_store`, None: the
    embedded store beside the outputs). Generation settings left None come from the model's
    generation config. Raises ConfigError (before any work) for a bad option or settings that differ
    from those the run started with. `parallel`: this rank's ParallelContext under the
    tensor-parallel launcher (components.runtime.ranks), None in one process. `batch_invariant`:
    each row runs as its own batch, so its CoT and K/V do not depend on the other rows of its batch
    or shard (Admission.batch_invariant: this step only). `batch_size`: "auto" (rows in flight
    sized to `gpu_memory_utilization` of the GPU) or a hard cap; `max_num_batched_tokens`: the
    prefill chunk (engine/ar_scheduler.py). `handoff` (an overlapped job: a
    components.runtime.handoff.Handoff): every row also goes to the shard's DiT step as soon as it
    is finished (with its K/V stored), and the scheduler admits rows only as the DiT keeps up."""
    from components.engine import SamplingParams, kernels

    check_engine_options(dtype=config.dtype, quantization=config.quantization,
                         tensor_parallel_size=config.tensor_parallel_size, seed=config.seed,
                         batch_size=config.batch_size, device=config.device,
                         pipeline_parallel_size=config.pipeline_parallel_size,
                         gpu_memory_utilization=config.gpu_memory_utilization,
                         max_num_batched_tokens=config.max_num_batched_tokens)
    forced_cot = check_bench_cot(config.model, config.weights, config.dummy_weights)
    gen = resolve_generation(config.model, greedy=config.greedy, **{k: getattr(config, k) for k in AR_SETTINGS})
    step = begin_step("ar", f"AR  shard {shard}", config, shard, ar_settings(config, gen), parallel, progress)
    pending, skipped = _pending_rows(step.layout, shard)
    if skipped:
        if handoff is not None:  # the DiT takes every row it denoises from the handoff
            kept = read_ar_rows(step.layout, shard)
            for job in pending:
                handoff.put(kept[job.id])
        return step.skip(skipped)

    engine = step.load_engine(config)
    store = (open_kv_store(config.kv_store or default_kv_store(config.output, config.run_id)) if config.kv_reuse
             else None)
    sampling = SamplingParams(temperature=gen["temperature"], top_k=gen["top_k"], top_p=gen["top_p"],
                              max_new_tokens=gen["max_new_tokens"])
    task = step.progress.add_task(step.label, len(pending))
    puts = _BackgroundPuts(store, engine)
    puts.expire_orphans(other_runs=(config.output, config.run_id) if config.kv_store is None and step.owner else None)
    fallbacks_before = kernels.fallbacks()
    results = _Results(config.run_id, shard, store, puts, step.progress, task, handoff)
    budget = _Budget(step.layout, shard, config.tensor_parallel_size, config.pipeline_parallel_size, config.device)
    try:
        requests = _requests(pending, gen, config.seed, results)
        admission = _admission(engine, config, handoff)
        from_run = budget.start(admission, parallel)  # after an OOM in an earlier step: the budget that worked
        stats = _stream(engine, requests, results, sampling, config.kv_reuse, admission, budget, step.owner, forced_cot)
        puts.wait()
        rows = results.in_order(pending)
        usage = step.usage()  # every rank: the worst's
        if step.owner:
            write_ar_rows(step.layout, shard, rows)
        step.write_timing(scheduler={k: stats[k] for k in SCHEDULER_RECORD}, **usage, budget_from_run=from_run)
    except BaseException:
        if handoff is None:
            puts.abandon()  # on the way out: payloads nobody will read are deleted now
        else:
            puts.wait()  # the rows handed over are the DiT's to read and delete (components/overlap)
        raise
    finally:
        if store is not None:
            store.close()
    step.persist_compiles()
    step.progress.finish(task)
    return {"shard": shard, "rows": len(rows), "errors": sum(r["status"] != "ok" for r in rows),
            "kv_put_wait_s": round(puts.waited_s, 4), "batch_invariant": config.batch_invariant,
            "kernel_fallbacks": kernels.fallbacks() - fallbacks_before,
            "ar_scheduler": {k: stats[k] for k in SCHEDULER_RECORD}}


def _pending_rows(layout: RunLayout, shard: int) -> tuple[list[Any], str | None]:
    """The shard's rows without a committed image, and why the step has nothing to do (resume) or None."""
    if layout.is_committed(shard):
        return [], "committed"
    pending = layout.shard_writer(shard).pending()
    settled = {i for i, r in read_ar_rows(layout, shard).items() if r.get("error_kind") != "transient"}
    if pending and {j.id for j in pending} <= settled:
        return pending, "ar.parquet covers all pending rows"
    return pending, None


def _admission(engine: Any, config: JobConfig, handoff: Any) -> Any:
    """How many rows the scheduler keeps in flight (engine/ar_scheduler.py Admission): sized to the
    GPU (`config`'s batch_size, gpu_memory_utilization, max_num_batched_tokens, batch_invariant);
    with a handoff, also leaving the DiT beside it its memory, at most its lead ahead of it and
    admitted through its gate."""
    from components.engine.ar_scheduler import Admission

    reserve = handoff.reserve_bytes if handoff is not None else 0
    admission = Admission.for_model(engine.model, config.batch_size, config.gpu_memory_utilization,
                                    config.max_num_batched_tokens, reserve_bytes=reserve)
    admission.batch_invariant = config.batch_invariant
    if handoff is not None:
        if handoff.kv_budget_bytes is not None and admission.kv_budget_bytes is not None:
            admission.kv_budget_bytes = handoff.kv_budget_bytes  # the chain's first measurement
        admission.gate = handoff.admit
        admission.at_most(handoff.lead_rows, None)
    return admission


def _requests(pending: list[Any], gen: dict[str, Any], seed: int, results: _Results) -> list[Any]:
    """The scheduler's requests for the pending rows; a row that cannot make one is an input error row."""
    from components.engine import ARRequest

    requests = []
    for job in pending:
        try:
            requests.append(ARRequest(job.id, job.text or "", job.pil_images(), job.size_wh() or "auto",
                                      gen["bot_task"], gen["system_prompt"], job.effective_seed(seed)))
        except Exception as e:  # noqa: BLE001 - one bad row must not sink the shard
            results.error(job.id, f"AR input: {e}", "input")
    return requests


def _stream(engine: Any, requests: list[Any], results: _Results, sampling: Any, export_kv: bool, admission: Any,
            budget: _Budget, owner: bool, forced_cot: Any) -> dict[str, Any]:
    """The requests through the continuous-batching scheduler; its stats. When it halved its batch
    after an OOM, the run keeps the halved budget (a resume starts from it)."""
    from components.engine.ar_scheduler import is_out_of_memory

    engine.ar.forced_cot = forced_cot
    try:
        stats = engine.ar.stream(requests, results.on_result, sampling, export_kv, admission)
    except BaseException as e:
        if admission.halved_to is not None and is_out_of_memory(e):  # this rank ran out: the resume halves
            budget.remember(admission, f"{type(e).__name__} failed the step")
        raise
    finally:
        engine.ar.forced_cot = None
    if admission.halved_to is not None and owner:
        budget.remember(admission, "the step went on after an OOM")
    return stats


@dataclass
class _Budget:
    """The AR batch budget this run keeps for its layout after an OOM (components/ar/budget.py)."""

    layout: RunLayout
    shard: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    device: str

    def start(self, admission: Any, parallel: Any) -> Any:
        """Cap `admission` at the budget that last worked in this run; what the run had (or None)."""
        return apply_budget(admission, read_budget(self.layout, self.tensor_parallel_size,
                                                   self.pipeline_parallel_size, self.device), parallel)

    def remember(self, admission: Any, why: str) -> None:
        remember_budget(self.layout, admission.halved_to, self.shard, why, self.tensor_parallel_size,
                        self.pipeline_parallel_size, self.device)


class _Results:
    """The step's rows as they finish (or fail), each counted on the progress display; an ok row's
    prompt KV goes to the background puts while the other rows decode on."""

    def __init__(self, run_id: str, shard: int, store: Any, puts: _BackgroundPuts, progress: Any, task: Any,
                 handoff: Any = None):
        from components.engine import kernels

        self.run_id, self.shard, self.store, self.puts = run_id, shard, store, puts
        self.progress, self.task, self.handoff = progress, task, handoff
        self.rows: list[dict[str, Any]] = []
        self.row_fallbacks = kernels.FallbacksSince()  # the next ok row carries the fallbacks since the last one

    def error(self, row_id: str, error: str, kind: str) -> None:
        row = _error_row(row_id, error, kind)
        self.rows.append(row)
        self.progress.advance(self.task, 1)
        self._hand_over(row)

    def _hand_over(self, row: dict[str, Any]) -> None:
        """The row is finished, its K/V stored when it has some: to the shard's DiT, if it waits."""
        if self.handoff is not None:
            self.handoff.put(row)

    def on_result(self, request: Any, result: Any) -> None:
        """The scheduler's callback: a row finished (or failed)."""
        from components.engine.ar_scheduler import is_out_of_memory

        if isinstance(result, BaseException):
            kind = "input" if isinstance(result, ValueError) and not is_out_of_memory(result) else "transient"
            self.error(request.id, f"AR failed: {type(result).__name__}: {result}", kind)
            return
        row = _ok_row(result)
        row["kernel_fallbacks"] = self.row_fallbacks.take()
        self.rows.append(row)
        if self.store is not None and result.prompt_kv is not None:
            self.puts.add(row, self.run_id, self.shard, result.prompt_kv,
                          done=self._hand_over if self.handoff is not None else None)
        else:
            self._hand_over(row)
        result.prompt_kv = None  # the put holds the only reference now
        self.progress.advance(self.task, 1)

    def in_order(self, pending: list[Any]) -> list[dict[str, Any]]:
        """The rows in the shard's order (they finish in any)."""
        order = {job.id: i for i, job in enumerate(pending)}
        self.rows.sort(key=lambda r: order[r["id"]])
        return self.rows


# What the step's record keeps of the AR scheduler's stats (engine/ar_scheduler.py SchedulerStats):
# its batch, its K/V budget and the GPU memory outside the allocator when it was set, its time by
# phase, graph captures, and the OOMs it recovered from (with what happened).
SCHEDULER_RECORD = ("mean_batch", "peak_rows", "pool_rows", "kv_budget_bytes", "outside_allocator_bytes",
                    "row_groups", "decode_steps", "prefill_chunks", "prefill_s", "decode_s", "finish_s",
                    "capture_steps", "capture_s", "oom_retries", "events")


class _BackgroundPuts:
    """Puts finished rows' payloads on a background thread while the scheduler decodes on.

    A put starts as soon as its row finishes; at most `max_in_flight` wait or run at once (`add`
    first waits for the oldest), so memory holds that many exported KV payloads at most. A row's
    kv_key / kv_bytes / kv_put_s / kv_error are filled in when its put finishes; a failed put
    leaves kv_error (the DiT step recomputes and says why)."""

    def __init__(self, store: Any, engine: Any = None, max_in_flight: int = 2):
        from components.kvparts import rank_heads, rank_layers

        self.store = store
        self.max_in_flight = max_in_flight
        # under tensor / pipeline parallelism each rank stores only its KV heads of its layers
        # (components/kvparts.py)
        self.heads = rank_heads(engine) if engine is not None else None
        self.layers = (rank_layers(engine), engine.config.num_hidden_layers) if engine is not None else (None, None)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kv-put") if store is not None else None
        self.in_flight: list[tuple[dict[str, Any], str, Future]] = []
        self.stored: list[str] = []  # keys put so far, head parts included (deleted if the step fails)
        self.waited_s = 0.0  # time the decode loop spent waiting for puts

    def expire_orphans(self, other_runs: tuple[str, str] | None = None) -> None:
        """Delete payloads older than the store's TTL (left by failed or killed runs), in the
        background and best effort: a store that cannot list its keys just keeps them longer.
        `other_runs` (output, run id): with the default embedded store, the other runs' embedded
        stores under the same output root too (steps.expire_other_runs_kv)."""
        if self.store is not None and getattr(self.store, "ttl_s", None):
            ttl_s = self.store.ttl_s

            def expire() -> None:
                try:
                    self.store.expire(ttl_s)
                    if other_runs is not None:
                        expire_other_runs_kv(*other_runs, ttl_s)
                except Exception:  # noqa: BLE001 - housekeeping, never the step's failure
                    pass
            self.pool.submit(expire)

    def add(self, row: dict[str, Any], run_id: str, shard: int, kv: Any,
            done: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Put the row's K/V; `done(row)` once it is stored (or failed), its kv_* fields filled in.
        The in-memory store takes it here on the AR's thread and stream (a reference, or one copy
        to host memory queued behind the export); the other stores on the put thread."""
        try:
            key = kv_key(run_id, shard, row["id"])
        except ValueError as e:  # e.g. a run id + row key over the store's key length
            row["kv_error"] = f"no KV key for this row: {e}"
            if done is not None:
                done(row)
            return
        if isinstance(self.store, MemoryStore):
            self._record(row, key, *self._put(key, kv))
            if done is not None:
                done(row)
            return
        _wait_for_export(kv)  # the put thread reads the tensors on a stream of its own
        while len(self.in_flight) >= self.max_in_flight:
            self._collect(*self.in_flight.pop(0))
        fut = self.pool.submit(self._put, key, kv)
        if done is not None:
            fut.add_done_callback(lambda f: (self._record(row, key, *f.result()), done(row)))
        self.in_flight.append((row, key, fut))

    def _put(self, key: str, kv: Any) -> tuple[int | None, float, str | None]:
        from components.kvparts import put_heads

        t0 = time.perf_counter()
        try:
            if self.heads is None:
                size = self.store.put(key, kv)
                self.stored.append(key)
                return size, time.perf_counter() - t0, None
            first, _, total, writes = self.heads
            size = put_heads(self.store, key, kv, first, total, writes, self.stored, *self.layers)
            return size, time.perf_counter() - t0, None
        except Exception as e:  # noqa: BLE001 - the DiT step will recompute and say why
            return None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"

    def _collect(self, row: dict[str, Any], key: str, fut: Future) -> None:
        t0 = time.perf_counter()
        result = fut.result()
        self.waited_s += time.perf_counter() - t0
        self._record(row, key, *result)

    @staticmethod
    def _record(row: dict[str, Any], key: str, size: int | None, put_s: float, error: str | None) -> None:
        row["kv_put_s"] = put_s
        if error is None:
            row["kv_key"], row["kv_bytes"] = key, size
        else:
            row["kv_error"] = error

    def wait(self) -> None:
        while self.in_flight:
            self._collect(*self.in_flight.pop(0))

    def abandon(self) -> None:
        if self.pool is None:
            return
        try:
            self.wait()  # let a put in progress finish, so its key is known and can be deleted
        except BaseException:  # noqa: BLE001 - a second Ctrl-C: give up on the waiting, not on the deletes
            pass
        self.pool.shutdown(wait=False, cancel_futures=True)
        failed = [k for k in self.stored if delete_quietly(self.store, k, attempts=2, backoff_s=0.2)]
        if failed:
            print(f"ar: could not delete {len(failed)} KV payload(s) of this failed step (they expire with the "
                  f"store's TTL, or run `ardit store clean URL --run RUN`)", file=sys.stderr)


def _wait_for_export(kv: Any) -> None:
    """The export's copies done, before another thread reads the tensors: the AR may run on a CUDA
    stream of its own (an overlapped job), which the put thread's stream does not follow."""
    if kv.keys and kv.keys[0].is_cuda:
        import torch

        torch.cuda.current_stream(kv.keys[0].device).synchronize()


def _ok_row(out) -> dict[str, Any]:
    t = out.timings  # the scheduler's: each row's share of the decode steps it took part in
    return {"id": out.id, "status": "ok", "error": None, "error_kind": None, "ar_record": json.dumps(out.to_record()),
            "kv_key": None, "kv_bytes": None, "kv_put_s": None, "kv_error": None,
            "ar_prefill_s": t["ar_prefill_s"], "ar_decode_s": t["ar_decode_s"],
            "prompt_tokens": t["prompt_tokens"], "generated_tokens": t["generated_tokens"]}


def _error_row(row_id: str, error: str, kind: str) -> dict[str, Any]:
    """kind: "input" (a bad row, never retried) or "transient" (retried by a resume)."""
    return {"id": row_id, "status": "error", "error": error, "error_kind": kind}
