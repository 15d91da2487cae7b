"""Time per image that means something: samples, a measured noise, ratios marked when within it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from components.report.render import build_context
from components.sweep.runner import JobOutcome, run_sweep
from components.sweep.spec import SpecError, parse_spec
from components.sweep.timing import NO_ESTIMATE, timing_summary
from tests.fixtures_sweep import fake_rows, spec_dict, write_run


def test_noise_is_the_largest_spread_and_ratios_within_it_are_unreliable() -> None:
    # the busy machine of the issue: the reference took 18.7 s, its re-run at the end 52.9 s
    s = timing_summary({"ref": [18.7, 52.9], "fast": [10.0], "similar": [30.0]}, "ref")
    assert s["noise"] == pytest.approx((52.9 - 18.7) / 18.7)
    ref = s["configs"]["ref"]
    assert ref["median"] == pytest.approx(35.8)
    fast, similar = s["configs"]["fast"], s["configs"]["similar"]
    assert fast["speedup"] == pytest.approx(3.58) and not fast["speedup_reliable"]  # 1 and 2 samples: no finding
    assert fast["speedup_note"].startswith("within noise (n=1, ref n=2): fewer than 3")
    assert similar["speedup"] == pytest.approx(35.8 / 30) and not similar["speedup_reliable"]
    assert "ref timed 2× per image: 18.7 s, 52.9 s" in s["noise_from"]


def test_a_speed_ratio_is_a_finding_only_with_three_samples_per_arm_and_outside_the_noise() -> None:
    from components.sweep.timing import speed_finding

    # too few samples: a 2x difference from 2 samples per arm is no finding
    ok, note = speed_finding([1.0, 1.01], [2.0, 2.02], noise=0.01)
    assert not ok and note.startswith("within noise (n=2, ref n=2): fewer than 3 timing samples per arm")
    # 3 samples per arm, but the ranges overlap (the ratio from the samples spans 1)
    ok, note = speed_finding([1.0, 1.3, 1.6], [1.5, 1.55, 1.7], noise=0.6)
    assert not ok and "within noise (n=3, ref n=3): the ratio from the samples spans 0.94–1.70, which includes 1" in note
    # 3 samples per arm, ranges apart, but the medians closer than the machine's noise
    ok, note = speed_finding([1.0, 1.02, 1.04], [1.1, 1.12, 1.14], noise=0.5)
    assert not ok and "differs by 9.8%, noise ±50%" in note
    # a clear difference: 3 samples each, ranges apart, beyond the noise
    ok, note = speed_finding([1.0, 1.02, 1.04], [2.0, 2.05, 2.1], noise=0.04)
    assert ok and note.startswith("differs by 101%, more than the timing noise ±4.0% (n=3, ref n=3, ratio 1.92–2.10)")
    # and in the report's cell: the words only for the finding
    s = timing_summary({"ref": [2.0, 2.05, 2.1], "fast": [1.0, 1.02, 1.04], "few": [1.0, 1.01]}, "ref")
    from components.report.render import _timing_cells

    cell = {n: _timing_cells({"config": n, "speedup_vs_ref": c["speedup"], "speedup_reliable": c["speedup_reliable"],
                              "speedup_note": c["speedup_note"], "time_per_image_s_median": c["median"]}, "ref")[2]
            for n, c in s["configs"].items()}  # fmt: skip
    assert cell["fast"]["text"] == "2.01× faster" and cell["fast"]["cls"] == ""
    assert cell["few"] == {"text": "within noise (n=2, ref n=3)", "cls": "noisy",
                           "title": "2.04× faster; within noise (n=2, ref n=3): fewer than 3 timing samples per arm"}


def test_single_samples_give_no_noise_estimate() -> None:
    s = timing_summary({"ref": [1.0], "a": [0.5]}, "ref")
    assert s["noise"] is None
    assert s["configs"]["a"]["speedup"] == 2.0 and not s["configs"]["a"]["speedup_reliable"]
    assert s["configs"]["a"]["speedup_note"].startswith("within noise (n=1, ref n=1)")


def _runner(calls: list[str], drift: float = 0.0, slow: str = "", factor: float = 2.0):  # type: ignore[no-untyped-def]
    """Each run's stage timings grow by `drift` per run already made (a machine getting busier);
    config `slow` is really `factor`x slower."""

    def runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
        scale = (1 + drift * len(calls)) * (factor if run_id == slow else 1.0)
        calls.append(run_id)
        rows = fake_rows(params)
        for r in rows:
            r["timings"] = {k: v * scale for k, v in r["timings"].items()}
        write_run(output, run_id, rows)
        return JobOutcome(ar_pinned=ar_from is not None)

    return runner


def _spec(**over: Any) -> dict[str, Any]:
    return spec_dict(grid={"kv_reuse": [True, False]}, reference="reuse",
                     precision_budget={"determinism": True, "reuse_drift": False, "ar_diversity": False}, **over)  # fmt: skip


def test_a_drifting_machine_marks_the_speed_ratio_as_noise(tmp_path: Path) -> None:
    calls: list[str] = []
    lines: list[str] = []
    result = run_sweep(parse_spec(_spec()), tmp_path, "drift", runner=_runner(calls, drift=0.4), log=lines.append)
    assert calls == ["reuse", "recompute", "determinism"]  # the re-run brackets the sweep
    configs = {c["config"]: c for c in result.configs}
    assert len(configs["reuse"]["time_samples"]) == 2  # its run and its determinism re-run
    assert configs["reuse"]["time_spread"] == pytest.approx(0.8)
    assert configs["recompute"]["speedup_reliable"] is False
    assert any(x.startswith("timing noise ±80%") for x in lines)

    ctx = build_context(result.sweep_dir)
    speed = {c["name"]: c["speed"] for c in ctx["configs"]}
    assert speed["recompute"]["text"] == "within noise (n=1, ref n=2)" and speed["recompute"]["cls"] == "noisy"
    assert "fewer than 3 timing samples per arm" in speed["recompute"]["title"]
    assert ctx["timing_warn"] and "±80%" in ctx["timing_line"]
    assert "±80%" in result.report.read_text()


def test_without_a_rerun_speed_is_marked_unreliable(tmp_path: Path) -> None:
    spec = parse_spec(spec_dict(grid={"kv_reuse": [True, False]}, reference="reuse", precision_budget=False))
    result = run_sweep(spec, tmp_path, "bare", runner=_runner([]), log=lambda _: None)
    ctx = build_context(result.sweep_dir)
    assert {c["name"]: c["speed"]["text"][0] for c in ctx["configs"]} == {"reuse": "r", "recompute": "w"}
    assert NO_ESTIMATE in ctx["timing_line"] and ctx["timing_warn"]


def test_interleaved_repeats_measure_a_real_difference(tmp_path: Path) -> None:
    calls: list[str] = []
    spec = parse_spec(_spec(timing={"repeats": 2}))
    result = run_sweep(spec, tmp_path, "rep", runner=_runner(calls, slow="recompute"), log=lambda _: None)
    # round-robin: every round runs every config once, so a drift would touch them alike
    assert calls == ["reuse", "recompute", "determinism", "reuse", "recompute", "reuse", "recompute"]
    assert (tmp_path / "rep" / "timing" / "round2" / "recompute" / "summary.json").is_file()
    configs = {c["config"]: c for c in result.configs}
    assert len(configs["reuse"]["time_samples"]) == 4 and len(configs["recompute"]["time_samples"]) == 3
    slow = configs["recompute"]
    assert slow["time_spread"] == 0.0 and slow["speedup_reliable"] is True
    ref_t = configs["reuse"]["time_per_image_s_median"]
    assert slow["speedup_vs_ref"] == pytest.approx(ref_t / slow["time_per_image_s_median"])
    assert math.isclose(slow["speedup_vs_ref"], (0.12 + 0.30 + 0.384 + 0.05) / (2 * (0.12 + 0.30 + 0.48 + 0.05)))
    speed = {c["name"]: c["speed"] for c in build_context(result.sweep_dir)["configs"]}
    from components.report.render import speed_words

    r = slow["speedup_vs_ref"]
    assert speed["recompute"] == {"text": speed_words(slow["speedup_vs_ref"]), "cls": "",
                                  "title": f"differs by 122%, more than the timing noise ±0.0% (n=3, ref n=4, ratio {r:.2f}–{r:.2f})"}  # fmt: skip

    calls.clear()  # resumed with the same spec: the timing rounds are kept too
    run_sweep(spec, tmp_path, "rep", runner=_runner(calls, slow="recompute"), log=lambda _: None, resume=True,
              report=False)  # fmt: skip
    assert calls == []


def test_timing_spec_is_checked() -> None:
    with pytest.raises(SpecError, match="timing.repeats: -1 is not valid"):
        parse_spec(_spec(timing={"repeats": -1}))
    with pytest.raises(SpecError, match="timing: unknown key 'repeat'"):
        parse_spec(_spec(timing={"repeat": 2}))
