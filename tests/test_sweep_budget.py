"""Sweep runner, precision budget and the exit-code gate, on synthetic runs (no engine)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from components.sweep.cli import make_app
from components.sweep.runner import JobOutcome, run_sweep
from components.sweep.spec import parse_spec
from tests.fixtures_sweep import PROMPT_TOKENS, RECOMPUTE_SIGMA, fake_rows, fake_runner, spec_dict, write_run

PASSING_OVERRIDES = [{"match": {"steps": 4}, "thresholds": {"psnr_min": 20, "ssim_min": 0.4, "p99_abs_max": 0.5}}]


def _quiet(_: str) -> None:
    pass


def _table(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweeps")
    result = run_sweep(parse_spec(spec_dict()), out, "s1", runner=fake_runner, log=_quiet)
    assert result.sweep_dir == out / "s1"
    return result.sweep_dir


def test_sweep_writes_the_tables(sweep_dir: Path) -> None:
    for name in ("spec.yaml", "sweep.json", "sweep.parquet", "rows.parquet", "budget.parquet", "report.html"):
        assert (sweep_dir / name).is_file(), name
    configs = {r["config"]: r for r in _table(sweep_dir / "sweep.parquet")}
    assert list(configs) == [
        "reuse-s8",
        "reuse-s4",
        "recompute-s8",
        "recompute-s4",
        "reuse-drift",
        "ar-diversity",
        "determinism",
    ]
    rows = _table(sweep_dir / "rows.parquet")
    assert len(rows) == 4 * 7
    assert {r["config"] for r in rows} == set(configs)
    for name in configs:  # the evaluation step's per-run tables exist too
        assert (sweep_dir / "runs" / name / "metrics.parquet").is_file()
    assert configs["reuse-s8"]["role"] == "reference" and configs["reuse-s8"]["psnr_min"] == math.inf


def test_gates_pass_and_fail_per_config(sweep_dir: Path) -> None:
    configs = {r["config"]: r for r in _table(sweep_dir / "sweep.parquet")}
    # recompute adds N(0, 0.004) noise: PSNR ~ 47 dB, passes the 30 dB gate
    assert configs["recompute-s8"]["passed"] is True
    assert 44 < configs["recompute-s8"]["psnr_min"] < 52
    # 4 steps blurs and adds N(0, 0.03): ~27 dB, fails PSNR and SSIM on every row
    for name in ("reuse-s4", "recompute-s4"):
        assert configs[name]["passed"] is False
        assert any("PSNR" in v for v in configs[name]["violations"])
        assert any("SSIM" in v for v in configs[name]["violations"])
    meta = json.loads((sweep_dir / "sweep.json").read_text())
    assert meta["passed"] is False
    assert {f.split(":")[0] for f in meta["failures"]} == {"reuse-s4", "recompute-s4"}


def test_precision_budget(sweep_dir: Path) -> None:
    budget = {b["role"]: b for b in _table(sweep_dir / "budget.parquet")}
    det = budget["determinism"]
    assert det["bitwise_rows"] == 4 and det["psnr_mean"] == math.inf and det["rows_used"] == 4
    drift = budget["reuse_drift"]
    assert drift["bitwise_rows"] == 0 and drift["tokens_identical_rows"] == 4
    assert drift["psnr_mean"] == pytest.approx(20 * math.log10(1 / RECOMPUTE_SIGMA), abs=3.0)  # ~48 dB before rounding
    assert "AR outputs taken from the reference run" in drift["note"]
    assert "recompute 4/4" in drift["note"]
    div = budget["ar_diversity"]
    assert div["tokens_identical_rows"] == 0 and div["token_rows"] == 4
    assert div["first_divergence_median"] == PROMPT_TOKENS
    assert 0 < div["cot_similarity_mean"] < 1
    assert div["psnr_mean"] < 30


def test_reuse_drift_without_pinned_ar_uses_rows_with_identical_tokens(tmp_path) -> None:
    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        rows = fake_rows(params)
        if run_id == "reuse-drift":  # the AR re-ran and sampled differently on one row
            rows[1]["generated_ids"] = rows[1]["generated_ids"][:-1] + [7]
        write_run(output, run_id, rows)
        return JobOutcome(ar_pinned=False, notes=["run_job does not accept ar_from_run; not passed"])

    spec = parse_spec(
        spec_dict(
            grid={"kv_reuse": [True]}, reference="reuse", precision_budget={"determinism": False, "ar_diversity": False}
        )
    )
    run_sweep(spec, tmp_path, "s", runner=runner, log=_quiet, report=False)
    (drift,) = _table(tmp_path / "s" / "budget.parquet")
    assert drift["rows"] == 4 and drift["rows_used"] == 3
    assert "3/4 rows with identical tokens" in drift["note"]


def test_failed_run_fails_the_sweep_but_the_rest_is_reported(tmp_path) -> None:
    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        if run_id == "recompute-s8":
            raise RuntimeError("engine exploded")
        return fake_runner(params, output, run_id, ar_from)

    spec = parse_spec(spec_dict(overrides=PASSING_OVERRIDES))
    result = run_sweep(spec, tmp_path, "s", runner=runner, log=_quiet)
    assert not result.passed
    assert result.failures == ["recompute-s8: RuntimeError: engine exploded"]
    configs = {r["config"]: r for r in _table(tmp_path / "s" / "sweep.parquet")}
    assert configs["recompute-s8"]["run_error"] == "RuntimeError: engine exploded"
    assert configs["reuse-s4"]["passed"] is True
    assert "engine exploded" in (tmp_path / "s" / "runs" / "recompute-s8.error.txt").read_text()
    assert "engine exploded" in result.report.read_text()


def test_missing_rows_fail_even_an_ungated_config(tmp_path) -> None:
    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        rows = fake_rows(params)
        if run_id == "ar-diversity":
            rows = rows[:3]
        write_run(output, run_id, rows)
        return JobOutcome(ar_pinned=ar_from is not None)

    spec = parse_spec(spec_dict(overrides=PASSING_OVERRIDES))
    result = run_sweep(spec, tmp_path, "s", runner=runner, log=_quiet, report=False)
    assert [f.split(":")[0] for f in result.failures] == ["ar-diversity"]
    assert "missing_in_run" in result.failures[0]


def test_resume_keeps_finished_runs(tmp_path) -> None:
    calls: list[str] = []

    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        calls.append(run_id)
        return fake_runner(params, output, run_id, ar_from)

    spec = parse_spec(spec_dict(precision_budget={"determinism": False, "ar_diversity": False}))
    run_sweep(spec, tmp_path, "s", runner=runner, log=_quiet, report=False)
    (tmp_path / "s" / "runs" / "reuse-s4" / "summary.json").unlink()
    calls.clear()
    run_sweep(spec, tmp_path, "s", runner=runner, log=_quiet, report=False, resume=True)
    assert calls == ["reuse-s4"]
    (drift,) = _table(tmp_path / "s" / "budget.parquet")
    assert drift["note"].startswith("AR outputs taken from the reference run")  # kept from the first run


def test_a_rerun_that_does_not_reproduce_fails_the_determinism_gate(tmp_path) -> None:
    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        rows = fake_rows(params)
        if run_id == "determinism":  # one pixel of one row moves by 1/255 on the re-run
            rows[1]["image"] = rows[1]["image"].copy()
            rows[1]["image"][3, 3, 0] ^= 1
        write_run(output, run_id, rows)
        return JobOutcome(ar_pinned=ar_from is not None)

    budget_only = {"grid": {"kv_reuse": [True]}, "reference": "reuse"}
    strict = run_sweep(parse_spec(spec_dict(**budget_only)), tmp_path, "strict", runner=runner, log=_quiet, report=False)
    assert [f.split(":")[0] for f in strict.failures] == ["determinism"]
    assert "r1: not bitwise identical" in strict.failures[0]
    assert strict.verdict_line.startswith("FAIL: 1 config(s) fail (determinism)")

    loose = parse_spec(spec_dict(**budget_only, precision_budget={"determinism": {"psnr_min": 60}}))
    ok = run_sweep(loose, tmp_path, "loose", runner=runner, log=_quiet, report=False)
    assert ok.passed, ok.failures


def test_cli_and_report_use_one_verdict_vocabulary(tmp_path) -> None:
    from components.report.render import build_context

    spec = _write_spec(tmp_path)
    result = CliRunner().invoke(make_app(lambda: fake_runner), ["sweep", str(spec), "--output", str(tmp_path), "--sweep-id", "v"])
    assert result.exit_code == 1, result.output
    printed = dict(re.findall(r"^\[(\S+)\] (REF|PASS|FAIL|INFO)\b", result.output, flags=re.M))
    shown = {c["name"]: c["status"] for c in build_context(tmp_path / "v")["configs"]}
    stored = {r["config"]: r["verdict"] for r in _table(tmp_path / "v" / "sweep.parquet")}
    assert printed == shown == stored
    assert shown["reuse-s8"] == "REF" and shown["determinism"] == "PASS"
    assert shown["reuse-drift"] == shown["ar-diversity"] == "INFO"  # not gated: never called PASS
    assert "FAIL: 2 config(s) fail (reuse-s4, recompute-s4) · 2/4 gated configs pass · 2 INFO (not gated)" in result.output


def _guidance_runner(calls: list[str]):  # type: ignore[no-untyped-def]
    """Writes the guidance a run was made with into its CoT, so the test can see which run is kept."""

    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        calls.append(run_id)
        rows = fake_rows(params)
        for r in rows:
            r["cot_text"] = f"guidance {params.get('guidance')}"
        write_run(output, run_id, rows)
        return JobOutcome(ar_pinned=ar_from is not None)

    return runner


def test_resume_reruns_configs_whose_settings_changed(tmp_path) -> None:
    calls: list[str] = []
    budget = {"determinism": True, "reuse_drift": True, "ar_diversity": False}
    first = spec_dict(grid={"kv_reuse": [True]}, reference="reuse", precision_budget=budget,
                      configs=[{"name": "cfg-g", "params": {"guidance": 5.0}}])  # fmt: skip
    run_sweep(parse_spec(first), tmp_path, "s", runner=_guidance_runner(calls), log=_quiet, report=False)
    assert calls == ["reuse", "cfg-g", "reuse-drift", "determinism"]

    # guidance 5 -> 3 in one config: only that config reruns; the old run is kept aside, not relabelled
    calls.clear()
    lines: list[str] = []
    changed = {**first, "configs": [{"name": "cfg-g", "params": {"guidance": 3.0}}]}
    run_sweep(parse_spec(changed), tmp_path, "s", runner=_guidance_runner(calls), log=lines.append, resume=True,
              report=False)  # fmt: skip
    assert calls == ["cfg-g"]
    (line,) = [x for x in lines if x.startswith("[cfg-g] settings changed")]
    assert "(guidance 5.0 → 3.0): rerunning; old run moved to replaced/cfg-g-" in line
    rows = [r for r in _table(tmp_path / "s" / "rows.parquet") if r["config"] == "cfg-g"]
    assert rows and all(r["cot_similarity"] < 1 for r in rows)  # compared against the new run (guidance 3)
    kept = pq.read_table(next((tmp_path / "s" / "runs" / "cfg-g" / "shards").glob("*/rows.parquet"))).to_pylist()
    assert {r["cot_text"] for r in kept} == {"guidance 3.0"}
    assert len(list((tmp_path / "s" / "replaced").iterdir())) == 1  # nothing already written is lost
    meta = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert meta["states"]["cfg-g"]["settings"]["params"]["guidance"] == 3.0

    # a changed reference reruns what depends on it: its re-run and the run that took its AR outputs
    calls.clear()
    moved_ref = {**changed, "base": {**changed["base"], "seed": 7}}
    run_sweep(parse_spec(moved_ref), tmp_path, "s", runner=_guidance_runner(calls), log=_quiet, resume=True,
              report=False)  # fmt: skip
    assert calls == ["reuse", "cfg-g", "reuse-drift", "determinism"]

    # the same spec again: everything kept
    calls.clear()
    run_sweep(parse_spec(moved_ref), tmp_path, "s", runner=_guidance_runner(calls), log=_quiet, resume=True,
              report=False)  # fmt: skip
    assert calls == []


def test_a_run_without_recorded_settings_is_rerun_on_resume(tmp_path) -> None:
    calls: list[str] = []
    spec = parse_spec(spec_dict(grid={"kv_reuse": [True]}, reference="reuse", precision_budget=False))
    run_sweep(spec, tmp_path, "s", runner=_guidance_runner(calls), log=_quiet, report=False)
    (tmp_path / "s" / "runs" / "reuse.settings.json").unlink()  # e.g. a sweep from an older ardit
    lines: list[str] = []
    run_sweep(spec, tmp_path, "s", runner=_guidance_runner(calls), log=lines.append, resume=True, report=False)
    assert calls == ["reuse", "reuse"]
    assert any("no settings recorded with the existing run" in x for x in lines)


def test_an_existing_sweep_id_needs_resume(tmp_path) -> None:
    spec_path = _write_spec(tmp_path, precision_budget=False)
    app = make_app(lambda: fake_runner)
    args = ["sweep", str(spec_path), "--output", str(tmp_path / "out"), "--sweep-id", "s"]
    CliRunner().invoke(app, args)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2
    assert "sweep s already has runs" in again.output and "add --resume" in again.output
    assert "Traceback" not in again.output


def _write_spec(tmp_path: Path, **over: Any) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict(**over)))
    return path


def test_cli_exits_1_when_a_gate_fails_and_0_when_all_pass(tmp_path) -> None:
    app = make_app(lambda: fake_runner)
    cli = CliRunner()
    failing = cli.invoke(
        app, ["sweep", str(_write_spec(tmp_path)), "--output", str(tmp_path / "out"), "--sweep-id", "fail"]
    )
    assert failing.exit_code == 1, failing.output
    assert "FAIL reuse-s4" in failing.output
    assert (tmp_path / "out" / "fail" / "report.html").is_file()  # written before exiting

    passing = cli.invoke(app, ["sweep", str(_write_spec(tmp_path, overrides=PASSING_OVERRIDES)),
                               "--output", str(tmp_path / "out"), "--sweep-id", "pass"])  # fmt: skip
    assert passing.exit_code == 0, passing.output
    assert "PASS · 4/4 gated configs pass" in passing.output


def test_sample_dataset_is_written_into_the_sweep(tmp_path) -> None:
    seen: list[str] = []

    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        seen.append(params["dataset"])
        return fake_runner(params, output, run_id, ar_from)

    spec = parse_spec(spec_dict(base={"dataset": {"sample": "edit", "rows": 5, "size": 32}, "steps": 8, "kv_reuse": True},
                                precision_budget=False))  # fmt: skip
    run_sweep(spec, tmp_path, "s", runner=runner, log=_quiet, report=False)
    path = tmp_path / "s" / "dataset" / "sample-edit.parquet"
    assert set(seen) == {str(path)}
    table = pq.read_table(path)
    assert table.num_rows == 5 and "seed" not in table.column_names
    assert set(table.column_names) == {"id", "instruction", "image"}


def _resized_runner(resize: str):  # type: ignore[no-untyped-def]
    """Runner whose config `resize` returns row r2 at another aspect ratio (another ratio token)."""

    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        rows = fake_rows(params)
        if run_id == resize:
            rows[2]["image"] = rows[2]["image"].transpose(1, 0, 2).copy()
        write_run(output, run_id, rows)
        return JobOutcome(ar_pinned=ar_from is not None)

    return runner


def test_a_size_change_is_observed_in_ungated_configs_but_fails_gated_ones(tmp_path) -> None:
    spec = parse_spec(spec_dict(overrides=PASSING_OVERRIDES))
    ok = run_sweep(spec, tmp_path, "ungated", runner=_resized_runner("ar-diversity"), log=_quiet)
    assert ok.passed, ok.failures
    (div,) = [b for b in _table(tmp_path / "ungated" / "budget.parquet") if b["role"] == "ar_diversity"]
    assert "1 row(s) changed image size" in div["note"]
    assert div["token_rows"] == 4 and div["tokens_identical_rows"] == 0  # the AR side still compares
    html = ok.report.read_text()
    assert "other aspect ratio: 64×96 vs 96×64" in html and 'class="badge SIZE"' in html

    bad = run_sweep(spec, tmp_path, "gated", runner=_resized_runner("recompute-s8"), log=_quiet, report=False)
    assert [f.split(":")[0] for f in bad.failures] == ["recompute-s8"]
    assert "size_mismatch" in bad.failures[0]


def test_an_edited_generation_config_reruns_on_resume(tmp_path) -> None:
    """Settings the spec leaves out come from the checkpoint's generation_config.json: editing it
    changes the runs' settings as much as a spec edit does."""
    from components.engine.generation_config import GenerationConfig, tiny_generation_config, write_generation_config_file

    ckpt = tmp_path / "ckpt"
    write_generation_config_file(ckpt)
    (ckpt / "config.json").write_text("{}")  # enough for the model path to resolve as a checkpoint
    calls: list[str] = []
    spec = parse_spec(spec_dict(base={"dataset": "synthetic", "model": str(ckpt), "kv_reuse": True},
                                grid={"kv_reuse": [True]}, reference="reuse", precision_budget=False))  # fmt: skip
    run_sweep(spec, tmp_path, "s", runner=_guidance_runner(calls), log=_quiet, report=False)
    run_sweep(spec, tmp_path, "s", runner=_guidance_runner(calls), log=_quiet, report=False, resume=True)
    assert calls == ["reuse"]  # unchanged: kept
    edited = GenerationConfig.from_dict({**tiny_generation_config().to_dict(), "diff_infer_steps": 4})
    write_generation_config_file(ckpt, edited)
    lines: list[str] = []
    run_sweep(spec, tmp_path, "s", runner=_guidance_runner(calls), log=lines.append, report=False, resume=True)
    assert calls == ["reuse", "reuse"]
    assert any("the model's generation_config.json changed" in x for x in lines)
