"""Both reports opened in headless Chromium at a 1360 px screen and a 390 px phone: no sideways
scrolling, a 20 000-character instruction clamped (the whole text one click away), no thumbnail
shown larger than its pixels, plot text >= 10 px, settings written as words, and every column of
the sweep's summary table (VS REF last) visible at 1360 px.

Real run directories (shard step, Parquet, PNGs; rows recorded without a model) and a real sweep
(the synthetic runner of tests/fixtures_sweep.py). Needs the Debian `chromium` package; set
ARDIT_SCREENSHOT_DIR to keep the screenshots."""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

CHROMIUM = "/usr/bin/chromium"
WIDTHS = (1360, 390)
LONG = ("make the sky purple, keep the house and the tree exactly where they are; " * 300)[:20_000]
LINES = "\n".join(f"step {i}: brighten the sky a little more" for i in range(200))
LONG_ERROR = "DiT failed: " + "NaN latents at step 3; " * 150

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)"),
    pytest.mark.slow,
]

# JavaScript probes, evaluated in this order after the page loaded (the last one clicks).
OVERFLOW_JS = """(() => {
  const clipped = e => { for (let p = e.parentElement; p && p !== document.body; p = p.parentElement)
    if (getComputedStyle(p).overflowX !== 'visible') return true; return false; };
  return Array.from(document.querySelectorAll('body *'))
    .filter(e => e.getBoundingClientRect().right > innerWidth + 0.5 && !clipped(e))
    .slice(0, 5).map(e => e.tagName + '.' + e.className + ': ' + (e.textContent || '').slice(0, 60)); })()"""
TEXT_HEIGHTS_JS = "Array.from(document.querySelectorAll('{sel}')).map(e => Math.round(e.getBoundingClientRect().height))"
FULL_TEXTS_JS = "Array.from(document.querySelectorAll('details.clamp .full')).map(e => e.textContent.length)"
EXPAND_JS = """(() => {
  const d = Array.from(document.querySelectorAll('details.clamp'))
    .find(d => d.querySelector('.full').textContent.length === 20000);
  const full = d.querySelector('.full'), before = full.checkVisibility();
  d.querySelector('summary').click();
  return {before: before, after: full.checkVisibility(), open: d.open, height: full.getBoundingClientRect().height,
          scrolls: full.scrollHeight > full.clientHeight}; })()"""


def _check(path: Path, width: int, probes: dict[str, str], name: str) -> Any:
    from components.report.browser import check_page

    page = check_page(path, width=width, chromium=CHROMIUM, probes={"overflow": OVERFLOW_JS, **probes})
    out = Path(os.environ.get("ARDIT_SCREENSHOT_DIR", path.parent))
    out.mkdir(parents=True, exist_ok=True)
    Image.open(io.BytesIO(page.screenshot)).save(out / f"{name}-{width}.png")
    assert page.broken_images == [] and page.console_errors == [], (page.broken_images, page.console_errors)
    assert not page.scrolls_sideways, (width, page.scroll_width, page.probes["overflow"])
    fonts = page.rendered_font_px()
    assert fonts and min(fonts.values()) >= 10, (width, fonts)
    return page


@pytest.fixture(scope="module")
def job_run(tmp_path_factory) -> Path:
    """A CPU run (no GPU memory recorded) with a 20 000-character instruction, a 200-line one, a
    long error, and outputs tall (128x1024), wide and tiny."""
    from components.data.datasets import write_parquet_bytes
    from components.data.runs import RunLayout
    from components.data.sample import draw_scene
    from components.shard.run import run as run_shard
    from components.summary.run import run as run_summary

    d = tmp_path_factory.mktemp("layout")
    rng = random.Random(5)
    texts = {"long-instruction": LONG, "many-lines": LINES, "tall": "make it tall", "wide": "make it wide",
             "tiny": "make it tiny", "failed": "fail please"}
    rows = [{"id": rid, "instruction": text, "image": draw_scene(96, rng), "size": "auto"} for rid, text in texts.items()]
    (d / "edit.parquet").write_bytes(write_parquet_bytes(pa.Table.from_pylist(rows)))
    out = d / "out"
    run_shard(str(d / "edit.parquet"), str(out), "cpu", 2, "edit")
    layout = RunLayout.open(str(out), "cpu")
    layout.remember_settings("ar", {"model": "tiny", "batch_invariant": False, "bot_task": "think_recaption"})
    layout.remember_settings("dit", {"model": "tiny", "steps": 8, "guidance": 5.0, "step_cache": 0.0})
    sizes = {"tall": (128, 1024), "wide": (1024, 128), "tiny": (48, 48)}
    noise = np.random.default_rng(0)
    for k in (0, 1):
        writer = layout.shard_writer(k)
        for job in writer.pending():
            if job.id == "failed":
                writer.record_error(job.id, LONG_ERROR)
                continue
            w, h = sizes.get(job.id, (256, 256))
            image = Image.fromarray(noise.integers(0, 256, (h, w, 3), dtype=np.uint8))
            writer.record_ok(job.id, image, cot_text="<think>sky</think>", kv_path="reuse", ar_prefill_s=0.2,
                             ar_decode_s=1.5, dit_total_s=3.0, vae_decode_s=0.5)
        for step in ("ar", "dit"):  # a CPU run records wall times, no GPU memory
            layout.write_json(layout.step_timing_key(k, step), {"load_s": 0.0, "wall_s": 20.0 + k})
        writer.commit()
    run_summary(str(out), "cpu")
    return out / "cpu"


def test_job_report_fits_both_widths_and_clamps_long_text(job_run: Path) -> None:
    from components.report.job import write_job_report

    path = write_job_report(job_run)
    for width in WIDTHS:
        page = _check(path, width, {
            "texts": TEXT_HEIGHTS_JS.format(sel=".card .text"), "errors": TEXT_HEIGHTS_JS.format(sel=".reason"),
            "full": FULL_TEXTS_JS, "header": "document.querySelector('.panel').innerText",
            "caption": "document.querySelector('img[alt=\"shard steps\"]').parentElement.innerText",
            "expand": EXPAND_JS,
        }, "job")  # fmt: skip
        p = page.probes
        assert len(page.images) == 6 + 3 + 3  # inputs, outputs (the 20 000 and 8 089 tokens are error rows), plots
        assert page.upscaled_images() == [], page.upscaled_images()  # the 128x1024 output included
        # the 20 000 characters and the 200 lines show a few lines each; the whole text is one click away
        assert max(p["texts"]) <= 130 and max(p["errors"]) <= 130, (width, p["texts"], p["errors"])
        assert sorted(p["full"]) == sorted([len(LINES), len(LONG_ERROR), len(LONG_ERROR), len(LONG)]), p["full"]
        assert not p["expand"]["before"] and p["expand"]["after"] and p["expand"]["open"]  # a click expands it
        assert p["expand"]["scrolls"] and p["expand"]["height"] <= 420  # in a scroll box, not a 10 000 px card
        assert page.height < (4000 if width == 1360 else 9000), page.height
        # settings as words, not Python
        assert "KV reuse 3" in p["header"] and "batch invariant off" in p["header"], p["header"]
        assert not any(word in p["header"] for word in ("{", "}", "False", "True")), p["header"]
        assert "GPU memory peak" not in p["caption"] and "no GPU memory was recorded" in p["caption"]


def _wide_runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> Any:
    """The synthetic runner, with tall 80x320 images and a 20 000-character instruction on row r0."""
    from components.sweep.runner import JobOutcome
    from tests.fixtures_sweep import fake_rows, write_run

    rows = fake_rows(params, width=80, height=320)
    rows[0]["prompt"] = LONG
    write_run(Path(output), run_id, rows, num_shards=int(params.get("num_shards", 2)))
    return JobOutcome(result={"run_id": run_id}, ar_pinned=ar_from is not None)


def test_sweep_report_fits_both_widths_and_shows_every_column(tmp_path: Path) -> None:
    from components.sweep.runner import run_sweep
    from components.sweep.spec import parse_spec
    from tests.fixtures_sweep import REF_STEPS, spec_dict

    # a long config name, three varied parameters and timing repeats: a wide summary table (VS REF
    # was 117 px behind the table's scrollbar at 1360 px before the columns could wrap)
    spec = spec_dict(grid={"kv_reuse": [True, False], "quantization": ["none", "fp8"]},
                     reference={"kv_reuse": True, "quantization": "none"}, timing={"repeats": 2},
                     configs=[{"name": "recompute-fp8-weights-on-two-gpus-tp2",
                               "params": {"kv_reuse": False, "quantization": "fp8", "tensor_parallel_size": 2}}])  # fmt: skip
    spec["base"]["steps"] = REF_STEPS
    result = run_sweep(parse_spec(spec), tmp_path, "wide", runner=_wide_runner, log=lambda _: None)
    summary_js = """(() => { const th = Array.from(document.querySelectorAll('th')).find(t => t.textContent.trim() === 'vs ref');
      const box = th.closest('.scroll'); return {right: th.getBoundingClientRect().right,
        box: box.getBoundingClientRect().right, hidden: box.scrollWidth - box.clientWidth}; })()"""
    for width in WIDTHS:
        page = _check(result.report, width, {
            "summary": summary_js, "asks": TEXT_HEIGHTS_JS.format(sel=".ask"), "full": FULL_TEXTS_JS,
            "expand": EXPAND_JS,
        }, "sweep")  # fmt: skip
        p = page.probes
        assert page.upscaled_images() == [], page.upscaled_images()  # the 80x320 thumbnails at most 1:1
        assert max(p["asks"]) <= 130 and p["full"] == [len(LONG)], (p["asks"], p["full"])
        assert not p["expand"]["before"] and p["expand"]["after"] and p["expand"]["scrolls"]
        if width == 1360:  # every column fits: VS REF is not cut off behind a scrollbar
            assert p["summary"]["hidden"] <= 0 and p["summary"]["right"] <= p["summary"]["box"] + 0.5, p["summary"]
