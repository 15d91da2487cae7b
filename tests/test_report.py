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
    # 4 rows x (input + reference + 6 configs x (image + heatmap)) + colour bar + 2 plots
    assert len(tags.imgs) == 4 * (2 + 6 * 2) + 3
    plots = {"speed vs fidelity plot", "|Δ| percentile profile", "heatmap colour scale"}
    thumbs = [i for i in tags.imgs if i["alt"] not in plots]
    assert len(thumbs) == 4 * (2 + 6 * 2)
    assert all(str(i["src"]).startswith("data:image/webp;base64,") for i in thumbs)  # thumbnails
    assert all(str(i["src"]).startswith("data:image/png;base64,") for i in tags.imgs if i not in thumbs)  # plots
    assert all(i.get("alt") for i in tags.imgs)
    assert not [u for u in tags.links if re.match(r"^(https?:)?//", u)]
    assert "@import" not in html and "url(http" not in html
    # each output image links its full-size PNG, relative to the report
    pngs = [u for u in tags.links if not u.startswith("data:")]
    assert len(pngs) == 4 * (1 + 6)
    assert all(u.endswith(".png") and (sweep_dir / u).is_file() for u in pngs), pngs[:3]


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


def test_identical_delta_profiles_share_one_legend_entry_below_the_plot() -> None:
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
    assert box.y1 <= plot.y0  # the legend covers no part of the plot (below it: the figure is narrow)
    assert fig.bbox.contains(box.x0 + 1, box.y0 + 1) and fig.bbox.contains(box.x1 - 1, box.y1 - 1)  # not cut off
    markers = {line.get_marker() for line in ax.get_lines()[:3]}
    assert len(markers) == 3


def test_max_rows_limits_the_grids(sweep_dir: Path, tmp_path: Path) -> None:
    out = write_report(sweep_dir, tmp_path / "small.html", max_rows=1)
    tags = _parse(out.read_text())
    assert len(tags.imgs) == 2 + 6 * 2 + 3
    pngs = [u for u in tags.links if not u.startswith("data:")]
    assert pngs and all((tmp_path / u).is_file() for u in pngs)  # links follow the report elsewhere
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


def test_report_shows_what_each_row_asked(sweep_dir: Path) -> None:
    """The input image and the full instruction (from the reference run's inputs/) head each card."""
    ctx = build_context(sweep_dir)
    html = (sweep_dir / "report.html").read_text()
    for row in ctx["rows"]:
        assert row["instruction_label"] == "instruction"
        assert row["instruction"] == f"make row {row['id']} look like a sunset"
        assert row["input_img"].startswith("data:image/webp") and row["input_info"] == "48×32"
        assert f"input image {row['id']}" in html
    assert html.count('<div class="ask"><b>instruction</b>make row') == 4


def test_report_states_the_ardit_version_and_the_spec(sweep_dir: Path) -> None:
    from importlib.metadata import version

    html = (sweep_dir / "report.html").read_text()
    assert f"ardit <b>{version('ardit')}</b>" in html
    assert "the spec (spec.yaml)" in html and "psnr_min: 30" in html and "ar_diversity:" in html


def test_cards_mark_the_failed_metric_in_words(sweep_dir: Path) -> None:
    ctx = build_context(sweep_dir)
    cells = [c for r in ctx["rows"] for c in r["cells"] if c["config"] == "reuse-s4"]
    assert cells and all(c["badge"] == "FAIL" for c in cells)
    for c in cells:  # the fixture's blur + noise misses PSNR and SSIM
        assert [f.split()[0] for f in c["fails"]][:2] == ["PSNR", "SSIM"], c["fails"]
        assert c["psnr_cls"] == "bad" and "< 30 dB" in c["fails"][0]
    passing = [c for r in ctx["rows"] for c in r["cells"] if c["config"] == "recompute-s8"]
    assert all(c["fails"] == [] for c in passing)
    assert "✗ fails: PSNR" in (sweep_dir / "report.html").read_text()


def test_vs_ref_says_slower_or_faster_in_words(sweep_dir: Path) -> None:
    from components.report.render import speed_words

    assert speed_words(0.61) == "1.64× slower" and speed_words(2.0) == "2.00× faster"
    assert speed_words(1.001) == "same speed"
    speeds = [c["speed"]["text"] for c in build_context(sweep_dir)["configs"] if c["name"] != "reuse-s8"]
    # one run per config (and the reference's re-run): too few samples, so no ratio is a finding
    assert speeds and all(re.fullmatch(r"within noise \(n=\d+, ref n=\d+\)", t) or t == "–" for t in speeds), speeds


def test_resized_only_for_real_resizes() -> None:
    """Another aspect ratio (the seed picked it) is not a resize; the same ratio at another size is."""
    from components.report.render import OTHER_RATIO, RESIZED, _rows_ok, _size_change

    ref = {"width": 64, "height": 64}
    assert _size_change(ref, {"width": 48, "height": 80}) == OTHER_RATIO
    assert _size_change(ref, {"width": 128, "height": 128}) == RESIZED
    rec = {"rows_compared": 1, "rows": 4, "rows_size_mismatch": 3}
    assert _rows_ok(rec, {OTHER_RATIO: 3}) == "1/4 (3 other aspect ratio)"
    assert _rows_ok(rec, {OTHER_RATIO: 2, RESIZED: 1}) == "1/4 (2 other aspect ratio, 1 resized)"


def _speed_points() -> list[dict]:
    """Configs crowded on one spot, one failing, and single-sample times within the noise."""
    pts = [{"name": "reuse-s8", "time_s": 1.0, "psnr": math.inf, "status": "REF", "reliable": False}]
    pts += [{"name": f"cfg-{i}", "time_s": 1.0 + 0.002 * i, "psnr": 35.0 + 0.05 * i, "status": "PASS",
             "reliable": False} for i in range(5)]  # fmt: skip
    pts += [{"name": "few-steps", "time_s": 0.5, "psnr": 22.0, "status": "FAIL", "reliable": True},
            {"name": "other-seed", "time_s": 0.98, "psnr": 12.0, "status": "INFO", "reliable": False}]
    return pts


def test_speed_plot_shapes_legend_labels_and_noise() -> None:
    from matplotlib.markers import MarkerStyle

    from components.report.plots import STATUS_MARKERS, speed_fidelity_figure

    fig = speed_fidelity_figure(_speed_points(), 30.0)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes

    def shape(marker) -> list:
        m = MarkerStyle(marker)
        return m.get_path().transformed(m.get_transform()).vertices.round(6).tolist()

    drawn = {}  # verdict -> (shape, size, filled) of its scatter
    for coll in ax.collections:
        if not len(coll.get_offsets()):
            continue
        marker = next(k for k, v in STATUS_MARKERS.items() if shape(v) == coll.get_paths()[0].vertices.round(6).tolist())
        filled = tuple(coll.get_facecolor()[0][:3]) != (1.0, 1.0, 1.0)
        drawn.setdefault(marker, set()).add((float(coll.get_sizes()[0]), filled))
    assert set(drawn) == {"REF", "PASS", "FAIL", "INFO"}  # a shape per verdict, not colour only
    assert drawn["PASS"] == {(60.0, False)}  # single samples within the noise: hollow, not a fact
    assert drawn["FAIL"] == {(75.0, True)} and drawn["REF"] == {(170.0, True)}
    legend = {t.get_text(): h for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)}
    assert set(legend) == {"reference", "pass", "fail", "not gated", "hollow: time within noise"}
    for word, status in (("reference", "REF"), ("pass", "PASS"), ("fail", "FAIL"), ("not gated", "INFO")):
        handle = legend[word]  # the legend draws the plot's marker: same shape and size
        assert handle.get_marker() == STATUS_MARKERS[status]
        assert round(handle.get_markersize() ** 2) in {s for s, _ in drawn[status]}
    labels = [t for t in ax.texts if t.get_text() in {p["name"] for p in _speed_points()}]
    assert len(labels) == len(_speed_points())
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]  # no overprint


def test_plot_text_is_at_least_10_px_at_the_size_shown(sweep_dir: Path) -> None:
    ctx = build_context(sweep_dir)
    for plot in (ctx["speed_plot"], ctx["delta_plot"], ctx["colorbar"]):
        assert plot.min_font_px >= 10, plot.min_font_px
        assert plot.width <= 640  # fits its column at the report's width, so it is not scaled down


@pytest.mark.slow
def test_report_at_24_rows_is_small(tmp_path: Path) -> None:
    """24 rows of 512x512 images: WebP thumbnails (full-size PNGs linked) keep the page small.
    Before (inline PNG thumbnails) this report measured BASELINE_BYTES."""
    from components.sweep.runner import JobOutcome
    from tests.fixtures_sweep import fake_rows, write_run

    ids = [f"row-{i:02d}" for i in range(24)]

    def runner(params, output, run_id, ar_from):  # type: ignore[no-untyped-def]
        write_run(output, run_id, fake_rows(params, ids, 512, 512))
        return JobOutcome(ar_pinned=ar_from is not None)

    res = run_sweep(parse_spec(spec_dict()), tmp_path, "big", runner=runner, log=lambda _: None)
    size = res.report.stat().st_size
    print(f"\nreport at 24 rows: {size / 1e6:.2f} MB (inline PNG before: {BASELINE_BYTES / 1e6:.2f} MB)")
    assert size < BASELINE_BYTES / 3


# The same sweep's report with inline PNG thumbnails (ardit at 6ca3d4b, 2026-11-25): 46.0 MB.
BASELINE_BYTES = 45_987_882
