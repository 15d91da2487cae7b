"""Open the report in headless Chromium: every image loads, no console errors, and the page
actually renders (a full-page screenshot that is not blank).

Needs the Debian `chromium` package; set ARDIT_SCREENSHOT_DIR to keep the screenshot."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from components.report.browser import check_page
from components.sweep.runner import run_sweep
from components.sweep.spec import parse_spec
from tests.fixtures_sweep import fake_runner, spec_dict

CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium) - cannot open the report"
)


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    pytest.importorskip("websocket", reason="websocket-client is needed to talk to Chromium")
    result = run_sweep(parse_spec(spec_dict()), tmp_path, "browser", runner=fake_runner, log=lambda _: None)
    page = check_page(result.report, chromium=CHROMIUM)

    assert page.title.startswith("ardit sweep · synthetic")
    assert len(page.images) == 4 * (2 + 6 * 2) + 3  # input, reference, 6 configs x (image + heatmap); 3 plots
    assert page.broken_images == [], page.broken_images
    assert page.external_urls == []
    assert page.console_errors == [], page.console_errors
    fonts = page.rendered_font_px()  # the plots' smallest text as the page shows it
    assert set(fonts) == {"speed vs fidelity plot", "|Δ| percentile profile", "heatmap colour scale"}
    assert min(fonts.values()) >= 10, fonts

    shot = Image.open(io.BytesIO(page.screenshot)).convert("RGB")
    out = Path(os.environ.get("ARDIT_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    shot.save(out / "report.png")
    px = np.asarray(shot).astype(np.float64)
    assert shot.width >= 1200 and shot.height >= 2000  # a full page, not just the viewport
    assert px.std() > 20  # not blank
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 500  # images and plots, not one colour
    # The verdict badge is drawn in the fail colour near the top right.
    top_right = px[: shot.height // 20, shot.width // 2 :]
    reds = (top_right[..., 0] > 180) & (top_right[..., 1] < 80) & (top_right[..., 2] < 80)
    assert reds.sum() > 20


def test_a_broken_image_is_detected(tmp_path: Path) -> None:
    """The checker itself can fail: a page with a broken image and a console error."""
    pytest.importorskip("websocket", reason="websocket-client is needed to talk to Chromium")
    page_path = tmp_path / "bad.html"
    page_path.write_text(
        "<!DOCTYPE html><html><head><title>bad</title><link rel='icon' href='data:,'></head><body>"
        "<img alt='broken' src='data:image/png;base64,AAAA'>"
        "<script>console.error('boom')</script></body></html>"
    )
    page = check_page(page_path, chromium=CHROMIUM)
    assert [i["alt"] for i in page.broken_images] == ["broken"]
    assert any("boom" in e for e in page.console_errors)
