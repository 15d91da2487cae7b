"""A local job's data-parallel replicas: N model copies (tp x pp ranks each, a RankPool on GPUs of
its own) fed from one work queue of shards.

A free replica takes the next shard and runs its steps (AR, then DiT). A replica that fails (a
rank raised or died) gives its shard back and retires; the others finish the job. With one
replica the steps run in the caller's thread (and in this process at tp x pp = 1), so Ctrl-C and
errors behave as in a plain run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from components.runtime.dispatch import RestartFrom, Step, rank_pool, run_step

# One step of a shard: the step function, its keywords, and what its ranks start again from after a
# failure (run_step's `restart_from`; None: a failure stands).
ShardStep = tuple[Step, dict[str, Any], RestartFrom | None]


class Replicas:
    """What the replicas did: which replica ran each shard, the failures, the shards left over."""

    def __init__(self, todo: list[int]):
        self.pending = list(todo)
        self.in_flight = 0
        self.ran: dict[int, int] = {}
        self.failed: list[dict[str, Any]] = []
        self.left: list[int] = []
        self.changed = threading.Condition()
        self.stop = threading.Event()
        self.pools: dict[int, Any] = {}
        self.close_s: dict[int, float] = {}  # per replica: how long its ranks took to stop after the work

    def take(self) -> int | None:
        """The next shard, waiting while others are in flight (a failure may give one back);
        None when nothing is left to do."""
        with self.changed:
            while not self.pending and self.in_flight and not self.stop.is_set():
                self.changed.wait(0.5)
            if not self.pending or self.stop.is_set():
                return None
            self.in_flight += 1
            return self.pending.pop(0)

    def done(self, shard: int, replica: int, error: str | None = None) -> None:
        with self.changed:
            self.in_flight -= 1
            if error is None:
                self.ran[shard] = replica
            else:  # back to the queue, first in line
                self.pending.insert(0, shard)
                self.failed.append({"replica": replica, "shard": shard, "error": error})
            self.changed.notify_all()


def run_replicas(todo: list[int], shard_steps: Callable[[int], list[ShardStep]], bars: Any,
                 data_parallel_size: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                 device: str) -> Replicas:
    """Run every shard of `todo` (its steps from `shard_steps`) on `data_parallel_size` replicas."""
    import os

    from components.errors import one_line
    from components.progress import SharedProgress

    state = Replicas(todo)
    world = tensor_parallel_size * pipeline_parallel_size
    if not todo:
        return state

    def replica(index: int, progress: Any) -> None:
        own = data_parallel_size > 1  # a replica in processes of its own (its pool), fed by this thread
        ids = list(range(index * world, (index + 1) * world)) if device == "cuda" and own else None
        threads = max(1, (os.cpu_count() or 1) // (data_parallel_size * world)) if own else None
        shard, error, steps_done = None, None, 0
        try:
            with rank_pool(tensor_parallel_size, device, pipeline_parallel_size=pipeline_parallel_size,
                           device_ids=ids, cpu_threads=threads, own_process=own) as pool:
                state.pools[index] = pool
                while (shard := state.take()) is not None:
                    steps_done = 0
                    for step, kwargs, restart_from in shard_steps(shard):
                        run_step(step, kwargs, progress, pool=pool, restart_from=restart_from)
                        steps_done += 1
                    state.done(shard, index)
                t_close = time.perf_counter()
            if pool is not None:  # its rank processes stopped when the `with` ended
                state.close_s[index] = time.perf_counter() - t_close
        except Exception as exc:  # noqa: BLE001 - the replica is gone; its shard goes back to the queue
            if not own:
                raise  # the only replica: the job fails as it always did (nothing uncommitted is trusted)
            error = f"replica {index}: {type(exc).__name__}: {exc}"
        finally:
            state.pools.pop(index, None)
        if error is not None:  # its ranks are stopped (the pool closed) before another replica redoes it
            if state.stop.is_set():
                return  # the job was interrupted: its ranks were stopped on purpose
            if shard is None:
                with state.changed:
                    state.failed.append({"replica": index, "shard": None, "error": error})
                    state.changed.notify_all()
                progress.redo(f"data-parallel {one_line(error)}; the other replicas go on", 0)
            else:
                # said now, on the terminal: the job may still end well (exit 0), one replica short
                progress.redo(f"data-parallel {one_line(error)}; shard {shard} goes back to the queue for the other "
                              "replicas" + (f" (its {steps_done} finished step(s) run again)" if steps_done else ""),
                              steps_done)
                state.done(shard, index, error)

    if data_parallel_size == 1:  # in this thread: Ctrl-C and errors behave as they always did
        replica(0, bars)
    else:
        shared = SharedProgress(bars)
        threads = [threading.Thread(target=replica, args=(r, shared), name=f"replica-{r}", daemon=True)
                   for r in range(data_parallel_size)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except KeyboardInterrupt:
            state.stop.set()
            for pool in list(state.pools.values()):
                for p in pool.procs if pool is not None else []:
                    p.terminate()
            raise
    state.left = sorted(state.pending)
    return state
