"""Running a step on tensor-parallel ranks: ranks run a step function, a failed rank fails the step by name."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from components.runtime.ranks import SAFE_NCCL_ENV, RankFailed, gpu_env_defaults, run_on_ranks
from tests import parallel_targets


def test_ranks_run_and_rank0_result_comes_back():
    assert run_on_ranks(parallel_targets.sum_ranks, {"value": 10}, world_size=3, device="cpu") == 3 * 10 + 0 + 1 + 2


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failed_rank_fails_the_step_and_stops_the_others(how, tmp_path):
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed") as e:
        run_on_ranks(parallel_targets.fail_on_rank, {"bad_rank": 1, "how": how, "marker_dir": str(tmp_path)},
                     world_size=2, device="cpu")
    if how == "raise":
        assert "row 3: this rank could not read its weights" in str(e.value)
    else:
        assert "killed or crashed" in str(e.value)
    # the healthy rank was stopped, not waited for: it never returned, and no rank process is left
    assert list(tmp_path.iterdir()) == []
    assert multiprocessing.active_children() == []


def test_more_ranks_than_gpus_is_one_line():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 64 needs 64 GPUs, this machine has \d+"):
        run_on_ranks(parallel_targets.sum_ranks, {"value": 0}, world_size=64, device="cuda")


def test_a_rank_pool_keeps_its_processes_and_engines():
    from components.runtime.ranks import RankPool

    with RankPool(2, "cpu") as pool:
        assert [pool.run(parallel_targets.count_calls, {}) for _ in range(3)] == [1, 2, 3]
        first = pool.run(parallel_targets.engine_identity, {})
        assert pool.run(parallel_targets.engine_identity, {}) == first  # loaded once per rank
    assert all(not p.is_alive() for p in pool.procs)


def test_a_closed_pool_s_ranks_exit_cleanly_and_run_their_exit_handlers(tmp_path):
    """The ranks skip the interpreter's teardown (1.5 s a pool for the tiny model on the CPU), not
    the exit handlers: Inductor stops its compile workers in one."""
    from components.runtime.ranks import RankPool

    with RankPool(2, "cpu") as pool:
        pool.run(parallel_targets.mark_at_exit, {"marker_dir": str(tmp_path)})
    assert [p.exitcode for p in pool.procs] == [0, 0]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_failure_ends_the_pool():
    from components.runtime.ranks import RankPool

    with RankPool(2, "cpu") as pool:
        with pytest.raises(RankFailed, match="rank 1 of 2 failed"):
            pool.run(parallel_targets.fail_on_rank, {"bad_rank": 1, "how": "raise"})
        with pytest.raises(RankFailed, match="stopped by an earlier failure"):
            pool.run(parallel_targets.count_calls, {})
    assert all(not p.is_alive() for p in pool.procs)


def test_a_one_rank_pool_runs_in_its_own_process_and_its_progress_reaches_the_parent():
    """A data-parallel replica at TP 1: one rank process without a process group (parallel=None);
    the step's progress calls arrive at the parent's progress object, in order."""
    import os

    from components.runtime.ranks import RankPool

    calls = []

    class Recording:
        def add_task(self, label, total):
            calls.append(("add_task", label, total))
            return f"task-{len(calls)}"

        def advance(self, task, n=1):
            calls.append(("advance", task, n))

        def finish(self, task):
            calls.append(("finish", task))

        def skip(self, label, why):
            calls.append(("skip", label, why))

    with RankPool(1, "cpu", device_ids=[0]) as pool:
        got = pool.run(parallel_targets.report_progress, {}, progress=Recording())
    assert got["pid"] != os.getpid() and got["parallel"] is False and got["device"] == "cpu"
    assert calls == [("add_task", "step shard 0", 3), ("advance", "task-1", 1), ("advance", "task-1", 2),
                     ("finish", "task-1"), ("skip", "step shard 1", "committed")]


def test_gpu_env_defaults_keep_what_the_user_set(monkeypatch):
    """Expandable segments and NCCL without multicast by default; a user's own allocator or NCCL
    settings stay as they are (under either allocator variable's name)."""
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", *SAFE_NCCL_ENV):
        monkeypatch.delenv(key, raising=False)
    gpu_env_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert all(os.environ[key] == value for key, value in SAFE_NCCL_ENV.items())

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    gpu_env_defaults()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:512"
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
