"""The AR and DiT step programs make one JobConfig, from their flags or from --config (a JobConfig's
to_dict() JSON, inline or a file), and call the step with it; --config beside a config flag, or
neither --config nor --output / --run-id, is refused in one line (exit code 2)."""

from __future__ import annotations

import json

import pytest

import components.ar.__main__ as ar_main
import components.dit.__main__ as dit_main
from components.jobconfig import JobConfig


@pytest.fixture
def called(monkeypatch) -> dict:
    """What the program hands run_step (the step's keywords), instead of running the step."""
    seen: dict = {}
    for program in (ar_main, dit_main):
        monkeypatch.setattr(program, "run_step", lambda step, kwargs, progress, **kw: seen.update(kwargs) or {})
    return seen


def _config(tmp_path, **fields) -> JobConfig:
    return JobConfig(dataset="", output=str(tmp_path), run_id="r", device="cpu", **fields)


def test_the_ar_flags_make_the_steps_config(tmp_path, called):
    argv = ["--output", str(tmp_path), "--run-id", "r", "--shard", "1", "--device", "cpu", "--batch-size", "3",
            "--max-new-tokens", "4", "--greedy", "--quantization", "none", "--kv-store", ""]
    assert ar_main.main(argv) == 0
    assert called == {"config": _config(tmp_path, batch_size=3, max_new_tokens=4, greedy=True), "shard": 1}


def test_the_dit_flags_make_the_steps_config_and_keep_its_own_switches(tmp_path, called):
    argv = ["--output", str(tmp_path), "--run-id", "r", "--shard", "0", "--device", "cpu", "--steps", "2",
            "--no-kv-reuse", "--save-latents", "--step-cache", "", "--no-prefetch"]
    assert dit_main.main(argv) == 0
    assert called == {"config": _config(tmp_path, steps=2, kv_reuse=False, save_latents=True), "shard": 0,
                      "prefetch": False}


@pytest.mark.parametrize("how", ["inline", "file"])
def test_config_gives_the_same_config_as_the_flags(tmp_path, called, how):
    """A job's whole config (dataset and all) reaches the step as it was, its device resolved."""
    config = JobConfig(dataset="data.parquet", output=str(tmp_path), run_id="r", device="cpu", steps=3, seed=7,
                       kv_reuse=False, tensor_parallel_size=1, batch_size="auto", greedy=True)
    text = json.dumps(config.to_dict())
    if how == "file":
        (tmp_path / "job.json").write_text(text)
        text = str(tmp_path / "job.json")
    assert dit_main.main(["--config", text, "--shard", "2", "--no-prefetch"]) == 0
    assert called == {"config": config, "shard": 2, "prefetch": False}


@pytest.mark.parametrize("argv,needles", [
    (["--seed", "0"], ["--config takes the whole job config: drop --seed"]),  # even at its default value
    (["--output", "o", "--steps", "2"], ["drop --output, --steps"]),
])
def test_config_beside_a_config_flag_is_refused(tmp_path, called, capsys, argv, needles):
    config = json.dumps(_config(tmp_path).to_dict())
    assert dit_main.main(["--config", config, "--shard", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(n in err for n in needles), err
    assert called == {}


@pytest.mark.parametrize("config,needles", [
    ("{not json", ["--config: not JSON"]),
    ('{"output": "o", "run_id": "r", "stesp": 2}', ["unknown option 'stesp'", "did you mean 'steps'"]),
    ("[1, 2]", ["--config: must be a JSON object"]),
    ("/no/such/job.json", ["--config /no/such/job.json: cannot read it"]),
    ('{"output": "o", "run_id": "r", "tensor_parallel_size": "2"}', ["--tensor-parallel-size '2'"]),
])
def test_a_bad_config_is_one_line(called, capsys, config, needles):
    assert ar_main.main(["--config", config, "--shard", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(n in err for n in needles), err
    assert called == {}


def test_without_config_output_and_run_id_are_required(tmp_path, called, capsys):
    assert ar_main.main(["--output", str(tmp_path), "--shard", "0"]) == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: --run-id (or --config FILE_OR_JSON)" in err, err
    assert called == {}
