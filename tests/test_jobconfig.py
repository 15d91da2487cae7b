"""One job's options as one object (components/jobconfig.py): JSON and back, unknown names refused
in one line, and a job run from it (pipeline.local.run_job takes the config)."""

from __future__ import annotations

import json

import pytest

from components.errors import ConfigError
from components.jobconfig import FIELDS, GENERATION_FIELDS, JobConfig


def _config(**changes) -> JobConfig:
    return JobConfig(dataset="data.parquet", output="out", run_id="r1", **changes)


def test_a_config_goes_through_json_and_comes_back_equal():
    config = _config(kind="generate", num_shards="auto", tensor_parallel_size=2, data_parallel_size=None,
                     quantization="fp8", steps=8, guidance=2.5, top_p=0.9, greedy=True, batch_size=12,
                     kv_store="mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata",
                     ar_from_run="ref", step_cache=0.1, max_num_batched_tokens=4096)
    data = json.loads(json.dumps(config.to_dict()))
    assert sorted(data) == sorted(FIELDS)
    assert JobConfig.from_dict(data) == config
    assert JobConfig.from_dict({"dataset": "d", "output": "o", "run_id": "r"}) == JobConfig("d", "o", "r")


def test_the_generation_settings_are_one_dict():
    config = _config(steps=4, temperature=0.0)
    assert config.generation == {**dict.fromkeys(GENERATION_FIELDS), "steps": 4, "temperature": 0.0}


def test_an_unknown_name_is_refused_in_one_line_naming_it():
    with pytest.raises(ConfigError, match=r"^job config: unknown option 'stesp' \(did you mean 'steps'\?\)") as exc:
        JobConfig.from_dict({"dataset": "d", "output": "o", "run_id": "r", "stesp": 4})
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"^job config: unknown option 'progress'"):  # run_job's own argument
        _config().replace(progress=False)
    with pytest.raises(ConfigError, match=r"^job config: run_id missing; every job needs dataset, output, run_id"):
        JobConfig.from_dict({"dataset": "d", "output": "o"})


def test_replace_changes_a_copy():
    config = _config()
    other = config.replace(run_id="r2", tensor_parallel_size=2)
    assert (other.run_id, other.tensor_parallel_size) == ("r2", 2)
    assert (config.run_id, config.tensor_parallel_size) == ("r1", 1)


@pytest.mark.timeout(600)
def test_a_tiny_job_runs_from_a_config(tmp_path):
    """2 rows of the tiny model on the CPU through run_job(JobConfig(...)); the same config again is
    a finished run (resume), and a changed setting on the same run id is refused before any work."""
    from components.data.runs import RunLayout
    from components.data.sample import write_sample_edit_dataset
    from pipeline.local import run_job

    dataset = str(write_sample_edit_dataset(tmp_path / "edit.parquet", n=2, size=64))
    config = JobConfig(dataset=dataset, output=str(tmp_path / "out"), run_id="r1", num_shards=1, device="cpu",
                       steps=2, max_new_tokens=4, temperature=0.0)
    started = []
    summary = run_job(config, progress=False, on_start=lambda: started.append(True))
    assert (summary["rows_ok"], summary["rows_failed"], started) == (2, 0, [True])
    rows = RunLayout.open(config.output, "r1").read_rows(0).to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert run_job(config, progress=False)["nothing_to_do"] is True
    with pytest.raises(ConfigError, match="steps"):
        run_job(config.replace(steps=3), progress=False)
