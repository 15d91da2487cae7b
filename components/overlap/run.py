"""The AR and DiT steps of one shard at once, on one engine (one copy of the weights).

    load the engine once                       (both steps then find it loaded)
    AR step   on a thread of its own, on a high-priority CUDA stream:
              the continuous-batching scheduler decodes the next rows; each finished row's K/V
              goes to the copy's in-memory store and the row to the handoff
    DiT step  on this thread, on the default stream:
              takes each row as the AR finishes it, denoises it, writes its image
    both end; the DiT step commits the shard, the AR step has written ar.parquet

The AR's decode is memory-bound (each step reads every weight for a few tokens a row) and the DiT's
steps are compute-bound, so the GPU runs them side by side instead of in turn, and no row's K/V
goes through storage: it stays in this process (GPU or page-locked host memory), counted as reuse.
The AR is held back when it runs too far ahead of the DiT (components/runtime/handoff.py), and it
leaves the DiT the GPU memory the DiT needs (`dit_reserve_bytes`).

Each step writes what it writes when run alone (ar.parquet, rows, step records; the handoff's
figures in the DiT's step record), so resume, commit and the per-row reuse / recompute accounting
are the sequential steps'. A failure of either side stops the other: rows already written stay,
the rest run again on resume. One process, one rank: the layouts of several ranks (--tp, --pp)
run their steps in turn (their ranks' collectives would interleave across the two threads).

`then`: the shards this copy runs next, in order. The AR thread goes on to the next shard's rows as
soon as it has finished this one's, while the DiT still denoises this shard's last rows; the DiT
then finds the next shard's first rows ready instead of waiting for them at each shard's start
(and the AR does not sit idle through each shard's tail). Each shard still has its own handoff,
records and commit. The later ARs keep the K/V budget the first one measured (before the DiT held
any memory): measured again beside a DiT mid-row, the DiT's memory would count twice (in use, and
in its reserve) and the chained AR would run a smaller batch. Nor do they start with the small
first wave that gets an idle DiT going (the DiT is busy with the shard before): their first wave
fills the pool.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from components.ar.run import run as ar_run
from components.data.runs import RunLayout
from components.dit.run import run as dit_run
from components.errors import ConfigError
from components.jobconfig import JobConfig
from components.runtime.handoff import LEAD_ROWS, Cancelled, Handoff
from components.step_lifecycle import job_engine


def run(config: JobConfig, shard: int, *, progress: Any = None, parallel: Any = None, handoff: Handoff | None = None,
        then: tuple[int, ...] | list[int] = ()) -> dict[str, Any]:
    """Run shard `shard`'s AR and DiT steps overlapped, then those of each shard of `then` (the AR
    of the next shard starting as soon as the AR of the one before ends); both steps read `config`
    (components/ar/run.py, components/dit/run.py). Returns the first shard's steps' results and the
    handoff's figures (`then`: each later shard's under "then"). `handoff`: the first shard's rows'
    way from the AR to the DiT (default: Handoff())."""
    from components.progress import NoProgress, SharedProgress

    if parallel is not None and (parallel.world_size > 1 or parallel.pp_size > 1):
        raise ConfigError("overlapped AR and DiT steps run in one process (tp x pp = 1): use --overlap off with "
                          "--tp or --pp above 1")
    shards = [shard, *then]
    progress = SharedProgress(progress or NoProgress())  # both threads report to it
    t_load = time.perf_counter()
    loaded = job_engine(config, parallel)
    load_s = time.perf_counter() - t_load
    # a chained shard's AR starts while the DiT still has the shard before's rows to denoise: no
    # small first wave to get the DiT going, a full batch from its first step
    handoffs = {shard: handoff or Handoff(), **{s: Handoff(head_rows=LEAD_ROWS) for s in then}}
    reserve = dit_reserve_bytes(loaded.model)
    for h in handoffs.values():
        h.reserve_bytes = reserve
    side = _ARThread(config, parallel, shards, handoffs, progress, loaded.model.device)
    side.start()
    layout = RunLayout.open(config.output, config.run_id)
    done = []  # (shard, its DiT result, its overlap record)
    for i, s in enumerate(shards):
        t0 = time.perf_counter()
        try:
            dit_result = dit_run(config, s, parallel=parallel, handoff=handoffs[s], progress=progress)
        except BaseException:
            for h in handoffs.values():
                h.cancel()  # the AR stops at its next admission (or its next finished row)
            side.join(timeout=60.0)
            for rest in shards[i:]:
                _forget_shard_kv(config.kv_store, config.run_id, rest)
            raise
        record = {"load_s": round(load_s if i == 0 else 0.0, 3), "wall_s": round(time.perf_counter() - t0, 3),
                  "handoff": handoffs[s].stats()}
        if "skipped" not in dit_result:  # beside the steps' own records: the load they shared (theirs read 0)
            layout.write_json(layout.step_timing_key(s, "overlap"), record)
        done.append((s, dit_result, record))
    side.join()
    if side.error is not None and not isinstance(side.error, Cancelled):
        raise side.error  # the DiT took every row the AR handed over; the rest stay for a resume
    results = [{"shard": s, "ar": side.results.get(s), "dit": d, **record} for s, d, record in done]
    return {**results[0], "then": results[1:]} if then else results[0]


def _forget_shard_kv(url: str | None, run_id: str, shard: int) -> None:
    """The K/V the AR put and the DiT will not read now (it stopped): gone from the in-memory store
    at once, rather than held until the process ends (a resume recomputes those prefixes anyway)."""
    if url and url.startswith("memory://"):
        from components.kvstore.memory import open_memory_store

        open_memory_store(url).delete_prefix(f"{run_id}/{shard}")


class _ARThread(threading.Thread):
    """The AR steps of `shards`, one after the other, on a thread of its own (and its own CUDA
    stream), telling each shard's handoff when its AR ends. After a failure the later shards' ARs
    do not run: their handoffs end with the same error."""

    def __init__(self, config: JobConfig, parallel: Any, shards: list[int], handoffs: dict[int, Handoff],
                 progress: Any, device: Any):
        super().__init__(name=f"ar-shard-{shards[0]}", daemon=True)
        self.config, self.parallel, self.shards, self.handoffs = config, parallel, shards, handoffs
        self.progress, self.device = progress, device
        self.results: dict[int, dict[str, Any]] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        import contextlib

        import torch

        stream = (torch.cuda.stream(torch.cuda.Stream(self.device, priority=-1)) if self.device.type == "cuda"
                  else contextlib.nullcontext())
        budget = None  # the K/V budget the first AR that ran measured
        with stream, torch.no_grad():
            for shard in self.shards:
                handoff = self.handoffs[shard]
                if self.error is not None:
                    handoff.finish(self.error)
                    continue
                if budget is not None:
                    handoff.kv_budget_bytes = budget
                try:
                    self.results[shard] = ar_run(self.config, shard, parallel=self.parallel, handoff=handoff,
                                                 progress=self.progress)
                    if budget is None:  # measured before this copy's DiT held any memory: the chain keeps it
                        budget = (self.results[shard].get("ar_scheduler") or {}).get("kv_budget_bytes")
                except BaseException as e:  # noqa: BLE001 - handed to the DiT side, which raises it
                    self.error = e
                    if not isinstance(e, Cancelled):
                        print(f"ar: shard {shard}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                finally:
                    handoff.finish(self.error)


def dit_reserve_bytes(model: Any) -> int:
    """GPU memory the DiT of an overlapped copy needs beside the AR (the AR's K/V budget leaves it
    free): a row's two CFG caches at the model's largest image (its prefix of conditioning image,
    ViT tokens and text, plus the image tokens), a step's activations, and the VAE decode of that
    image (about 14 KB a pixel, measured at 1024 x 1024 with the compiled norms), with 25 % margin.
    0 off the GPU."""
    if model.device.type != "cuda":
        return 0
    from components.engine.ar_scheduler import kv_bytes_per_token

    cfg = model.config
    side = cfg.image_base_size
    image_tokens = (side // 16) ** 2  # the 16x VAE's latent grid
    prefix_tokens = image_tokens + 1024 + 2048  # a conditioning image, its ViT tokens, text and CoT
    cache = 2 * (prefix_tokens + image_tokens) * kv_bytes_per_token(model)
    topk = max(cfg.moe_topk) if isinstance(cfg.moe_topk, list) else cfg.moe_topk
    inter = max(cfg.moe_intermediate_size) if isinstance(cfg.moe_intermediate_size, list) \
        else cfg.moe_intermediate_size
    activations = 2 * image_tokens * (8 * cfg.hidden_size + 3 * (topk + 1) * inter) * 2
    vae = side * side * 14_000
    return int(1.25 * (cache + activations + vae))
