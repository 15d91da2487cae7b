"""`--num-shards auto` (the CLI's default): every model copy gets a shard, a shard holds at most
ROWS_PER_SHARD rows, small datasets keep their 2 shards, and a resumed run keeps its sharding."""

from __future__ import annotations

import pytest

from components.errors import ConfigError
from components.jobconfig import JobConfig
from components.preflight import ROWS_PER_SHARD, auto_num_shards, check_job


@pytest.mark.parametrize("rows,dp,shards", [
    (8, 1, 2),  # the README's sample job: 2 shards, as before
    (1, 1, 1),  # never an empty shard
    (3, 8, 3),  # fewer rows than model copies: a row each
    (100, 8, 8),  # every copy busy
    (ROWS_PER_SHARD * 2, 1, 2),
    (ROWS_PER_SHARD * 3 + 1, 1, 4),  # at most ROWS_PER_SHARD rows a shard
    (10_000, 8, 157),
])
def test_auto_shards(rows, dp, shards):
    assert auto_num_shards(rows, dp) == shards


def _plan(dataset: str, output: str, run_id: str, num_shards, dp: int | None = None) -> dict:
    return check_job(JobConfig(dataset=dataset, output=output, run_id=run_id, kind="edit", num_shards=num_shards,
                               model="tiny", device="cpu", steps=2, guidance=5.0, max_new_tokens=4,
                               batch_size="auto", data_parallel_size=dp))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from components.data.sample import write_sample_edit_dataset

    return str(write_sample_edit_dataset(tmp_path_factory.mktemp("data") / "edit.parquet", n=8))


def test_auto_gives_every_model_copy_a_shard_and_a_resume_keeps_the_sharding(dataset, tmp_path):
    assert _plan(dataset, str(tmp_path), "small", "auto")["num_shards"] == 2
    assert _plan(dataset, str(tmp_path), "copies", "auto", dp=3)["num_shards"] == 3
    # a run sharded 4 ways resumes under auto with 4, whatever auto would choose now
    from components.shard.run import run as run_shard

    plan = _plan(dataset, str(tmp_path), "resumed", 4)
    count_tokens, is_supported_size, max_prompt_tokens = plan["validators"]
    run_shard(dataset, str(tmp_path), "resumed", 4, "edit", count_tokens=count_tokens,
              is_supported_size=is_supported_size, max_prompt_tokens=max_prompt_tokens)
    assert _plan(dataset, str(tmp_path), "resumed", "auto", dp=3)["num_shards"] == 4


@pytest.mark.parametrize("bad", ["many", 0, -2])
def test_a_bad_shard_count_is_refused_naming_auto(dataset, tmp_path, bad):
    from components.options import auto_or_int

    with pytest.raises(ConfigError, match="must be auto or a whole number"):
        _plan(dataset, str(tmp_path), "bad", auto_or_int(bad))
