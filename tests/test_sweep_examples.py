"""Every shipped example spec (examples/sweeps/*.yaml) through the real job runner
(pipeline.sweep.run_job_adapter -> pipeline.local.run_job: AR + DiT of the tiny model on CPU).

No stand-in runner: a spec value the job does not accept (fp8.yaml's `quantization: none` once
was one) fails its config here. To stay fast the test shrinks a spec without changing its axes:
2 dataset rows, each grid axis keeps the reference's value and one other, at most one timing
round, at most 8 denoising steps unless steps is an axis. tiny.yaml runs unshrunk in tests/test_sweep_e2e.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "sweeps"
FULL_RUN_ELSEWHERE = {"tiny.yaml"}  # tests/test_sweep_e2e.py


def shrink(spec: dict[str, Any]) -> dict[str, Any]:
    """The same sweep, smaller: 2 rows; per grid axis the reference's value and the first other one."""
    spec = copy.deepcopy(spec)
    spec["base"]["dataset"] = {**spec["base"]["dataset"], "rows": 2}
    if "steps" in spec["base"] and "steps" not in spec.get("grid", {}):
        spec["base"]["steps"] = min(spec["base"]["steps"], 8)  # not an axis: fewer denoising steps
    ref = spec.get("reference") or {}
    for axis, values in spec.get("grid", {}).items():
        keep = [ref[axis]] if axis in ref else values[:1]
        keep += [v for v in values if v not in keep][:1]
        spec["grid"][axis] = [v for v in values if v in keep]  # the spec's order
    if spec.get("timing"):
        spec["timing"] = {**spec["timing"], "repeats": min(1, spec["timing"].get("repeats", 0))}
    return spec


def test_every_example_is_covered() -> None:
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert names >= FULL_RUN_ELSEWHERE and len(names) > len(FULL_RUN_ELSEWHERE)


def test_shrink_keeps_the_axes_and_the_reference() -> None:
    spec = yaml.safe_load((EXAMPLES / "step_cache.yaml").read_text())
    small = shrink(spec)
    assert small["grid"] == {"step_cache": [0.0, 0.3]} and small["reference"] == spec["reference"]
    assert small["timing"] == {"repeats": 1} and small["base"]["dataset"]["rows"] == 2
    assert small["base"]["steps"] == 8 and spec["base"]["steps"] == 20


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(p for p in EXAMPLES.glob("*.yaml") if p.name not in FULL_RUN_ELSEWHERE),
                         ids=lambda p: p.name)
def test_example_spec_runs_through_the_real_job_runner(path: Path, tmp_path: Path) -> None:
    from components.sweep.runner import run_sweep
    from components.sweep.spec import parse_spec
    from pipeline.sweep import run_job_adapter

    raw = yaml.safe_load(path.read_text())
    spec = parse_spec(shrink(raw))
    assert set(spec.raw["grid"]) == set(raw["grid"])
    result = run_sweep(spec, tmp_path, path.stem, runner=run_job_adapter, log=lambda _: None)

    meta = json.loads((result.sweep_dir / "sweep.json").read_text())
    errors = {name: s["run_error"] for name, s in meta["states"].items() if s["run_error"]}
    assert errors == {}, errors
    for rec in result.configs:  # every row evaluated (pass or fail is the spec's business, not this test's)
        evaluated = rec["rows_compared"] + (rec.get("rows_size_mismatch") or 0)  # another ratio: no pixel metrics
        assert rec["rows"] == 2 and evaluated == 2, (rec["config"], rec.get("violations"))
        assert not rec.get("eval_error"), rec["config"]
        if raw["base"]["dataset"].get("output_size"):  # pinned: one shape, every row compared on pixels
            assert rec["rows_compared"] == 2 and not rec.get("rows_size_mismatch"), rec["config"]
    # the runs really ran with each config's settings (what the job recorded, not what was asked)
    for cfg in spec.configs:
        settings = json.loads((result.sweep_dir / "runs" / cfg.name / "settings" / "dit.json").read_text())
        for key, value in cfg.varied.items():
            if key in settings:
                assert settings[key] == (None if (key, value) == ("quantization", "none") else value), (cfg.name, key)
    if spec.timing_repeats:
        assert (result.sweep_dir / "timing" / "round1").is_dir()
    assert result.report is not None and result.report.is_file()
