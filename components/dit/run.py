"""DiT step: one shard's AR outputs -> images, rows.parquet and the commit marker.

    check the options; remember the settings (a resumed run must bring the same ones)
    for each row without a committed image:
        kv = kv.get(run/shard/row)          fetched in the background while row k-1 denoises;
                                            absent or failed? recompute, and record why
        image = engine.dit(...)             denoise + VAE decode
        images/{row}.png, rows/{row}.json   written in the background while row k+1 denoises
                                            (the image first: a record always has its image)
        kv.delete(run/shard/row)            the payload is consumed (best effort, retried)
    rows.parquet, then _COMMITTED           (every input row: an image or an error row)
    kv.delete_prefix(run/shard)             no key of this shard survives the commit

Each ok row records `kv_wait_s`, the time the denoising loop waited for its KV (the part of the
transfer the prefetch did not hide); the summary reports it per shard against the DiT time.
A store lost or restarted mid-shard costs recomputes (with the reason), never the shard.

What both steps do around their rows (settings, engine load, the step record) is in
components/step_lifecycle.py.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from components.data.ar_outputs import read_ar_rows
from components.data.runs import RunLayout, ShardWriter, row_key
from components.generation import DIT_SETTINGS, resolve_generation
from components.jobconfig import JobConfig
from components.kvstore.base import delete_quietly
from components.options import check_engine_options
from components.run_kv import default_kv_store, expire_other_runs_kv, kv_key, open_kv_store
from components.step_lifecycle import begin_step


def dit_settings(config: JobConfig, generation: dict[str, Any]) -> dict[str, Any]:
    """What the DiT step computes with (a run remembers it; device, TP size and KV reuse,
    which must not change the image, are not part). `generation`: the resolved generation settings."""
    return {"model": config.model, "weights": config.weights, "dummy_weights": config.dummy_weights,
            "dtype": config.dtype, "quantization": config.quantization, "seed": config.seed,
            **{k: generation[k] for k in DIT_SETTINGS}, "step_cache": config.step_cache}


def run(config: JobConfig, shard: int, *, progress: Any = None, parallel: Any = None, handoff: Any = None,
        prefetch: bool = True) -> dict[str, Any]:
    """Run the DiT step of shard `shard` of `config`'s run (a JobConfig: its model, generation
    (steps, guidance, flow_shift), step_cache, kv_reuse, save_latents and kv_store fields; kv_store
    None: the embedded store beside the outputs). Generation settings left None come from the
    model's generation config. Raises ConfigError (before any work) for a bad option or settings
    that differ from those the run started with. `parallel`: this rank's ParallelContext under the
    tensor-parallel launcher (components.runtime.ranks), None in one process. `handoff` (an
    overlapped job: a components.runtime.handoff.Handoff): the rows come from the shard's AR step
    as it finishes them, in that order, instead of from its ar.parquet. `prefetch` (the step
    program's --no-prefetch turns it off; it never changes an image): the next rows' K/V is
    fetched while a row denoises."""
    check_engine_options(dtype=config.dtype, quantization=config.quantization,
                         tensor_parallel_size=config.tensor_parallel_size, seed=config.seed, device=config.device,
                         step_cache=config.step_cache, pipeline_parallel_size=config.pipeline_parallel_size)
    gen = resolve_generation(config.model, **{k: getattr(config, k) for k in DIT_SETTINGS})
    step = begin_step("dit", f"DiT shard {shard}", config, shard, dit_settings(config, gen), parallel, progress)
    if step.layout.is_committed(shard):
        return step.skip("committed")
    if step.owner:  # a killed earlier attempt's half-written images and records (a temp file each)
        step.layout.store.sweep_partial_writes(step.layout.shard_prefix(shard))
    writer = step.layout.shard_writer(shard)
    pending = writer.pending()
    ar_rows = read_ar_rows(step.layout, shard) if handoff is None else {}
    engine = step.load_engine(config)
    store = open_kv_store(config.kv_store or default_kv_store(config.output, config.run_id))
    kv_io = _KVReader(store, engine, config.kv_reuse, deletes=step.owner,
                      other_runs=(config.output, config.run_id) if config.kv_store is None else None)
    out_io = _RowWriter(writer, step.layout, shard, config.save_latents, kv_io, enabled=step.owner)
    task = step.progress.add_task(step.label, len(pending))
    from components.engine import kernels

    fallbacks_before = kernels.fallbacks()
    try:
        settings = dict(run_id=config.run_id, shard=shard, gen=gen, seed=config.seed, step_cache=config.step_cache)
        if handoff is None:
            transient = _denoise_pending(engine, pending, ar_rows, kv_io, out_io, step.progress, task,
                                         prefetch=prefetch, **settings)
        else:
            transient = _denoise_handed_over(engine, pending, handoff, kv_io, out_io, step.progress, task, **settings)
        out_io.drain()
        if transient:
            raise _transient_rows_error(shard, transient)
        overlap = {"handoff": handoff.stats()} if handoff is not None else {}
        # usage: every rank, the worst's
        step.write_timing(**step.usage(), group_fallbacks=out_io.group_fallbacks, **overlap)
        t_rows_done = time.perf_counter()  # the step's work after its last row: said when it is long
        marker = writer.commit() if step.owner else {}
        t_committed = time.perf_counter()
        kv_io.forget(f"{config.run_id}/{shard}", prefix=True)
    finally:
        out_io.close()  # a row being written is finished (it is atomic either way), then stop
        kv_io.close()  # closes the store too, within its timeout
    t_closed = time.perf_counter()
    if config.kv_store is None:
        _remove_if_empty(default_kv_store(config.output, config.run_id))
    step.persist_compiles()
    if step.owner:
        _say_long_tail(shard, t_rows_done, t_committed, t_closed, time.perf_counter())
    step.progress.finish(task)
    return {"shard": shard, **marker, "kv_wait_s": round(out_io.kv_wait_s, 4),
            "kv_deletes_failed": kv_io.deletes_failed, "kernel_fallbacks": kernels.fallbacks() - fallbacks_before,
            "group_fallbacks": out_io.group_fallbacks}


def _denoise_pending(engine: Any, pending: list[Any], ar_rows: dict[str, dict[str, Any]], kv_io: _KVReader,
                     out_io: _RowWriter, progress: Any, task: Any, *, run_id: str, shard: int, gen: dict[str, Any],
                     seed: int, step_cache: float, prefetch: bool) -> list[tuple[str, str]]:
    """Denoise and write the pending rows, a group at a time (one row, or as many as the pipeline
    stages denoise at once), with the next group's KV fetched while this one denoises (`prefetch`).
    A row the AR step failed for good is an error row; one it failed for a transient reason is left
    unrecorded and returned, as (row id, error), for a resume."""
    from components.runtime.pipeline_schedule import rows_in_flight

    fetches: dict[int, Future] = {}

    def fetch(i: int) -> None:
        if i < len(pending) and i not in fetches:
            job = pending[i]
            fetches[i] = kv_io.fetch(kv_key(run_id, shard, job.id), ar_rows.get(job.id))

    transient: list[tuple[str, str]] = []  # rows the AR step failed for a passing reason: left for a resume
    group_size = rows_in_flight(engine.model)  # pipeline stages denoise several rows at once
    for start in range(0, len(pending), group_size):
        group = []
        for i in range(start, min(start + group_size, len(pending))):
            job = pending[i]
            fetch(i)
            if prefetch:
                fetch(i + group_size)  # the next group's KV travels while this one denoises
            row = _ready_row(job, ar_rows.get(job.id), kv_key(run_id, shard, job.id), fetches.pop(i), kv_io, out_io,
                             transient)
            if row is not None:
                group.append(row)
        _denoise_rows(engine, out_io, group, gen=gen, seed=seed, step_cache=step_cache)
        out_io.check()
        progress.advance(task, min(group_size, len(pending) - start))
    return transient


def _denoise_handed_over(engine: Any, pending: list[Any], handoff: Any, kv_io: _KVReader, out_io: _RowWriter,
                         progress: Any, task: Any, *, run_id: str, shard: int, gen: dict[str, Any], seed: int,
                         step_cache: float) -> list[tuple[str, str]]:
    """Denoise and write the pending rows in the order the shard's AR step finishes them (an
    overlapped job: components/overlap/run.py), one at a time, each row's KV fetched as it arrives
    (from the copy's in-memory store: a reference, or one copy from host memory). When the AR
    stopped early, its error is raised once the rows it handed over are written: the rest stay
    unrecorded, for a resume."""
    waiting = {job.id: job for job in pending}
    transient: list[tuple[str, str]] = []
    while (ar_row := handoff.take()) is not None:
        job = waiting.pop(ar_row["id"], None)
        if job is None:
            continue  # not pending here: recorded by an earlier attempt
        key = kv_key(run_id, shard, job.id)
        row = _ready_row(job, ar_row, key, kv_io.fetch(key, ar_row), kv_io, out_io, transient)
        _denoise_rows(engine, out_io, [row] if row is not None else [], gen=gen, seed=seed, step_cache=step_cache)
        out_io.check()
        progress.advance(task, 1)
    if handoff.error is not None:
        out_io.drain()
        raise handoff.error
    if waiting:  # the AR step ended without a word on them: a resume runs them again
        transient += [(row_id, "the AR step handed over no result for this row") for row_id in waiting]
    return transient


def _ready_row(job: Any, ar_row: dict[str, Any] | None, key: str, fetch: Future, kv_io: _KVReader,
               out_io: _RowWriter, transient: list[tuple[str, str]]) -> _DiTRow | None:
    """The row with its AR output and KV (fetched or why not) to denoise; or None when the AR step
    failed it: for good (an error row now) or for a passing reason (left for a resume, in
    `transient`)."""
    if ar_row is not None and ar_row["status"] != "ok" and ar_row.get("error_kind") == "transient":
        fetch.result()
        transient.append((job.id, ar_row["error"]))
        return None
    if ar_row is None or ar_row["status"] != "ok":
        fetch.result()
        out_io.error(job.id, ar_row["error"] if ar_row else "no AR output for this row (AR step not run or failed)",
                     key)
        return None
    t0 = time.perf_counter()
    kv, absent_reason, get_s = kv_io.result(fetch)
    return _DiTRow(job, ar_row, key, kv, absent_reason, get_s, time.perf_counter() - t0)


def _transient_rows_error(shard: int, transient: list[tuple[str, str]]) -> RuntimeError:
    """The shard fails retryably: the other rows are recorded, a resume runs these again."""
    first_id, first_error = transient[0]
    return RuntimeError(f"shard {shard}: {len(transient)} row(s) failed in the AR step for a transient reason "
                        f"(first: row {first_id}: {first_error}); the other rows are recorded, resume the run "
                        "to retry these")


TAIL_SAID_S = 2.0  # a step's closing work longer than this is said in the log, split by part


def _say_long_tail(shard: int, t_rows_done: float, t_committed: float, t_closed: float, t_end: float) -> None:
    """The step's closing work after its last row (outside its record), by part, when it is long."""
    if t_end - t_rows_done > TAIL_SAID_S:
        print(f"DiT shard {shard}: {t_end - t_rows_done:.1f} s after its last row (commit "
              f"{t_committed - t_rows_done:.1f} s, KV deletes and store close {t_closed - t_committed:.1f} s, "
              f"compile cache {t_end - t_closed:.1f} s)", file=sys.stderr, flush=True)


def _remove_if_empty(url: str) -> None:
    """The embedded store's directory once nothing is left in it (for s3:// outputs it sits in the
    temp dir's ardit-kv/, which would otherwise collect an empty directory per run)."""
    import os

    root = url.removeprefix("local://")
    for path in (root, os.path.dirname(root) if os.path.basename(os.path.dirname(root)) == "ardit-kv" else None):
        try:
            if path:
                os.rmdir(path)  # only ever removes an empty directory
        except OSError:
            return


@dataclass
class _DiTRow:
    """A pending row with its AR output and fetched KV, ready to denoise."""

    job: Any
    ar_row: dict[str, Any]
    key: str
    kv: Any
    absent_reason: str
    get_s: float | None
    wait_s: float


def _denoise_rows(engine, out_io: _RowWriter, rows: list[_DiTRow], *, gen: dict[str, Any], seed: int,
                  step_cache: float = 0.0) -> None:
    """Denoise and write `rows`: one by one, or together through the pipeline schedule when the
    engine runs in pipeline stages (if that fails, row by row, so a bad row names itself)."""
    from components.engine import AROutput, DiTRequest, kernels
    from components.engine.kernels import RankLost

    fallbacks = kernels.FallbacksSince()  # a pipeline group's count goes to its first row
    requests = {}
    for row in rows:
        try:
            ar = AROutput.from_record(json.loads(row.ar_row["ar_record"]))
            requests[row.key] = DiTRequest(ar, row.job.pil_images(), row.kv, row.absent_reason, steps=gen["steps"],
                                           guidance_scale=gen["guidance"], flow_shift=gen["flow_shift"],
                                           seed=row.job.effective_seed(seed), step_cache=step_cache)
        except Exception as e:  # noqa: BLE001 - the row ends as an error row, the shard goes on
            out_io.error(row.job.id, f"DiT failed: {type(e).__name__}: {e}", row.key)
    rows = [row for row in rows if row.key in requests]
    if len(rows) > 1:
        from components.runtime.pipeline_schedule import denoise_rows

        try:
            for row, out in zip(rows, denoise_rows(engine.dit, [requests[row.key] for row in rows])):
                _write_row(out_io, row, requests[row.key].ar, out, fallbacks)
            return
        except RankLost:
            raise  # another rank died: the step fails, nothing is committed
        except Exception as e:  # noqa: BLE001 - every stage fails alike (same inputs): retry row by row
            # said and counted: the group's first row carries it in kernel_fallbacks, the step in
            # its record's group_fallbacks (the rows still come out, each alone, slower)
            kernels.record_fallback("dit_pipeline_group", len(rows), e)
            out_io.group_fallbacks += 1
            if out_io.enabled:
                print(f"dit: {len(rows)} rows denoised together through the pipeline stages failed "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); denoising them "
                      "one by one", file=sys.stderr, flush=True)
    for row in rows:
        try:
            out = _denoise_retrying_oom(engine, requests[row.key])
        except Exception as e:  # noqa: BLE001 - the row ends as an error row, the shard goes on
            if isinstance(e, RankLost):
                raise  # another rank died: the step fails, nothing is committed
            out_io.error(row.job.id, f"DiT failed: {type(e).__name__}: {e}", row.key)
            continue
        _write_row(out_io, row, requests[row.key].ar, out, fallbacks)


def _denoise_retrying_oom(engine: Any, request: Any) -> Any:
    """engine.dit(request); out of GPU memory once, again after the allocator gave its cached
    blocks back (each CUDA stream keeps its own: an overlapped AR's free blocks are no use to the
    DiT's stream until then). Alone in its process (no ranks waiting in its collectives) only."""
    import torch

    try:
        return engine.dit(request)
    except torch.OutOfMemoryError:
        parallel = getattr(engine.model, "parallel", None)
        if parallel is not None and (parallel.world_size > 1 or parallel.pp_size > 1):
            raise
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    print(f"dit: row {request.ar.id} ran out of GPU memory; retrying it once with the allocator's cached blocks "
          "freed", file=sys.stderr, flush=True)
    return engine.dit(request)


def _write_row(out_io: _RowWriter, row: _DiTRow, ar, out, fallbacks: Any) -> None:
    job, ar_row, key, get_s, wait_s = row.job, row.ar_row, row.key, row.get_s, row.wait_s
    t = out.timings
    metrics = dict(
        cot_text=ar.cot_text, kv_path=out.kv_path, kv_reason=out.kv_reason or None,
        kv_store=out_io.kv_io.scheme if out.kv_path == "reuse" else None,  # how the reused K/V came
        ar_prefill_s=ar_row["ar_prefill_s"], ar_decode_s=ar_row["ar_decode_s"],
        prompt_tokens=ar_row["prompt_tokens"], generated_tokens=ar_row["generated_tokens"],
        kv_bytes=ar_row.get("kv_bytes"), kv_put_s=ar_row.get("kv_put_s"), kv_get_s=get_s, kv_wait_s=wait_s,
        dit_step_s_mean=sum(t["dit_step_s"]) / max(len(t["dit_step_s"]), 1),
        dit_total_s=t["dit_total_s"], vae_decode_s=t["vae_decode_s"],
        dit_prefix_s=t["dit_prefix_s"], generated_ids=json.dumps(ar.generated_ids),
        ratio_index=ar.ratio_index,
        # fast paths that fell back to the plain ones (per shape) for this row: its AR batch's and its DiT's
        kernel_fallbacks=(ar_row.get("kernel_fallbacks") or 0) + fallbacks.take())
    if "dit_steps_skipped" in t:
        metrics["dit_steps_skipped"] = t["dit_steps_skipped"]  # by the step cache
    if "dit_rows_in_flight" in t:
        metrics["dit_rows_in_flight"] = t["dit_rows_in_flight"]  # pipeline stages: rows denoised together
        for phase, seconds in t["dit_group_s"].items():  # and where their group's time went
            metrics[f"dit_group_{phase}_s"] = seconds
    out_io.ok(job.id, out.image, out.latents, key, metrics)


class _KVReader:
    """The shard's KV traffic, off the denoising loop: gets run ahead of it (prefetch) on one
    thread, deletes of consumed payloads behind it on another, so a slow delete never delays a get.
    Each wait is bounded by the store's timeout and each delete is tried once. The first sign that
    the store is down (unreachable, or no answer in time) ends the shard's KV traffic: later rows
    recompute at once with the reason (one log line says so), and the payloads left behind expire
    with the store's TTL (`ardit store gc`). Both threads are daemons: a call hung in a frozen
    store never holds up the step's exit."""

    def __init__(self, store: Any, engine: Any, kv_reuse: bool, deletes: bool = True,
                 other_runs: tuple[str, str] | None = None):
        from components.kvparts import rank_heads, rank_layers
        from components.kvstore.base import DaemonPool

        self.store, self.engine, self.kv_reuse, self.deletes = store, engine, kv_reuse, deletes
        self.scheme = str(getattr(store, "url", "")).split("://", 1)[0] or None  # memory, local, mooncake
        self.heads = rank_heads(engine)  # this rank's KV heads under tensor parallelism
        self.layers = rank_layers(engine)  # and its decoder layers under pipeline parallelism
        self.device = str(engine.model.device)
        self.timeout_s = float(getattr(getattr(store, "cfg", None), "timeout", 0) or 60.0)
        self.gets = DaemonPool(1, "kv-io-get")
        self.deleter = DaemonPool(1, "kv-io-delete")
        self.down: str | None = None  # why the store is taken as down for the rest of the shard
        self.deletes_failed = 0
        if deletes and getattr(store, "ttl_s", None):
            def expire() -> None:  # orphans of killed runs: housekeeping, best effort
                store.expire(store.ttl_s)
                if other_runs is not None:  # the default embedded store: the other runs' beside it
                    expire_other_runs_kv(*other_runs, store.ttl_s)
            self.deleter.submit(self._bounded, expire)

    def _mark_down(self, why: str) -> None:
        if self.down is None:
            self.down = why
            print(f"dit: KV store down ({why}): the rest of this shard recomputes its KV without waiting on "
                  "the store; payloads left behind expire with the store's TTL (`ardit store gc`)",
                  file=sys.stderr, flush=True)

    def fetch(self, key: str, ar_row: dict[str, Any] | None) -> Future:
        """A future of (kv or None, why not, get seconds or None)."""
        reason = None
        if ar_row is None or ar_row["status"] != "ok":
            reason = "no AR output"
        elif not self.kv_reuse:
            reason = "reuse disabled"
        elif ar_row.get("kv_error"):
            reason = f"AR could not store KV: {ar_row['kv_error']}"
        elif not ar_row.get("kv_key"):
            reason = "AR exported no KV (no reuse boundary)"
        elif self.down:
            reason = f"KV store down: {self.down}"
        if reason is not None:
            done: Future = Future()
            done.set_result((None, reason, None))
            return done
        return self.gets.submit(self._get, key)

    def _get(self, key: str) -> tuple[Any, str, float | None]:
        from components.kvparts import get_heads
        from components.kvstore.base import TIMEOUT, UNREACHABLE

        if self.down:  # found down while this get waited in the queue
            return None, f"KV store down: {self.down}", None
        t0 = time.perf_counter()
        first, last, total, _ = self.heads

        def get():  # this rank's heads and layers: from the whole payload, or the parts of a parallel AR
            return get_heads(self.store, key, first, last, total, self.engine.model_id, self.engine.config_hash,
                             device=self.device, layers=self.layers,
                             total_layers=self.engine.config.num_hidden_layers)
        if self.device.startswith("cuda"):
            import torch

            stream = torch.cuda.Stream(device=self.device)  # copies to the GPU beside the DiT's kernels
            with torch.cuda.stream(stream):
                got = get()
            stream.synchronize()
        else:
            got = get()
        if not got.ok and got.code in (TIMEOUT, UNREACHABLE):
            self._mark_down(got.reason)
        return got.kv, ("" if got.ok else f"KV {got.reason}"), time.perf_counter() - t0

    def result(self, fut: Future) -> tuple[Any, str, float | None]:
        """The fetched KV, or a recompute reason when the fetch failed or the store did not answer."""
        from concurrent.futures import TimeoutError as FutureTimeout

        try:
            return fut.result(timeout=self.timeout_s + 5)
        except FutureTimeout:
            self._mark_down(f"a get had no answer in {self.timeout_s:g} s")
            return None, f"KV store down: {self.down}", None
        except Exception as e:  # noqa: BLE001 - a failed prefetch is a recompute, not a failed row
            return None, f"KV prefetch failed: {type(e).__name__}: {e}", None

    def forget(self, key: str, prefix: bool = False) -> None:
        """Delete a consumed payload (all its parts) behind the loop, once, within the store's
        timeout; a store that is down is left alone (its payloads expire with the TTL). Only the
        owner rank deletes, after every rank has its KV (the row is done)."""
        if not self.deletes:
            return

        def delete() -> None:
            error = "skipped: the store is down" if self.down else self._bounded(lambda: self._remove(key, prefix))
            if error:
                self.deletes_failed += 1
                if not self.down:
                    print(f"dit: KV delete {key!r}{' (prefix)' if prefix else ''} failed: {error}; the payload "
                          "expires with the store's TTL", file=sys.stderr)
                    self._mark_down(f"a delete failed: {error}")
        self.deleter.submit(delete)

    def _remove(self, key: str, prefix: bool) -> str | None:
        """Everything under the shard's prefix, or one row's KV in whichever form the AR wrote (one
        payload, or a part per head or layer: parts left for the shard's prefix delete, a thousand
        files a shard under --pp, cost seconds after the shard's last row). A failure raises, and
        `_bounded` reports it."""
        from components.kvparts import delete_heads

        if prefix:
            return delete_quietly(self.store, key, prefix=True, attempts=1)
        _, _, total_heads, _ = self.heads
        delete_heads(self.store, key, total_heads, self.engine.config.num_hidden_layers)
        return None

    def _bounded(self, call: Any) -> str | None:
        """``call()`` (which returns None or an error) on a daemon thread, given the store's timeout."""
        from components.kvstore.base import DaemonPool

        pool = DaemonPool(1, "kv-io-call")
        fut = pool.submit(call)
        pool.shutdown(wait=False)
        try:
            return fut.result(timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a timeout or a failure: the caller reports it
            return f"no answer in {self.timeout_s:g} s" if not str(e) else f"{type(e).__name__}: {e}"

    def close(self) -> None:
        """Let queued deletes finish (each bounded), then close the store: all within a bound,
        so a store that stopped answering never holds the finished step."""
        self.gets.shutdown(wait=True, timeout=self.timeout_s + 5)
        self.deleter.shutdown(wait=True, timeout=self.timeout_s + 5)
        if self._bounded(lambda: self.store.close()):
            print(f"dit: closing the KV store got no answer in {self.timeout_s:g} s; leaving it", file=sys.stderr)


class _RowWriter:
    """Writes finished rows (PNG, then record; latents) on a background thread, in order, while
    the next row denoises; a write that failed is raised by the next `check()`."""

    def __init__(self, writer: ShardWriter, layout: RunLayout, shard: int, save_latents: bool, kv_io: _KVReader,
                 enabled: bool = True):
        self.enabled = enabled  # False on tensor-parallel ranks other than the owner: they write nothing
        self.writer, self.layout, self.shard = writer, layout, shard
        self.save_latents, self.kv_io = save_latents, kv_io
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="row-writer")
        self.futures: list[Future] = []
        self.kv_wait_s = 0.0
        self.group_fallbacks = 0  # pipeline groups that failed together and were denoised row by row

    def ok(self, row_id: str, image: Any, latents: Any, key: str, metrics: dict[str, Any]) -> None:
        self.kv_wait_s += metrics["kv_wait_s"]
        if not self.enabled:
            return

        def write() -> None:
            self.writer.record_ok(row_id, image, **metrics)
            if self.save_latents:
                import io

                import torch

                buf = io.BytesIO()
                torch.save(latents, buf)
                self.layout.store.put_bytes(f"{self.layout.shard_prefix(self.shard)}latents/{row_key(row_id)}.pt",
                                            buf.getvalue())
            self.kv_io.forget(key)  # consumed: the image is committed
        self.futures.append(self.pool.submit(write))

    def error(self, row_id: str, error: str, key: str) -> None:
        if not self.enabled:
            return

        def write() -> None:
            self.writer.record_error(row_id, error)
            self.kv_io.forget(key)
        self.futures.append(self.pool.submit(write))

    def check(self) -> None:
        """Raise the error of a finished write (the shard stops: storage is failing)."""
        still = []
        for fut in self.futures:
            if fut.done():
                fut.result()
            else:
                still.append(fut)
        self.futures = still

    def drain(self) -> None:
        for fut in self.futures:
            fut.result()
        self.futures = []

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)
