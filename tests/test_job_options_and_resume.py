"""A whole local job through the `ardit` command (tiny model, CPU, 2 shards of 2 edit rows):

- `--temperature 0` and `--top-k 0` reach the AR engine as 0 (greedy, top-k off), not the model's
  generation config (temperature 0.6, top-k 1024), and the run records them;
- `--batch-invariant` is in effect in the AR scheduler's admission while the AR step decodes (each row
  decodes alone);
- a resume finishes a shard that is not committed but already has recorded rows: the recorded row
  is kept as it was, the others are done, and the shard is committed.

What the AR engine ran with is read at `ARGenerator.stream` (the real one runs): its admission and
the sampling parameters resolved against the generation config.
"""

from __future__ import annotations

import pytest

from components.data.runs import RunLayout
from components.engine import SamplingParams, kernels
from components.engine.ar import ARGenerator
from components.engine.generation_config import tiny_generation_config
from components.generation import resolve_generation

pytestmark = pytest.mark.slow

RUN = "opts"


def _args(dataset: str, out: str) -> list[str]:
    return ["edit", dataset, "-o", out, "--run-id", RUN, "--num-shards", "2", "--model", "tiny", "--device", "cpu",
            "--steps", "2", "--guidance", "5", "--max-new-tokens", "4", "--temperature", "0", "--top-k", "0",
            "--batch-invariant"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's output and what the AR engine saw at each `stream` call."""
    from components.data.sample import write_sample_edit_dataset
    from pipeline import cli

    root = tmp_path_factory.mktemp("job")
    dataset = str(write_sample_edit_dataset(root / "edit.parquet", n=4))
    out = str(root / "runs")
    seen: list[dict] = []
    real = ARGenerator.stream

    def stream(self, requests, on_result, sampling=None, export_kv=True, admission=None):
        resolved = (sampling or SamplingParams()).resolved(self.generation_config)
        seen.append({"batch_invariant": admission is not None and admission.decodes_alone(),
                     "temperature": resolved.temperature, "top_k": resolved.top_k, "greedy": resolved.greedy,
                     "rows": len(requests)})
        return real(self, requests, on_result, sampling, export_kv, admission)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(ARGenerator, "stream", stream)
        assert cli.main(_args(dataset, out)) == 0
    return {"dataset": dataset, "out": out, "seen": seen}


def test_zero_temperature_and_top_k_are_kept_not_taken_from_the_config(job):
    gc = tiny_generation_config()
    assert gc.temperature > 0 and gc.top_k > 0  # so a fallback to the config would show
    assert job["seen"] and all(s["temperature"] == 0 and s["top_k"] == 0 and s["greedy"] for s in job["seen"])
    layout = RunLayout.open(job["out"], RUN)
    recorded = layout.read_json(layout.settings_key("ar"))
    assert (recorded["temperature"], recorded["top_k"]) == (0, 0)
    # the pieces on the way: the settings' resolution and the engine's sampling parameters
    resolved = resolve_generation("tiny", temperature=0.0, top_k=0)
    assert (resolved["temperature"], resolved["top_k"]) == (0.0, 0)
    params = SamplingParams(temperature=0.0, top_k=0).resolved(gc)
    assert (params.temperature, params.top_k, params.greedy) == (0.0, 0, True)
    assert SamplingParams().resolved(gc).top_k == gc.top_k  # None does come from the config


def test_batch_invariant_is_in_effect_while_the_ar_step_decodes(job):
    assert len(job["seen"]) == 2  # one AR step per shard
    assert all(s["batch_invariant"] is True and s["rows"] == 2 for s in job["seen"])
    assert kernels.settings().batch_invariant == "off"  # the step's setting is its own, not the process's
    layout = RunLayout.open(job["out"], RUN)
    assert layout.read_json(layout.settings_key("ar"))["batch_invariant"] is True


def test_a_resume_finishes_an_uncommitted_shard_that_has_recorded_rows(job):
    from pipeline import cli

    layout = RunLayout.open(job["out"], RUN)
    store = layout.store
    records = sorted(k for k in store.list(f"{layout.shard_prefix(1)}rows/") if k.endswith(".json"))
    assert len(records) == 2 and layout.is_committed(1)
    kept, lost = records
    kept_bytes, lost_bytes = store.get_bytes(kept), store.get_bytes(lost)
    # shard 1 as a step interrupted after its first row leaves it: one row recorded, no commit
    for key in (layout.marker_key(1), layout.rows_key(1), lost):
        store.delete(key)
    assert not layout.is_committed(1) and len(layout.completed_rows(1)) == 1

    assert cli.main(_args(job["dataset"], job["out"])) == 0
    assert layout.is_committed(1) and layout.verify() == []
    assert store.get_bytes(kept) == kept_bytes  # the recorded row was not done again
    assert store.exists(lost) and store.get_bytes(lost) != lost_bytes  # the other one was (a new record)
    rows = layout.read_rows(1).to_pylist()
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
