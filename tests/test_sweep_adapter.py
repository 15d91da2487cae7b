"""The one seam between sweeps and pipeline.local.run_job (pipeline/sweep.py): what is passed, what is
dropped, what is an error."""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from components.sweep.runner import AR_FROM_PARAM
from pipeline.sweep import UnsupportedSetting, run_job_adapter


def _install(monkeypatch: pytest.MonkeyPatch, run_job: Any) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return run_job(*args, **kwargs)

    recording.__signature__ = inspect.signature(run_job)  # type: ignore[attr-defined]
    module = types.ModuleType("pipeline.local")
    module.run_job = recording  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pipeline.local", module)
    return calls


def test_optional_params_are_dropped_with_a_note(monkeypatch, tmp_path: Path) -> None:
    def run_job(dataset: str, output: str, run_id: str, kind: str = "edit", steps: int = 8,
                kv_reuse: bool = True, seed: int = 0) -> dict:  # fmt: skip
        return {"run_id": run_id}

    calls = _install(monkeypatch, run_job)
    out = run_job_adapter({"dataset": "d", "steps": 4, "kv_reuse": False, "save_latents": True, "weights": None},
                          tmp_path, "cfg", "ref")  # fmt: skip
    assert calls == [{"dataset": "d", "steps": 4, "kv_reuse": False, "output": str(tmp_path), "run_id": "cfg"}]
    assert out.result == {"run_id": "cfg"}
    assert out.ar_pinned is False
    assert sorted(out.notes) == sorted([f"run_job does not accept {AR_FROM_PARAM}; not passed",
                                        "run_job does not accept save_latents; not passed"])  # fmt: skip


def test_everything_is_passed_when_accepted(monkeypatch, tmp_path: Path) -> None:
    def run_job(**params: Any) -> dict:
        return {}

    calls = _install(monkeypatch, run_job)
    out = run_job_adapter({"dataset": "d", "dtype": "bfloat16", "save_latents": True}, tmp_path, "cfg", "ref")
    assert calls[0][AR_FROM_PARAM] == "ref" and calls[0]["save_latents"] is True and calls[0]["dtype"] == "bfloat16"
    assert out.ar_pinned is True and out.notes == []


def test_a_sweep_parameter_the_runner_lacks_is_an_error(monkeypatch, tmp_path: Path) -> None:
    def run_job(dataset: str, output: str, run_id: str) -> dict:
        return {}

    _install(monkeypatch, run_job)
    with pytest.raises(UnsupportedSetting, match="does not accept 'dtype'"):
        run_job_adapter({"dataset": "d", "dtype": "bfloat16"}, tmp_path, "cfg", None)


def test_quantization_and_tensor_parallel_pass_through_or_fail_clearly(monkeypatch, tmp_path: Path) -> None:
    def old_run_job(dataset: str, output: str, run_id: str, steps: int | None = None) -> dict:
        return {}

    calls = _install(monkeypatch, old_run_job)
    # Neutral values are what the job does anyway: left out for a run_job without the parameters.
    run_job_adapter({"dataset": "d", "quantization": "none", "tensor_parallel_size": 1}, tmp_path, "bf16", None)
    assert calls[-1] == {"dataset": "d", "output": str(tmp_path), "run_id": "bf16"}
    with pytest.raises(UnsupportedSetting, match="quantization=fp8 is not supported") as exc:
        run_job_adapter({"dataset": "d", "quantization": "fp8"}, tmp_path, "fp8", None)
    assert "\n" not in str(exc.value)
    with pytest.raises(UnsupportedSetting, match="tensor_parallel_size=2"):
        run_job_adapter({"dataset": "d", "tensor_parallel_size": 2}, tmp_path, "tp2", None)

    def new_run_job(dataset: str, output: str, run_id: str, quantization: str | None = None,
                    tensor_parallel_size: int = 1) -> dict:  # fmt: skip
        return {}

    calls = _install(monkeypatch, new_run_job)
    run_job_adapter({"dataset": "d", "quantization": "fp8", "tensor_parallel_size": 2}, tmp_path, "fp8-tp2", None)
    assert calls[-1]["quantization"] == "fp8" and calls[-1]["tensor_parallel_size"] == 2


def test_settings_left_to_the_model_are_not_passed(monkeypatch, tmp_path: Path) -> None:
    """A spec without steps/guidance leaves them None: run_job takes the model's generation config."""

    def run_job(dataset: str, output: str, run_id: str, steps: int | None = None, guidance: float | None = None) -> dict:
        return {}

    calls = _install(monkeypatch, run_job)
    run_job_adapter({"dataset": "d", "steps": None, "guidance": 3.0}, tmp_path, "g3", None)
    assert calls[-1] == {"dataset": "d", "guidance": 3.0, "output": str(tmp_path), "run_id": "g3"}


def test_an_fp8_sweep_before_the_engine_supports_fp8(monkeypatch, tmp_path: Path) -> None:
    """examples/sweeps/fp8.yaml against a run_job without `quantization`: the fp8 config fails in one
    recorded line, the bf16 reference and its re-run still run, and the report is written."""
    import json

    from components.sweep.runner import run_sweep
    from components.sweep.spec import load_spec
    from tests.fixtures_sweep import fake_rows, write_run

    def run_job(dataset: str, output: str, run_id: str, kind: str = "edit", model: str = "tiny", num_shards: int = 1,
                dtype: str | None = None, seed: int = 0, kv_reuse: bool = True, temperature: float | None = None,
                save_latents: bool = False) -> dict:  # fmt: skip
        write_run(Path(output), run_id, fake_rows({"seed": seed, "kv_reuse": kv_reuse}), num_shards=num_shards)
        return {"run_id": run_id}

    calls = _install(monkeypatch, run_job)
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "sweeps" / "fp8.yaml")
    result = run_sweep(spec, tmp_path, "fp8", runner=run_job_adapter, log=lambda _: None)
    assert [c["run_id"] for c in calls] == ["noquant", "determinism"]
    assert result.failures == ["fp8: UnsupportedSetting: quantization=fp8 is not supported by this ardit's job "
                               "runner yet (pipeline.local.run_job has no quantization parameter)"]  # fmt: skip
    verdicts = {c["config"]: c["verdict"] for c in result.configs}
    assert verdicts == {"noquant": "REF", "fp8": "FAIL", "determinism": "PASS"}
    states = json.loads((result.sweep_dir / "sweep.json").read_text())["states"]
    assert "\n" not in states["fp8"]["run_error"]
    assert "quantization=fp8 is not supported" in result.report.read_text()
