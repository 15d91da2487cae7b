"""The one seam between sweeps and pipeline.local.run_job (pipeline/sweep.py): a config's params
become one JobConfig; what is left out, what is added, what is an error."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from components.errors import ConfigError
from components.jobconfig import JobConfig
from pipeline.sweep import UnsupportedSetting, run_job_adapter


def _install(monkeypatch: pytest.MonkeyPatch, body: Callable[[JobConfig], dict] | None = None) -> list[JobConfig]:
    """A pipeline.local whose run_job records the configs it is given (and runs `body` on them)."""
    calls: list[JobConfig] = []

    def run_job(config: JobConfig, *, progress: bool | str = "auto", on_start: Any = None) -> dict:
        calls.append(config)
        return body(config) if body is not None else {"run_id": config.run_id}

    module = types.ModuleType("pipeline.local")
    module.run_job = run_job  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pipeline.local", module)
    return calls


def test_a_configs_params_become_one_job_config(monkeypatch, tmp_path: Path) -> None:
    calls = _install(monkeypatch)
    out = run_job_adapter({"dataset": "d", "steps": 4, "kv_reuse": False, "save_latents": True, "weights": None},
                          tmp_path, "cfg", "ref")  # fmt: skip
    assert calls == [JobConfig(dataset="d", output=str(tmp_path), run_id="cfg", steps=4, kv_reuse=False,
                               save_latents=True, ar_from_run="ref", data_parallel_size=1)]  # fmt: skip
    assert out.result == {"run_id": "cfg"} and out.ar_pinned is True and out.notes == []


def test_settings_left_to_the_model_are_not_passed(monkeypatch, tmp_path: Path) -> None:
    """A spec without steps/guidance leaves them None: the job takes the model's generation config."""
    calls = _install(monkeypatch)
    out = run_job_adapter({"dataset": "d", "steps": None, "guidance": 3.0, "quantization": "none"}, tmp_path, "g3",
                          None)  # fmt: skip
    (config,) = calls
    assert config.steps is None and config.guidance == 3.0 and config.ar_from_run is None
    assert config.quantization == "none"  # run_job reads it as no quantization, as `ardit edit` does
    assert config.data_parallel_size == 1  # one model copy per config: its timings compare configs
    assert out.ar_pinned is False


def test_a_sweep_parameter_the_job_config_lacks_is_one_line(monkeypatch, tmp_path: Path) -> None:
    calls = _install(monkeypatch)
    with pytest.raises(UnsupportedSetting, match=r"unknown option 'dtpye' \(did you mean 'dtype'\?\)") as exc:
        run_job_adapter({"dataset": "d", "dtpye": "bfloat16"}, tmp_path, "cfg", None)
    assert "\n" not in str(exc.value) and calls == []


def test_a_failing_config_is_one_recorded_line_and_the_sweep_goes_on(monkeypatch, tmp_path: Path) -> None:
    """examples/sweeps/fp8.yaml with a job runner that refuses fp8: the fp8 config fails in one
    recorded line, the bf16 reference and its re-run still run, and the report is written."""
    import json

    from components.sweep.runner import run_sweep
    from components.sweep.spec import load_spec
    from tests.fixtures_sweep import fake_rows, write_run

    def body(config: JobConfig) -> dict:
        if config.quantization == "fp8":
            raise ConfigError("--quantization fp8: not on this machine")
        write_run(Path(config.output), config.run_id, fake_rows({"seed": config.seed, "kv_reuse": config.kv_reuse}),
                  num_shards=config.num_shards)  # fmt: skip
        return {"run_id": config.run_id}

    calls = _install(monkeypatch, body)
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "sweeps" / "fp8.yaml")
    result = run_sweep(spec, tmp_path, "fp8", runner=run_job_adapter, log=lambda _: None)
    assert sorted(c.run_id for c in calls) == ["determinism", "fp8", "noquant"]
    assert result.failures == ["fp8: ConfigError: --quantization fp8: not on this machine"]
    verdicts = {c["config"]: c["verdict"] for c in result.configs}
    assert verdicts == {"noquant": "REF", "fp8": "FAIL", "determinism": "PASS"}
    states = json.loads((result.sweep_dir / "sweep.json").read_text())["states"]
    assert "\n" not in states["fp8"]["run_error"]
    assert "not on this machine" in result.report.read_text()
