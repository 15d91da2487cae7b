"""A local job (`ardit edit --tp 2` / `--pp 2`, one rank pool for the whole job) whose AR runs out of
memory inside a forward on one rank (issue 35): the ranks cannot retry that batch alone, so the step
fails with the halved budget kept in the run, and the job starts its ranks again from that budget and
runs the step again. Shards committed before stay; every row ends ok. It failed the job before.
"""

from __future__ import annotations

import pytest

from components.data.runs import RunLayout
from tests.oom_targets import (
    OOM_MARKER_ENV,
    OOM_RANK_ENV,
    OOM_SHARD_ENV,
    ar_out_of_memory_in_a_job_forward_once,
)

AR = dict(bot_task="think_recaption", system_prompt="en_unified", max_new_tokens=6, temperature=0.0, top_k=0,
          top_p=1.0)
GEN = dict(steps=2, guidance=5.0, flow_shift=3.0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from components.data.sample import write_sample_edit_dataset

    return str(write_sample_edit_dataset(tmp_path_factory.mktemp("data") / "edit.parquet", n=4))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks,bad_rank", [({"tensor_parallel_size": 2}, 1), ({"pipeline_parallel_size": 2}, 0)],
                         ids=["tp2", "pp2"])
def test_a_job_whose_ar_runs_out_of_memory_mid_forward_halves_and_completes(dataset, tmp_path, monkeypatch, capfd,
                                                                            ranks, bad_rank):
    import pipeline.local
    from components.jobconfig import JobConfig
    from pipeline.local import run_job

    marker = tmp_path / "oom-fired"
    monkeypatch.setitem(pipeline.local.STEP_TARGETS, "ar", ar_out_of_memory_in_a_job_forward_once)
    monkeypatch.setenv(OOM_MARKER_ENV, str(marker))
    monkeypatch.setenv(OOM_RANK_ENV, str(bad_rank))
    monkeypatch.setenv(OOM_SHARD_ENV, "1")  # the second shard: the first is committed by then
    monkeypatch.setenv("ARDIT_RANK_TIMEOUT_S", "90")  # a hang would end as a collective timeout, not hold CI
    out = str(tmp_path / "out")
    capfd.readouterr()
    summary = run_job(JobConfig(dataset=dataset, output=out, run_id="oom", kind="edit", num_shards=2, model="tiny",
                                device="cpu", seed=0, batch_size=8, **AR, **GEN, **ranks), progress=False)
    err = capfd.readouterr().err
    assert marker.exists()  # the OOM fired
    assert (f"rank {bad_rank} of 2 failed: torch.OutOfMemoryError: CUDA out of memory (injected on rank "
            f"{bad_rank}); starting the ranks again with at most 1 AR row(s) in flight (restart 1 of at most 6)"
            in err), err
    assert summary["rows_ok"] == 4 and summary["rows_failed"] == 0, summary
    assert summary["data_parallel"]["failed"] == [], summary
    layout = RunLayout.open(out, "oom")
    assert len(layout.read_inputs(1)) == 2  # two rows were in flight when it ran out
    budget = layout.read_json(layout.settings_key("ar_budget"))
    assert budget["max_rows"] == 1 and budget["shard"] == 1, budget
    first, second = (layout.read_json(layout.step_timing_key(k, "ar")) for k in (0, 1))
    assert first["budget_from_run"] is None, first  # shard 0 ran once, before the OOM: it was not redone
    assert second["budget_from_run"]["max_rows"] == 1 and second["scheduler"]["pool_rows"] == 1, second
    for k in (0, 1):
        assert layout.is_committed(k)
        assert all(r["status"] == "ok" for r in layout.read_rows(k).to_pylist())
