"""Sweep spec parsing and grid expansion."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from components.sweep.cli import make_app
from components.evaluate.gates import Thresholds
from components.sweep.spec import (
    AR_DIVERSITY,
    DETERMINISM,
    GRID,
    REFERENCE,
    REUSE_DRIFT,
    SpecError,
    load_spec,
    parse_spec,
)
from tests.fixtures_sweep import fake_runner, spec_dict

app = make_app(lambda: fake_runner)

TINY = Path(__file__).resolve().parents[1] / "examples" / "sweeps" / "tiny.yaml"


def test_tiny_example_expands_to_grid_plus_budget() -> None:
    spec = load_spec(TINY)
    names = [c.name for c in spec.configs]
    assert names == [
        "reuse-s8",
        "reuse-s4",
        "recompute-s8",
        "recompute-s4",
        "reuse-drift",
        "ar-diversity",
        "determinism",
    ]
    assert spec.reference == "reuse-s8"
    roles = {c.name: c.role for c in spec.configs}
    assert roles["reuse-s8"] == REFERENCE and roles["recompute-s8"] == GRID
    assert roles["determinism"] == DETERMINISM and roles["reuse-drift"] == REUSE_DRIFT
    assert roles["ar-diversity"] == AR_DIVERSITY
    # at least 3 configs with reuse on/off and two step counts, over >= 4 rows
    grid = [c for c in spec.configs if c.role in (REFERENCE, GRID)]
    assert {c.params["kv_reuse"] for c in grid} == {True, False}
    assert {c.params["steps"] for c in grid} == {8, 4}
    assert spec.base["dataset"]["rows"] >= 4
    assert spec.base["model"] == "tiny"


def test_tiny_example_gates() -> None:
    spec = load_spec(TINY)
    c = {x.name: x for x in spec.configs}
    assert c["recompute-s8"].gated and c["recompute-s8"].thresholds.psnr_min == 30
    assert not c["reuse-s4"].gated and not c["recompute-s4"].gated  # override gate: false
    assert not c["reuse-s8"].gated  # the reference is never gated against itself
    # the determinism floor is gated: a re-run of the reference must reproduce its pixels
    assert c["determinism"].gated and c["determinism"].thresholds == Thresholds(bitwise=True)
    assert not c["reuse-drift"].gated and not c["ar-diversity"].gated
    drift = c["reuse-drift"]
    assert drift.params["kv_reuse"] is False and drift.ar_from == "reuse-s8"
    assert c["ar-diversity"].params["seed"] == 43
    assert all(x.baseline == "reuse-s8" for x in spec.configs if x.role != REFERENCE)


def test_grid_is_the_cartesian_product_in_order() -> None:
    spec = parse_spec(spec_dict(grid={"steps": [8, 4, 2], "guidance": [5.0, 2.5]},
                                reference="s8-g5", precision_budget=False))  # fmt: skip
    assert [c.name for c in spec.configs] == ["s8-g5", "s8-g2.5", "s4-g5", "s4-g2.5", "s2-g5", "s2-g2.5"]
    assert spec.config("s4-g2.5").params | {} == {**spec.base, "steps": 4, "guidance": 2.5}
    assert spec.config("s4-g2.5").varied == {"steps": 4, "guidance": 2.5}


def test_dtype_temperature_and_seed_names() -> None:
    spec = parse_spec(spec_dict(grid={"dtype": ["bfloat16", "float32"], "temperature": [0.0, 0.7], "seed": [1]},
                                reference="bf16-t0-seed1", precision_budget=False))  # fmt: skip
    assert [c.name for c in spec.configs] == ["bf16-t0-seed1", "bf16-t0.7-seed1", "fp32-t0-seed1", "fp32-t0.7-seed1"]


def test_overrides_by_match_and_name() -> None:
    spec = parse_spec(
        spec_dict(
            overrides=[
                {"match": {"steps": 4}, "thresholds": {"psnr_min": 20, "ssim_min": None}},
                {"name": "recompute-s8", "thresholds": {"p99_abs_max": 0.1}},
            ]
        )
    )
    s4 = spec.config("reuse-s4").thresholds
    assert s4.psnr_min == 20 and s4.ssim_min is None and s4.mean_abs_max == 0.03
    r8 = spec.config("recompute-s8").thresholds
    assert r8.psnr_min == 30 and r8.p99_abs_max == 0.1


def test_explicit_extra_config_and_reference_by_name() -> None:
    spec = parse_spec(spec_dict(configs=[{"name": "greedy", "params": {"temperature": 0.0}, "thresholds": {"psnr_min": 10}}],
                                reference="reuse-s8"))  # fmt: skip
    greedy = spec.config("greedy")
    assert greedy.params["temperature"] == 0.0 and greedy.thresholds.psnr_min == 10
    assert greedy.thresholds.ssim_min == 0.97


def test_budget_can_be_gated_and_disabled() -> None:
    gated = parse_spec(
        spec_dict(precision_budget={"determinism": True, "reuse_drift": False, "ar_diversity": False, "gate": True})
    )
    assert [c.name for c in gated.configs if c.role == DETERMINISM] == ["determinism"]
    assert gated.config("determinism").gated
    assert not any(c.role in (REUSE_DRIFT, AR_DIVERSITY) for c in gated.configs)
    off = parse_spec(spec_dict(precision_budget=False))
    assert all(c.role in (REFERENCE, GRID) for c in off.configs)
    default = parse_spec(spec_dict(precision_budget=True))
    assert default.config("ar-diversity").params["seed"] == 43  # reference seed + 1
    assert default.config("determinism").thresholds == Thresholds(bitwise=True)


def test_determinism_gate_can_be_loosened_or_turned_off() -> None:
    loose = parse_spec(spec_dict(precision_budget={"determinism": {"psnr_min": 60}}))
    assert loose.config("determinism").thresholds == Thresholds(psnr_min=60)  # e.g. non-deterministic kernels
    off = parse_spec(spec_dict(precision_budget={"determinism": {"gate": False}}))
    assert not off.config("determinism").gated
    named = parse_spec(spec_dict(overrides=[{"name": "determinism", "thresholds": {"bitwise": None, "psnr_min": 50}}]))
    assert named.config("determinism").thresholds == Thresholds(psnr_min=50)
    # a match override meant for grid configs does not loosen the floor
    matched = parse_spec(spec_dict(overrides=[{"match": {"steps": 8}, "thresholds": {"psnr_min": 10}}]))
    assert matched.config("determinism").thresholds == Thresholds(bitwise=True)
    with pytest.raises(SpecError, match="no threshold left"):
        parse_spec(spec_dict(precision_budget={"determinism": {"bitwise": False}}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"grid": {"stepz": [1, 2]}}, "unknown parameter"),
        ({"grid": {"steps": []}}, "non-empty list"),
        ({"grid": {"steps": [8, 8]}}, "duplicate values"),
        ({"reference": {"steps": 8}}, "matches 2 configs"),
        ({"reference": "nope"}, "no such config"),
        ({"thresholds": {"psnr": 30}}, "unknown threshold"),
        ({"precision_budget": {"ar_diversity": {"seed": 42}}}, "must differ"),
        ({"base": {"kind": "edit"}}, "dataset is required"),
        ({"colour": "red"}, "unknown top-level"),
        ({"overrides": [{"thresholds": {}}]}, "needs 'name' or 'match'"),
        ({"configs": [{"name": "reuse-s8", "params": {}}], "reference": "reuse-s4"}, "duplicate config name"),
        ({"name": "a b"}, "use letters"),
    ],
)
def test_invalid_specs_say_why(change: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(spec_dict(**change))


def test_relative_dataset_path_is_resolved_next_to_the_spec(tmp_path) -> None:
    (tmp_path / "data.parquet").write_bytes(b"x")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec_dict(base={"dataset": "data.parquet", "steps": 8, "kv_reuse": True})))
    spec = load_spec(path)
    assert spec.base["dataset"] == str(tmp_path / "data.parquet")
    assert all(c.params["dataset"] == str(tmp_path / "data.parquet") for c in spec.configs)


def test_dry_run_prints_the_expanded_grid() -> None:
    result = CliRunner().invoke(app, ["sweep", str(TINY), "--dry-run"])
    assert result.exit_code == 0, result.output
    for name in ("reuse-s8", "recompute-s4", "determinism", "reuse-drift", "ar-diversity"):
        assert name in result.output
    assert "not gated" in result.output and "PSNR ≥ 30 dB" in result.output


def test_invalid_spec_exits_2(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase: {dataset: d}\ngrid: {steps: [1, 2]}\n")
    result = CliRunner().invoke(app, ["sweep", str(bad), "--dry-run"])
    assert result.exit_code == 2
    assert "reference" in result.output


@pytest.mark.parametrize(
    ("base", "grid", "message"),
    [
        ({"precision": "bfloat16"}, {}, "unknown parameter 'precision' (did you mean 'dtype'?)"),
        ({"tp": 2}, {}, "did you mean 'tensor_parallel_size'?"),
        ({"stesp": 4}, {}, "did you mean 'steps'?"),
        ({"dtype": "float8"}, {}, "FP8 is quantization: fp8, not a dtype"),
        ({"steps": 0}, {}, "base.steps: 0 is not valid; expected an integer >= 1"),
        ({"guidance": -1.0}, {}, "base.guidance: -1.0 is not valid"),
        ({"kv_reuse": "yes"}, {}, "true or false"),
        ({"top_p": 1.5}, {}, "(0, 1]"),
        ({}, {"quantization": ["none", "int8"]}, "grid.quantization[1]: 'int8' is not valid; expected one of ['none', 'fp8']"),
        ({}, {"tensor_parallel_size": [1, 0]}, "grid.tensor_parallel_size[1]: 0 is not valid"),
        ({}, {"steps": [8, None]}, "grid.steps[1]: null is not a value"),
        ({}, {"precision": ["bfloat16"]}, "did you mean 'dtype'?"),
    ],
)
def test_bad_parameters_and_values_are_named(base: dict, grid: dict, message: str) -> None:
    spec = spec_dict(grid=grid or {"kv_reuse": [True]}, reference=None if grid else "reuse", precision_budget=False)
    spec["base"] = {**spec["base"], **base}
    if grid:
        spec["reference"] = {k: v[0] for k, v in grid.items()}
    with pytest.raises(SpecError, match=re.escape(message)) as exc:
        parse_spec(spec)
    assert message in str(exc.value)


def test_quantization_and_tensor_parallel_axes() -> None:
    spec = parse_spec(spec_dict(grid={"quantization": ["none", "fp8"], "tensor_parallel_size": [1, 2]},
                                reference="noquant-tp1", precision_budget=False))  # fmt: skip
    assert [c.name for c in spec.configs] == ["noquant-tp1", "noquant-tp2", "fp8-tp1", "fp8-tp2"]
    assert spec.config("fp8-tp2").params["quantization"] == "fp8"
    assert spec.config("fp8-tp2").params["tensor_parallel_size"] == 2


def test_fp8_example() -> None:
    spec = load_spec(TINY.parent / "fp8.yaml")
    assert [c.name for c in spec.configs] == ["noquant", "fp8", "determinism"]
    assert spec.reference == "noquant"
    fp8 = spec.config("fp8")
    assert fp8.params["quantization"] == "fp8" and fp8.params["dtype"] == "bfloat16"
    assert fp8.gated and fp8.thresholds.psnr_min is not None


def test_generation_settings_are_left_to_the_model() -> None:
    """The examples do not pin steps/guidance in base: the job takes the model's generation config."""
    for name in ("tiny.yaml", "fp8.yaml"):
        spec = load_spec(TINY.parent / name)
        assert "steps" not in spec.base and "guidance" not in spec.base, name
    bare = parse_spec({"base": {"dataset": "d"}})
    assert bare.config("base").params == {"dataset": "d", "kind": "edit", "model": "tiny", "num_shards": 1}


def test_a_sample_dataset_pins_its_output_size(tmp_path) -> None:
    import pyarrow.parquet as pq

    from components.sweep.runner import materialize_dataset

    def spec(dataset: dict) -> dict:
        raw = spec_dict()
        raw["base"]["dataset"] = dataset
        return raw

    with pytest.raises(SpecError, match="base.dataset.output_size: size '256' is not 'auto' or 'WIDTHxHEIGHT'"):
        parse_spec(spec({"sample": "edit", "rows": 2, "output_size": "256"}))
    pinned = {"sample": "edit", "rows": 2, "size": 64, "output_size": "256x256"}
    parse_spec(spec(pinned))
    table = pq.read_table(materialize_dataset(pinned, tmp_path))
    assert table.column("size").to_pylist() == ["256x256", "256x256"]
    judged = pq.read_table(materialize_dataset({"sample": "edit", "rows": 2, "output_size": "256x256", "targets": True},
                                               tmp_path))  # fmt: skip
    assert judged.column("size").to_pylist() == ["256x256", "256x256"] and "target" in judged.column_names
    unpinned = pq.read_table(materialize_dataset({"sample": "edit", "rows": 2}, tmp_path / "auto"))
    assert "size" not in unpinned.column_names  # "auto": the model picks each row's aspect ratio
