"""The HTML report from synthetic sweeps: self-contained, gates coloured, every section present."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from components.report.__main__ import main as report_main
from components.report.render import build_context, write_report
from components.sweep.cli import make_app
from components.sweep.runner import run_sweep
from components.sweep.spec import parse_spec
from tests.fixtures_sweep import ROW_IDS, fake_runner, spec_dict

app = make_app(lambda: fake_runner)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict[str, str | None]] = []
        self.links: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        if tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if a.get(key):
                self.links.append(str(a[key]))


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    return run_sweep(parse_spec(spec_dict()), out, "r1", runner=fake_runner, log=lambda _: None).sweep_dir


def _table(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _parse(html: str) -> _Tags:
    tags = _Tags()
    tags.feed(html)
    return tags


def test_report_is_self_contained(sweep_dir: Path) -> None:
    html = (sweep_dir / "report.html").read_text()
    tags = _parse(html)
    # 4 rows x (reference + 6 configs x (image + heatmap)) + colour bar + 2 plots
    assert len(tags.imgs) == 4 * (1 + 6 * 2) + 3
    assert all(str(i["src"]).startswith("data:image/png;base64,") for i in tags.imgs)
    assert all(i.get("alt") for i in tags.imgs)
    assert not [u for u in tags.links if re.match(r"^(https?:)?//", u)]
    assert "@import" not in html and "url(http" not in html


def test_summary_marks_gates(sweep_dir: Path) -> None:
    ctx = build_context(sweep_dir)
    assert ctx["verdict"] == "FAIL"
    status = {c["name"]: c["status"] for c in ctx["configs"]}
    assert status == {
        "reuse-s8": "REF", "reuse-s4": "FAIL", "recompute-s8": "PASS", "recompute-s4": "FAIL",
        "determinism": "PASS", "reuse-drift": "INFO", "ar-diversity": "INFO",
    }  # fmt: skip
    cls = {c["name"]: c["cls"] for c in ctx["configs"]}
    assert cls["reuse-s4"]["psnr"] == "bad" and cls["reuse-s4"]["ssim"] == "bad"
    assert cls["recompute-s8"]["psnr"] == "good"
    assert cls["determinism"]["bitwise"] == "good" and cls["recompute-s8"]["bitwise"] == ""
    assert cls["ar-diversity"]["psnr"] == ""  # ungated: no colour
    assert (ctx["n_gated"], ctx["n_gated_pass"]) == (4, 2)
    html = (sweep_dir / "report.html").read_text()
    assert 'class="verdict FAIL"' in html
    assert html.count('class="badge FAIL"') >= 2


def test_rows_are_worst_first_and_all_sections_render(sweep_dir: Path) -> None:
    ctx = build_context(sweep_dir)
    assert sorted(r["id"] for r in ctx["rows"]) == sorted(ROW_IDS)
    rows = _table(sweep_dir / "rows.parquet")
    gated = [r["config"] for r in _table(sweep_dir / "sweep.parquet") if r["gated"]]
    ranked = [min(r["psnr"] for r in rows if r["id"] == row["id"] and r["config"] in gated) for row in ctx["rows"]]
    assert ranked == sorted(ranked)  # ranked by the gated configs' PSNR
    assert ctx["speed_plot"] and ctx["delta_plot"]
    budget = {b["config"]: b for b in ctx["budget"]}
    assert budget["determinism"]["bitwise"] == "4/4" and budget["determinism"]["psnr_mean"] == "∞"
    assert budget["ar-diversity"]["div"] == "token 5"
    html = (sweep_dir / "report.html").read_text()
    for text in ("Precision budget", "Speed and fidelity", "Determinism floor", "KV reuse drift", "AR diversity"):
        assert text in html


def test_worst_label_covers_every_config_shown_under_it(sweep_dir: Path) -> None:
    """The label names the lowest PSNR of the row over all configs in the strip, ungated ones
    included (here the seed change), and then the worst gated one."""
    rows = _table(sweep_dir / "rows.parquet")
    gated = {r["config"] for r in _table(sweep_dir / "sweep.parquet") if r["gated"]}
    for row in build_context(sweep_dir)["rows"]:
        cells = {r["config"]: r["psnr"] for r in rows if r["id"] == row["id"] and r["config"] != "reuse-s8"}
        finite = {k: v for k, v in cells.items() if v is not None and math.isfinite(v)}
        worst = min(finite, key=finite.get)
        worst_gated = min((k for k in finite if k in gated), key=finite.get)
        assert worst == "ar-diversity" and worst not in gated  # another seed: another image
        assert row["worst"] == (f"{finite[worst]:.2f} dB (ar-diversity, not gated) · "
                                f"worst gated {finite[worst_gated]:.2f} dB ({worst_gated})")  # fmt: skip


def test_identical_delta_profiles_share_one_legend_entry_beside_the_plot() -> None:
    from components.report.plots import delta_profile_figure

    v = [0.01, 0.03, 0.1, 0.2, 0.3]
    fig = delta_profile_figure([
        {"name": "determinism", "values": [0.0] * 5}, {"name": "recompute-s8", "values": v},
        {"name": "reuse-drift", "values": list(v)}, {"name": "reuse-s4", "values": [0.02, 0.05, 0.2, 0.3, 0.5]},
    ])  # fmt: skip
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "determinism (|Δ| = 0)", "recompute-s8 = reuse-drift", "reuse-s4"
    ]  # fmt: skip
    assert len(ax.get_lines()) - 2 == 3  # three series (+ the two reference levels)
    box, plot = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert box.x0 >= plot.x1  # the legend covers no part of the plot
    assert fig.bbox.contains(box.x1 - 1, box.y0 + 1)  # and is not cut off
    markers = {line.get_marker() for line in ax.get_lines()[:3]}
    assert len(markers) == 3


def test_max_rows_limits_the_grids(sweep_dir: Path, tmp_path: Path) -> None:
    out = write_report(sweep_dir, tmp_path / "small.html", max_rows=1)
    tags = _parse(out.read_text())
    assert len(tags.imgs) == 1 + 6 * 2 + 3
    assert "1 of 4 rows" in out.read_text()


def test_report_command_and_step(sweep_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "cli.html"
    result = CliRunner().invoke(app, ["report", str(sweep_dir), "--out", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_text().startswith("<!DOCTYPE html>")
    step_target = tmp_path / "step.html"
    assert report_main(["--sweep-dir", str(sweep_dir), "--out", str(step_target)]) == 0
    assert step_target.is_file()


def test_report_on_a_non_sweep_directory_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a sweep directory" in result.output


def test_report_shows_failed_rows(tmp_path: Path) -> None:
    from components.sweep.runner import JobOutcome
    from tests.fixtures_sweep import fake_rows, write_run

    def runner(params, output, run_id, ar_from):  # type: ignore[no-untyped-def]
        rows = fake_rows(params)
        if run_id == "recompute-s8":
            rows[0]["status"], rows[0]["error"] = "error", "NaN latents"
        write_run(output, run_id, rows)
        return JobOutcome(ar_pinned=ar_from is not None)

    res = run_sweep(parse_spec(spec_dict(precision_budget=False)), tmp_path, "f", runner=runner, log=lambda _: None)
    ctx = build_context(res.sweep_dir)
    first = ctx["rows"][0]
    assert first["id"] == "r0"  # rows that failed come first
    cell = next(c for c in first["cells"] if c["config"] == "recompute-s8")
    assert "NaN latents" in cell["error"]
    assert "NaN latents" in res.report.read_text()
