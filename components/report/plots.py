"""Images for the report: inline WebP thumbnails, |Δ| heatmaps, and matplotlib plots.

Plots are drawn at twice their CSS size (sharp on dense screens) and shown at that CSS size, so a
font of F points reads as F * CSS_DPI / 72 CSS pixels: MIN_FONT_PT keeps every text >= 10 px."""

from __future__ import annotations

import base64
import io
import math
import textwrap
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import colormaps
from matplotlib.colors import PowerNorm
from PIL import Image

from components.data.images import to_rgb

HEATMAP_CMAP = "magma"
HEATMAP_VMAX = 0.25  # |Δ| (pixels in [0, 1]) at the top of the colour scale; larger values saturate
HEATMAP_GAMMA = 0.5  # square-root scale so small drifts stay visible
THUMB_MAX = 320  # longest side of inlined images, in pixels
WEBP_QUALITY = 82  # lossy thumbnails (the full-size PNG is linked beside them)
LOSSLESS_BELOW = 200  # small images (shown pixelated, magnified) stay lossless
CSS_DPI = 100  # a figure inch is this many CSS pixels in the report
RENDER_SCALE = 2  # figures are drawn at this multiple of their CSS size
MIN_FONT_PT = 8  # = 11.1 CSS px at the figure's size
# Figures are this wide (CSS px / CSS_DPI inches): on a 390 px phone their column is ~340 px, where
# 8 pt text still reads >= 10 px; wider screens show them up to MAX_ZOOM x (drawn at 2x: still sharp).
FIG_WIDTH_IN = 3.5
MAX_ZOOM = 1.5
LABEL_CHARS = 30  # a point's label wraps to lines this long (names of configs at the same point)
LEGEND_CHARS = 38  # a legend label's line at MIN_FONT_PT fits the figure's width

PASS_COLOR = "#1a7f37"
FAIL_COLOR = "#cf222e"
INFO_COLOR = "#0969da"
REF_COLOR = "#57606a"


@dataclass(frozen=True)
class Plot:
    """A rendered figure: its data URI, CSS size and smallest text in CSS px at that size."""

    uri: str
    width: int
    height: int
    min_font_px: float

    @property
    def max_width(self) -> int:
        """The widest it is shown (CSS px): MAX_ZOOM x its size."""
        return round(self.width * MAX_ZOOM)


def webp_data_uri(image: Image.Image) -> str:
    """A thumbnail for the report: lossy WebP, or lossless for small images (shown magnified)."""
    buf = io.BytesIO()
    if max(image.size) < LOSSLESS_BELOW:
        image.save(buf, format="WEBP", lossless=True, method=6)
    else:
        image.save(buf, format="WEBP", quality=WEBP_QUALITY, method=6)
    return "data:image/webp;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def thumbnail(image: Image.Image, max_side: int = THUMB_MAX) -> Image.Image:
    image = to_rgb(image)
    w, h = image.size
    scale = max_side / max(w, h)
    if scale >= 1:
        return image
    return image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)


def _norm() -> PowerNorm:
    return PowerNorm(gamma=HEATMAP_GAMMA, vmin=0.0, vmax=HEATMAP_VMAX, clip=True)


def heatmap_image(diff: np.ndarray) -> Image.Image:
    """An H x W |Δ| map coloured with the report's fixed scale (comparable across configs)."""
    rgba = colormaps[HEATMAP_CMAP](_norm()(diff))
    return Image.fromarray((rgba[:, :, :3] * 255).round().astype(np.uint8), "RGB")


def colorbar_plot() -> Plot:
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 0.62))
    fig.subplots_adjust(left=0.04, right=0.95, bottom=0.5, top=0.95)
    sm = matplotlib.cm.ScalarMappable(norm=_norm(), cmap=HEATMAP_CMAP)
    cb = fig.colorbar(sm, cax=ax, orientation="horizontal")
    ticks = [0, 1 / 255, 4 / 255, 16 / 255, 0.125, HEATMAP_VMAX]
    cb.set_ticks(ticks)
    cb.set_ticklabels(["0", "1/255", "4/255", "16/255", "0.125", f"≥{HEATMAP_VMAX:g}"])
    cb.ax.tick_params(labelsize=MIN_FONT_PT, length=2)
    cb.outline.set_visible(False)
    return render(fig)


def min_font_pt(fig: Any) -> float:
    """The smallest font size (points) of any visible text in the figure."""
    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes) if sizes else math.inf


def render(fig: Any) -> Plot:
    """The figure as a PNG data URI drawn at RENDER_SCALE x its CSS size (CSS_DPI per inch)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=CSS_DPI * RENDER_SCALE, facecolor="white")
    w, h = fig.get_size_inches()
    smallest = min_font_pt(fig) * CSS_DPI / 72
    plt.close(fig)
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return Plot(uri, round(w * CSS_DPI), round(h * CSS_DPI), round(smallest, 1))


def _style(ax: Any) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.spines["left"].set_color("#8c959f")
    ax.spines["bottom"].set_color("#8c959f")
    ax.tick_params(colors="#424a53", labelsize=MIN_FONT_PT + 1)
    ax.grid(True, color="#eaeef2", linewidth=0.8)
    ax.set_axisbelow(True)


def status_color(status: str) -> str:
    return {"PASS": PASS_COLOR, "FAIL": FAIL_COLOR, "REF": REF_COLOR}.get(status, INFO_COLOR)


# Pass/fail is never colour alone: each verdict has its own marker, in the plot and its legend.
STATUS_MARKERS = {"REF": "*", "PASS": "o", "FAIL": "X", "INFO": "s"}
STATUS_SIZES = {"REF": 170, "PASS": 60, "FAIL": 75, "INFO": 55}
STATUS_WORDS = {"REF": "reference", "PASS": "pass", "FAIL": "fail", "INFO": "not gated"}


def _status_style(status: str, reliable: bool = True) -> dict[str, Any]:
    """Scatter keywords of one verdict; a time within the noise is drawn hollow (not a fact)."""
    key = status if status in STATUS_MARKERS else "INFO"
    color = status_color(key)
    return {"marker": STATUS_MARKERS[key], "s": STATUS_SIZES[key], "linewidth": 1.4 if not reliable else 0.8,
            "facecolors": color if reliable else "white", "edgecolors": "white" if reliable else color}


def _legend_handle(status: str, reliable: bool = True) -> Any:
    """A legend entry drawn with exactly the scatter's marker (same shape, size and fill)."""
    from matplotlib.lines import Line2D

    style = _status_style(status, reliable)
    return Line2D([], [], linestyle="none", marker=style["marker"], markersize=math.sqrt(style["s"]),
                  markerfacecolor=style["facecolors"], markeredgecolor=style["edgecolors"],
                  markeredgewidth=style["linewidth"])


def place_labels(ax: Any, anchors: list[tuple[float, float, str]], fontsize: float) -> list[Any]:
    """Annotate each (x, y, text) beside its point (right of it, or left where the axes end),
    moving a label up or down past labels already placed (and inside the axes) so no two overlap.
    Returns the annotations."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    boxes: list[Any] = []
    axes_box = ax.get_window_extent(renderer)

    fig_box = fig.bbox

    def annotate(text: str, x: float, y: float, dy: float) -> tuple[Any, Any]:
        """Right of the point; left of it where that runs off the axes; centred on it where
        neither fits the figure."""
        for dx, ha in ((8, "left"), (-8, "right"), (0, "center")):
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=fontsize,
                              color="#24292f", va="bottom", ha=ha)  # fmt: skip
            box = ann.get_window_extent(renderer)
            if ha == "center" or (box.x1 <= axes_box.x1 if ha == "left" else box.x0 >= fig_box.x0):
                break
            ann.remove()
        return ann, box

    for x, y, text in sorted(anchors, key=lambda a: (-a[1], a[0])):  # top first: the ∞ line has room above
        for step in [0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7, 8, -8]:
            ann, box = annotate(text, x, y, 3 + step * fontsize * 1.25)
            inside = box.y0 >= axes_box.y0 and box.y1 <= axes_box.y1
            if inside and not any(box.overlaps(b) for b in boxes):
                break
            ann.remove()
        else:  # no free slot: keep the first one (an overlap beats a missing label)
            ann, box = annotate(text, x, y, 3)
        placed.append(ann)
        boxes.append(box)
    return placed


def point_label(names: list[str]) -> str:
    """The label of configs drawn at one point: up to three names (the table lists them all),
    wrapped to the narrow figure."""
    shown = names if len(names) <= 3 else [*names[:2], f"+{len(names) - 2} more"]
    return textwrap.fill(", ".join(shown), LABEL_CHARS, break_on_hyphens=False)


def speed_fidelity_figure(points: list[dict[str, Any]], psnr_min: float | None) -> Any | None:
    """Scatter of time per image (x) against mean PSNR vs the reference (y), one point per config.

    points: name, time_s, time_lo, time_hi, psnr, status, reliable (whether its speed ratio to the
    reference is beyond the timing noise; hollow and without bars when not). Identical configs
    (PSNR inf) sit on a marked top line."""
    pts = [p for p in points if p.get("time_s") is not None and p.get("psnr") is not None]
    if not pts:
        return None
    finite = [p["psnr"] for p in pts if math.isfinite(p["psnr"])]
    top = (max(finite + ([psnr_min] if psnr_min else [])) + 6) if finite else (psnr_min or 40) + 10
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 4.4))
    _style(ax)
    ax.axhline(top, color="#8c959f", linestyle=":", linewidth=1)
    if psnr_min is not None:
        ax.axhline(psnr_min, color=FAIL_COLOR, linestyle="--", linewidth=1, alpha=0.7)
        ax.text(0.995, psnr_min, f"gate {psnr_min:g} dB ", transform=ax.get_yaxis_transform(),
                ha="right", va="top", fontsize=MIN_FONT_PT, color=FAIL_COLOR)  # fmt: skip
    labels: dict[tuple[float, float], list[str]] = {}
    for p in pts:
        y = p["psnr"] if math.isfinite(p["psnr"]) else top
        reliable = p["status"] == "REF" or bool(p.get("reliable", True))
        lo, hi = p.get("time_lo", p["time_s"]), p.get("time_hi", p["time_s"])
        if hi > lo and reliable:  # the spread of the config's timing samples
            ax.errorbar([p["time_s"]], [y], xerr=[[p["time_s"] - lo], [hi - p["time_s"]]], fmt="none",
                        ecolor=status_color(p["status"]), elinewidth=1.2, capsize=3, alpha=0.6, zorder=2)  # fmt: skip
        ax.scatter([p["time_s"]], [y], zorder={"REF": 5, "PASS": 4, "FAIL": 4}.get(p["status"], 3),
                   **_status_style(p["status"], reliable))  # fmt: skip
        labels.setdefault((round(p["time_s"], 4), round(y, 2)), []).append(p["name"])
    xs = [p.get("time_lo", p["time_s"]) for p in pts] + [p.get("time_hi", p["time_s"]) for p in pts]
    lo, hi = min(xs), max(xs)
    pad = (hi - lo) * 0.15 or max(hi * 0.15, 1e-3)
    ax.set_xlim(max(0.0, lo - pad), hi + pad * 3.5)
    ys = [p["psnr"] for p in pts if math.isfinite(p["psnr"])] + [top]
    low = min(ys + ([psnr_min] if psnr_min else [])) - 4
    ax.set_ylim(low, top + max(3.0, 0.14 * (top - low)))  # room above the ∞ line for its labels
    ticks = [t for t in ax.get_yticks() if low <= t <= top - 3]
    ax.set_yticks([*ticks, top], [f"{t:g}" for t in ticks] + ["∞"])  # identical configs sit on the ∞ line
    ax.set_xlabel("time per image (s, median;\nbars: sample range)", fontsize=MIN_FONT_PT + 1, color="#24292f")
    ax.set_ylabel("PSNR vs reference (dB, mean)", fontsize=MIN_FONT_PT + 1, color="#24292f")
    statuses = [s for s in STATUS_MARKERS if any(p["status"] == s for p in pts)]
    handles = [_legend_handle(s) for s in statuses]
    words = [STATUS_WORDS[s] for s in statuses]
    noisy = [p for p in pts if p["status"] != "REF" and not p.get("reliable", True)]
    if noisy:
        handles.append(_legend_handle(noisy[0]["status"], reliable=False))
        words.append("hollow: time within noise")
    ax.legend(handles, words, fontsize=MIN_FONT_PT, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.3),
              ncol=min(3, len(handles)), handletextpad=0.3, columnspacing=1.0)  # fmt: skip
    if noisy and len(noisy) == len([p for p in pts if p["status"] != "REF"]):
        ax.set_title("no speed difference is beyond the\ntiming noise (add timing.repeats)", fontsize=MIN_FONT_PT,
                     color="#9a6700")  # fmt: skip
    fig.tight_layout()
    place_labels(ax, [(x, y, point_label(names)) for (x, y), names in labels.items()], MIN_FONT_PT)
    return fig


def speed_fidelity_plot(points: list[dict[str, Any]], psnr_min: float | None) -> Plot | None:
    fig = speed_fidelity_figure(points, psnr_min)
    return None if fig is None else render(fig)


PROFILE_LABELS = ["p50", "p90", "p99", "p99.9", "max"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]
_LINESTYLES = ["-", "--", "-.", ":"]


def _merge_identical(profiles: list[dict[str, Any]]) -> list[tuple[list[str], list[float | None]]]:
    """Configs with the same profile (to 4 significant digits) become one series naming them all,
    so no line hides another."""
    groups: dict[tuple, tuple[list[str], list[float | None]]] = {}
    for p in profiles:
        key = tuple(None if v is None else float(f"{v:.4g}") for v in p["values"])
        groups.setdefault(key, ([], p["values"]))[0].append(p["name"])
    return list(groups.values())


def delta_profile_figure(profiles: list[dict[str, Any]]) -> Any | None:
    """|Δ| at p50 / p90 / p99 / p99.9 / max (worst row) per config, log scale. Identical profiles
    share one series; each series has its own marker, dash and a small sideways offset, and the
    legend sits below the plot, never over a line."""
    profiles = [p for p in profiles if p.get("values")]
    if not profiles:
        return None
    series = _merge_identical(profiles)
    # the legend sits below the plot, each label wrapped to the figure's width
    labels = [textwrap.fill(" = ".join(names) + (" (|Δ| = 0)" if all(v == 0 for v in values if v is not None) else ""),
                            LEGEND_CHARS, break_on_hyphens=False) for names, values in series]
    legend_lines = sum(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 3.0 + 0.155 * legend_lines))
    _style(ax)
    floor = 1 / 2550
    palette = plt.get_cmap("tab10")
    n = len(series)
    for i, ((names, values), label) in enumerate(zip(series, labels)):
        vals = [max(floor, v if v is not None else floor) for v in values]
        offset = (i - (n - 1) / 2) * min(0.08, 0.5 / n)
        ax.plot([x + offset for x in range(len(vals))], vals, marker=_MARKERS[i % len(_MARKERS)], markersize=4.5,
                linestyle=_LINESTYLES[(i // len(_MARKERS)) % len(_LINESTYLES)],
                linewidth=1.5, color=palette(i % 10), alpha=0.9, label=label)  # fmt: skip
    ax.set_xticks(range(len(PROFILE_LABELS)), PROFILE_LABELS)
    for level, name in ((1 / 255, "1/255"), (16 / 255, "16/255")):
        ax.axhline(level, color="#8c959f", linestyle=":", linewidth=0.9)
        ax.text(0.005, level, f" {name}", transform=ax.get_yaxis_transform(), va="bottom", fontsize=MIN_FONT_PT,
                color="#57606a")
    ax.set_yscale("log")
    ax.set_ylim(floor * 0.8, 1.2)
    ax.set_ylabel("|Δ| (pixels in [0, 1], worst row)", fontsize=MIN_FONT_PT + 1, color="#24292f")
    ax.legend(fontsize=MIN_FONT_PT, frameon=False, loc="upper left", bbox_to_anchor=(0.0, -0.1), borderaxespad=0)
    fig.tight_layout()
    return fig


def delta_profile_plot(profiles: list[dict[str, Any]]) -> Plot | None:
    fig = delta_profile_figure(profiles)
    return None if fig is None else render(fig)
