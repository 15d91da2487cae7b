"""`ardit report OUT/RUN`: the report of a job run, from a real run directory (real shard step,
real Parquet, real PNGs; rows recorded without a model), checked as HTML and in headless Chromium."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from tests.test_cli_errors import ardit

CHROMIUM = "/usr/bin/chromium"
COT = "<think>The user wants the sky purple; keep the house.</think><recaption>a house under a purple sky</recaption>"


@pytest.fixture(scope="module")
def job_run(tmp_path_factory) -> Path:
    from components.data.datasets import write_parquet_bytes
    from components.data.runs import RunLayout
    from components.data.sample import draw_scene
    from components.shard.run import run as run_shard
    from components.summary.run import run as run_summary

    import random

    d = tmp_path_factory.mktemp("jobrun")
    rng = random.Random(3)
    rows = [{"id": f"row-{i}", "instruction": f"make the sky colour number {i} & <keep> the house",
             "image": draw_scene(96, rng), "size": "auto"} for i in range(4)]
    rows.append({"id": "odd-size", "instruction": "add a rainbow", "image": draw_scene(96, rng), "size": "123x77"})
    (d / "edit.parquet").write_bytes(write_parquet_bytes(pa.Table.from_pylist(rows)))
    out = d / "out"
    run_shard(str(d / "edit.parquet"), str(out), "first", 2, "edit")
    layout = RunLayout.open(str(out), "first")
    layout.remember_settings("ar", {"model": "tiny", "bot_task": "think_recaption", "max_new_tokens": 32})
    layout.remember_settings("dit", {"model": "tiny", "steps": 8, "guidance": 5.0})
    noise = np.random.default_rng(0)
    for k in (0, 1):
        writer = layout.shard_writer(k)
        for job in writer.pending():
            if job.id == "row-3":
                writer.record_error(job.id, "DiT failed: NaN latents at step 3")
                continue
            image = Image.fromarray(noise.integers(0, 256, (512, 512, 3), dtype=np.uint8))  # big, incompressible
            writer.record_ok(job.id, image, cot_text=COT, kv_path="reuse", ar_prefill_s=0.2, ar_decode_s=1.5,
                             kv_put_s=0.01, kv_get_s=0.02, dit_total_s=3.0, vae_decode_s=0.5)
        layout.write_json(layout.step_timing_key(k, "ar"), {
            "load_s": 4.0 if k == 0 else 0.0, "wall_s": 30.0 - 10 * k,
            "scheduler": {"mean_batch": 2.0, "oom_retries": 1 - k},
            "memory": {"peak_reserved_gib": 70.2, "total_gib": 79.2, "alloc_retries": 0, "ooms": 1 - k}})
        layout.write_json(layout.step_timing_key(k, "dit"), {"load_s": 0.0, "wall_s": 40.0,
                                                             "memory": {"peak_reserved_gib": 76.3, "total_gib": 79.2,
                                                                        "alloc_retries": 12}})
        writer.commit()
    run_summary(str(out), "first")
    return out / "first"


def test_job_report_shows_what_was_asked_and_what_came_out(job_run, capfd):
    code, stdout, err = ardit(capfd, "report", str(job_run))
    assert code == 0, err
    path = job_run / "report.html"
    assert stdout.strip() == f"report: {path}"
    html = path.read_text()

    assert "<title>ardit run · first · 3/5 ok</title>" in html
    for i in range(4):  # every instruction, escaped
        assert f"make the sky colour number {i} &amp; &lt;keep&gt; the house" in html
    assert html.count("&lt;think&gt;The user wants the sky purple") == 3  # the CoT of each ok row
    # the error rows with their reasons: a validation error and a DiT failure
    errors = html[html.index("Error rows (2)"):html.index("<h2>Rows")]
    assert "odd-size" in errors and "size &#39;123x77&#39; is not supported" in errors
    assert "row-3" in errors and "DiT failed: NaN latents at step 3" in errors
    from components.report.job import ardit_version

    assert f"ardit {ardit_version()}" in html and ardit_version() != "unknown"
    # thumbnails are JPEG (inputs of the 5 rows, 3 outputs), each output links its full PNG
    assert html.count('src="data:image/jpeg;base64,') == 5 + 3
    links = sorted(set(re.findall(r'href="([^"]+\.png)"', html)))
    assert len(links) == 3 and all((path.parent / link).is_file() for link in links), links
    pngs = sum(p.stat().st_size for p in job_run.glob("shards/*/images/*.png"))
    assert len(html) < pngs / 3  # not the PNGs inlined: they are ~2.4 MB here
    # each shard's steps as a plot (the step records in summary.json), beside the time split and rows
    assert 'alt="shard steps" src="data:image/png;base64,' in html
    assert "Each shard&#39;s AR and DiT steps" in html or "Each shard's AR and DiT steps" in html
    assert "with the GPU memory peak" in html and "no GPU memory was recorded" not in html  # recorded here
    assert "KV reuse 3" in html and "{&#39;" not in html  # settings as words, not a Python dict
    # the time split includes the engine load recorded by the step
    assert '"load": 4.0' in (job_run / "summary.json").read_text()


def test_report_of_a_job_run_written_elsewhere_links_the_pngs(job_run, tmp_path):
    from components.report.job import write_job_report

    path = write_job_report(job_run, tmp_path / "elsewhere" / "r.html")  # a new directory next to nothing
    html = path.read_text()
    links = set(re.findall(r'href="([^"]+\.png)"', html))
    assert len(links) == 3 and all((path.parent / link).resolve().is_file() for link in links)


def test_report_of_a_directory_that_is_neither(capfd, tmp_path):
    code, _, err = ardit(capfd, "report", str(tmp_path))
    assert code == 2 and "not a sweep directory" in err and "nor a job run" in err


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)")
def test_job_report_renders_in_headless_chromium(job_run, tmp_path):
    pytest.importorskip("websocket", reason="websocket-client is needed to talk to Chromium")
    from components.report.browser import check_page
    from components.report.job import write_job_report

    page = check_page(write_job_report(job_run), chromium=CHROMIUM)
    assert page.title == "ardit run · first · 3/5 ok"
    assert len(page.images) == 5 + 3 + 3  # inputs, outputs, the three plots
    assert page.broken_images == [], page.broken_images
    assert page.external_urls == [] and page.console_errors == [], (page.external_urls, page.console_errors)
    shot = Image.open(io.BytesIO(page.screenshot)).convert("RGB")
    out = Path(os.environ.get("ARDIT_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    shot.save(out / "job_report.png")
    px = np.asarray(shot).astype(np.float64)
    assert shot.height > 900 and px.std() > 20  # a full page that is not blank
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 500  # images and plots drawn
