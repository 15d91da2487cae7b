"""Images for the report: inline PNG data URIs, |Δ| heatmaps, and matplotlib plots."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import colormaps
from matplotlib.colors import PowerNorm
from PIL import Image

HEATMAP_CMAP = "magma"
HEATMAP_VMAX = 0.25  # |Δ| (pixels in [0, 1]) at the top of the colour scale; larger values saturate
HEATMAP_GAMMA = 0.5  # square-root scale so small drifts stay visible
THUMB_MAX = 320  # longest side of inlined images, in pixels

PASS_COLOR = "#1a7f37"
FAIL_COLOR = "#cf222e"
INFO_COLOR = "#0969da"
REF_COLOR = "#57606a"


def png_data_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def thumbnail(image: Image.Image, max_side: int = THUMB_MAX) -> Image.Image:
    image = image.convert("RGB")
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


def colorbar_uri() -> str:
    fig, ax = plt.subplots(figsize=(4.2, 0.55), dpi=120)
    fig.subplots_adjust(left=0.04, right=0.96, bottom=0.5, top=0.95)
    sm = matplotlib.cm.ScalarMappable(norm=_norm(), cmap=HEATMAP_CMAP)
    cb = fig.colorbar(sm, cax=ax, orientation="horizontal")
    ticks = [0, 1 / 255, 4 / 255, 16 / 255, 0.125, HEATMAP_VMAX]
    cb.set_ticks(ticks)
    cb.set_ticklabels(["0", "1/255", "4/255", "16/255", "0.125", f"≥{HEATMAP_VMAX:g}"])
    cb.ax.tick_params(labelsize=7, length=2)
    cb.outline.set_visible(False)
    return _fig_uri(fig)


def _fig_uri(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi, facecolor="white")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _style(ax: Any) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.spines["left"].set_color("#8c959f")
    ax.spines["bottom"].set_color("#8c959f")
    ax.tick_params(colors="#424a53", labelsize=8)
    ax.grid(True, color="#eaeef2", linewidth=0.8)
    ax.set_axisbelow(True)


def status_color(status: str) -> str:
    return {"PASS": PASS_COLOR, "FAIL": FAIL_COLOR, "REF": REF_COLOR}.get(status, INFO_COLOR)


def speed_fidelity_uri(points: list[dict[str, Any]], psnr_min: float | None) -> str | None:
    """Scatter of time per image (x) against mean PSNR vs the reference (y), one point per config.

    points: name, time_s, psnr, status. Identical configs (PSNR inf) sit on a marked top line.
    """
    pts = [p for p in points if p.get("time_s") is not None and p.get("psnr") is not None]
    if not pts:
        return None
    finite = [p["psnr"] for p in pts if math.isfinite(p["psnr"])]
    top = (max(finite + ([psnr_min] if psnr_min else [])) + 6) if finite else (psnr_min or 40) + 10
    fig, ax = plt.subplots(figsize=(6.4, 3.9), dpi=120)
    _style(ax)
    ax.axhline(top, color="#8c959f", linestyle=":", linewidth=1)
    if psnr_min is not None:
        ax.axhline(psnr_min, color=FAIL_COLOR, linestyle="--", linewidth=1, alpha=0.7)
        ax.text(0.995, psnr_min, f"gate {psnr_min:g} dB ", transform=ax.get_yaxis_transform(),
                ha="right", va="bottom", fontsize=7, color=FAIL_COLOR)  # fmt: skip
    labels: dict[tuple[float, float], list[str]] = {}
    for p in pts:
        y = p["psnr"] if math.isfinite(p["psnr"]) else top
        lo, hi = p.get("time_lo", p["time_s"]), p.get("time_hi", p["time_s"])
        if hi > lo:  # the spread of the config's timing samples
            ax.errorbar([p["time_s"]], [y], xerr=[[p["time_s"] - lo], [hi - p["time_s"]]], fmt="none",
                        ecolor=status_color(p["status"]), elinewidth=1.2, capsize=3, alpha=0.6, zorder=2)  # fmt: skip
        marker = "*" if p["status"] == "REF" else "o"
        ax.scatter([p["time_s"]], [y], s=130 if marker == "*" else 55, marker=marker,
                   color=status_color(p["status"]), edgecolor="white", linewidth=0.8,
                   zorder={"REF": 5, "PASS": 4, "FAIL": 4}.get(p["status"], 3))  # gated verdicts on top  # fmt: skip
        labels.setdefault((round(p["time_s"], 4), round(y, 2)), []).append(p["name"])
    for (x, y), names in labels.items():  # configs on the same spot share one label
        ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(7, 4),
                    fontsize=7.5, color="#24292f")  # fmt: skip
    xs = [p.get("time_lo", p["time_s"]) for p in pts] + [p.get("time_hi", p["time_s"]) for p in pts]
    lo, hi = min(xs), max(xs)
    pad = (hi - lo) * 0.15 or max(hi * 0.15, 1e-3)
    ax.set_xlim(max(0.0, lo - pad), hi + pad * 2.5)
    ys = [p["psnr"] for p in pts if math.isfinite(p["psnr"])] + [top]
    low = min(ys + ([psnr_min] if psnr_min else [])) - 4
    ax.set_ylim(low, top + 3)
    ticks = [t for t in ax.get_yticks() if low <= t <= top - 3]
    ax.set_yticks([*ticks, top], [f"{t:g}" for t in ticks] + ["∞"])  # identical configs sit on the ∞ line
    ax.set_xlabel("time per image (s, AR + DiT + VAE; median, bars: sample range)", fontsize=8.5, color="#24292f")
    ax.set_ylabel("PSNR vs reference (dB, mean)", fontsize=8.5, color="#24292f")
    fig.tight_layout()
    return _fig_uri(fig)


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
    legend sits beside the plot, never over a line."""
    profiles = [p for p in profiles if p.get("values")]
    if not profiles:
        return None
    series = _merge_identical(profiles)
    fig, ax = plt.subplots(figsize=(7.6, 3.9), dpi=120)
    _style(ax)
    floor = 1 / 2550
    palette = plt.get_cmap("tab10")
    n = len(series)
    for i, (names, values) in enumerate(series):
        vals = [max(floor, v if v is not None else floor) for v in values]
        offset = (i - (n - 1) / 2) * min(0.08, 0.5 / n)
        label = " = ".join(names)
        if all(v == 0 for v in values if v is not None):
            label += " (|Δ| = 0)"
        ax.plot([x + offset for x in range(len(vals))], vals, marker=_MARKERS[i % len(_MARKERS)], markersize=4.5,
                linestyle=_LINESTYLES[(i // len(_MARKERS)) % len(_LINESTYLES)],
                linewidth=1.5, color=palette(i % 10), alpha=0.9, label=label)  # fmt: skip
    ax.set_xticks(range(len(PROFILE_LABELS)), PROFILE_LABELS)
    for level, name in ((1 / 255, "1/255"), (16 / 255, "16/255")):
        ax.axhline(level, color="#8c959f", linestyle=":", linewidth=0.9)
        ax.text(0.005, level, f" {name}", transform=ax.get_yaxis_transform(), va="bottom", fontsize=7, color="#57606a")
    ax.set_yscale("log")
    ax.set_ylim(floor * 0.8, 1.2)
    ax.set_ylabel("|Δ| (pixels in [0, 1], worst row)", fontsize=8.5, color="#24292f")
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def delta_profile_uri(profiles: list[dict[str, Any]]) -> str | None:
    fig = delta_profile_figure(profiles)
    return None if fig is None else _fig_uri(fig)
