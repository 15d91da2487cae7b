"""`ardit report OUT/RUN` on a run whose dataset carries targets (`ardit sample-data --targets`): the
semantic judge per row (target beside the output, pass / fail with the check and its reason, PSNR
and SSIM) and a header line; a dataset without targets shows none of it. Real shard step, real
Parquet, real PNGs; the rows are recorded without a model: two with their exact target (the judge
passes them), one with its unedited source (the judge fails it) and one error row."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest


def _run(tmp_path: Path, targets: bool) -> Path:
    from components.data.runs import RunLayout
    from components.data.sample import write_sample_edit_dataset
    from components.shard.run import run as run_shard
    from components.summary.run import run as run_summary

    dataset = write_sample_edit_dataset(str(tmp_path / "edit.parquet"), n=4, size=64, targets=True)
    rows = {r["id"]: r for r in pq.read_table(dataset).to_pylist()}
    if not targets:  # the same rows without the target columns
        dataset = str(tmp_path / "plain.parquet")
        pq.write_table(pq.read_table(tmp_path / "edit.parquet").drop_columns(["target", "target_scene"]), dataset)
    out = tmp_path / "out"
    run_shard(dataset, str(out), "judged", 2, "edit")
    layout = RunLayout.open(str(out), "judged")
    from PIL import Image
    import io

    for k in (0, 1):
        writer = layout.shard_writer(k)
        for job in writer.pending():
            row = rows[job.id]
            if job.id == "edit-0003":
                writer.record_error(job.id, "DiT failed: NaN latents at step 3")
                continue
            png = row["image"] if job.id == "edit-0002" else row["target"]  # the source fails the judge
            writer.record_ok(job.id, Image.open(io.BytesIO(png)).convert("RGB"), dit_total_s=1.0)
        writer.commit()
    run_summary(str(out), "judged")
    return out / "judged"


def test_report_shows_the_judge_per_row_where_the_dataset_has_targets(tmp_path: Path) -> None:
    from components.evaluate.judge import judge_run
    from components.report.job import write_job_report

    run = _run(tmp_path, targets=True)
    html = write_job_report(run).read_text()
    results, summary = judge_run(str(tmp_path / "edit.parquet"), str(run))
    verdicts = dict(results)
    assert [rid for rid, v in results if v is not None and v.passed] == ["edit-0000", "edit-0001"]
    assert f"judge: <b>2 / 4</b> rows pass, mean PSNR <b>{summary['mean_psnr']:.1f} dB</b>" in html
    cards = {m.group(1): m.group(0) for m in re.finditer(r'<div class="card[^"]*">\s*<div class="head"><span[^>]*>'
                                                         r'([^<]+)</span>.*?(?=<div class="card|</main>)', html, re.S)}
    assert sorted(cards) == ["edit-0000", "edit-0001", "edit-0002", "edit-0003"]
    for rid in ("edit-0000", "edit-0001", "edit-0002"):
        v = verdicts[rid]
        card = cards[rid]
        assert f'alt="target {rid}"' in card and f'alt="output {rid}"' in card
        assert f"<b>{'PASS' if v.passed else 'FAIL'}</b> {v.check}" in card
        assert (f"PSNR ∞ dB" if v.psnr == float("inf") else f"PSNR {v.psnr:.1f} dB") in card
        assert f"SSIM {v.ssim:.3f}" in card
        assert v.detail.split()[0] in card  # the judge's reason in words
    assert "<b>FAIL</b> " in cards["edit-0002"]
    assert "<b>FAIL</b> · PSNR –" in cards["edit-0003"] and "no output image to judge" in cards["edit-0003"]


def test_report_without_targets_shows_no_judge(tmp_path: Path) -> None:
    from components.report.job import write_job_report

    html = write_job_report(_run(tmp_path, targets=False)).read_text()
    assert "rows pass, mean PSNR" not in html and 'alt="target ' not in html and 'class="judge' not in html
    assert 'alt="output edit-0000"' in html  # the rows are still there


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is missing (apt-get install chromium)")
def test_judged_report_fits_a_phone_and_never_upscales(tmp_path: Path) -> None:
    pytest.importorskip("websocket", reason="websocket-client is needed to talk to Chromium")
    from components.report.browser import check_page
    from components.report.job import write_job_report

    path = write_job_report(_run(tmp_path, targets=True))
    for width in (1360, 390):
        page = check_page(path, width=width, chromium="/usr/bin/chromium")
        assert page.broken_images == [] and page.console_errors == [], (page.broken_images, page.console_errors)
        assert not page.scrolls_sideways, (width, page.scroll_width)
        assert page.upscaled_images() == [], page.upscaled_images()
        assert len(page.images) == 4 + 3 + 4 + 2  # inputs, outputs, targets, plots (time split, rows)
