"""A job's checks and start read the run once (RunLayout.state): resuming a run reads its manifest,
each step's recorded settings and each shard's commit marker one time before the first step starts,
and does not shard the dataset again.

Counted at the object store (every `get_bytes` of the run's keys) up to the moment the replicas
are handed their shards; the steps themselves then read what they need.
"""

from __future__ import annotations

from collections import Counter

import pytest

from components.data.objectstore import LocalObjectStore
from components.data.runs import RunLayout
from components.jobconfig import JobConfig

pytestmark = pytest.mark.slow

RUN = "once"


def _config(dataset: str, out: str) -> JobConfig:
    return JobConfig(dataset=dataset, output=out, run_id=RUN, num_shards=2, model="tiny", device="cpu", steps=2,
                     guidance=5.0, max_new_tokens=4, greedy=True)


def _reads_until_the_steps_start(monkeypatch, config: JobConfig) -> tuple[Counter, list[int]]:
    """Run the job; the run's keys read before the replicas start, and the shards they were given."""
    from components.runtime import replicas
    from pipeline.local import run_job

    reads: Counter = Counter()
    started: list[int] = []
    real_get, real_run = LocalObjectStore.get_bytes, replicas.run_replicas

    def get_bytes(self, key: str) -> bytes:
        if not started and key.startswith(f"{RUN}/"):
            reads[key[len(RUN) + 1:]] += 1
        return real_get(self, key)

    def run_replicas(todo, *args, **kwargs):
        started.extend(todo or [-1])  # from here on the steps read what they need
        return real_run(todo, *args, **kwargs)

    monkeypatch.setattr(LocalObjectStore, "get_bytes", get_bytes)
    monkeypatch.setattr(replicas, "run_replicas", run_replicas)
    run_job(config, progress=False)
    return reads, started


def test_a_resume_reads_the_run_once_before_its_steps(tmp_path, monkeypatch):
    from components.data.sample import write_sample_edit_dataset
    from pipeline.local import run_job

    dataset = str(write_sample_edit_dataset(tmp_path / "edit.parquet", n=4))
    out = str(tmp_path / "runs")
    config = _config(dataset, out)
    run_job(config, progress=False)
    layout = RunLayout.open(out, RUN)
    layout.store.delete(layout.marker_key(1))  # shard 1 as an interrupted job leaves it: not committed
    manifest_files = sorted(layout.store.list(f"{RUN}/inputs/"))

    reads, started = _reads_until_the_steps_start(monkeypatch, config)

    assert started == [1]  # the resume runs the uncommitted shard only
    assert reads["inputs/manifest.json"] == 1
    assert reads["settings/ar.json"] == 1 and reads["settings/dit.json"] == 1
    assert reads["shards/0/_COMMITTED"] == 1 and reads["shards/1/_COMMITTED"] == 1
    assert reads["shards/0/rows.parquet"] == 1  # the committed shard's rows, verified against its marker
    assert sum(reads.values()) == 6, reads  # nothing else of the run
    assert sorted(layout.store.list(f"{RUN}/inputs/")) == manifest_files  # not sharded again
    assert layout.is_committed(1) and layout.verify() == []
