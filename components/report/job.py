"""The HTML report of one job run (`ardit report OUT/RUN`): what was asked and what came out.

    header       run id, kind, dataset, model and settings (settings/{ar,dit}.json), ardit version
    facts        rows ok / failed / pending, images per minute, wall time
    plots        where the time went (summary.json's time_split_s), seconds per image by row, and
                 each shard's AR and DiT steps with their GPU memory peaks and retries where recorded
                 (shards[].steps)
    errors       every error row with its reason
    judge        where the run's dataset carries targets (`ardit sample-data --targets`): a header
                 line with the semantic judge's pass count and mean PSNR, and per row the target
                 beside the output with pass / fail, the judge's check and reason, PSNR and SSIM
    grid         per row: the input image and instruction (edit) or the prompt (generate), the
                 output image and the CoT text

Images are JPEG thumbnails inlined in the page, each linking to its full-size PNG (a relative link
into the run directory), so the page stays small at any row count; they are never shown larger
than their pixels. A long instruction shows its start and expands on click. The page fits a 390 px
phone without sideways scrolling. No scripts, no network.
"""

from __future__ import annotations

import base64
import io
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from PIL import Image

from components.data.images import to_rgb
from components.data.runs import RunLayout
from components.report import plots
from components.report.text import environment, setting_name, setting_value

THUMB_QUALITY = 82


def is_job_run(path: str | Path) -> bool:
    """A job run directory (OUT/RUN): it has the shard step's manifest."""
    return (Path(path) / "inputs" / "manifest.json").is_file()


def ardit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ardit")
    except PackageNotFoundError:
        return "unknown"


def jpeg_data_uri(image: Image.Image, max_side: int = plots.THUMB_MAX) -> str:
    buf = io.BytesIO()
    plots.thumbnail(image, max_side).save(buf, format="JPEG", quality=THUMB_QUALITY, optimize=True)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _thumb(data: bytes | None) -> str | None:
    if not data:
        return None
    try:
        with Image.open(io.BytesIO(data)) as im:
            return jpeg_data_uri(to_rgb(im))
    except Exception:  # noqa: BLE001 - an undecodable input is shown as missing (its row says why)
        return None


def _secs(v: Any) -> str:
    return "–" if v is None else (f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s")


def time_split_plot(split: dict[str, float | None]) -> plots.Plot | None:
    """Horizontal bars: seconds spent loading the engine, in the AR, KV, DiT steps and elsewhere."""
    order = ["load", "ar", "kv", "dit", "other"]  # summary.json keeps its keys sorted
    parts = [(k, split[k]) for k in sorted(split, key=lambda k: (order + [k]).index(k)) if split[k] is not None]
    if not parts:
        return None
    fig, ax = plots.plt.subplots(figsize=(plots.FIG_WIDTH_IN, 0.7 + 0.36 * len(parts)))
    plots._style(ax)
    names = [k for k, _ in parts][::-1]
    values = [v for _, v in parts][::-1]
    bars = ax.barh(names, values, color=plots.INFO_COLOR, height=0.6)
    total = sum(values) or 1.0
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.1f} s ({v / total:.0%})",
                va="center", fontsize=plots.MIN_FONT_PT, color="#24292f")
    ax.set_xlim(0, max(values) * 1.6 or 1)
    ax.set_xlabel("seconds (summary.json time_split_s)", fontsize=plots.MIN_FONT_PT + 1, color="#24292f")
    fig.tight_layout()
    return plots.render(fig)


def row_times_plot(rows: list[dict[str, Any]]) -> plots.Plot | None:
    """Seconds per image for every ok row, stacked AR / KV / DiT (the per-row throughput)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return None
    groups = {"AR": ("ar_prefill_s", "ar_decode_s"), "KV": ("kv_put_s", "kv_get_s"),
              "DiT + VAE": ("dit_total_s", "vae_decode_s")}
    colors = {"AR": plots.INFO_COLOR, "KV": "#bf8700", "DiT + VAE": plots.PASS_COLOR}
    fig, ax = plots.plt.subplots(figsize=(plots.FIG_WIDTH_IN, 3.2))
    plots._style(ax)
    x = list(range(len(ok)))
    bottom = [0.0] * len(ok)
    for name, cols in groups.items():
        values = [sum(r.get(c) or 0.0 for c in cols) for r in ok]
        ax.bar(x, values, bottom=bottom, color=colors[name], label=name, width=0.75)
        bottom = [b + v for b, v in zip(bottom, values)]
    if len(ok) <= 24:
        ax.set_xticks(x, [str(r["id"])[:14] for r in ok], rotation=45, ha="right", fontsize=plots.MIN_FONT_PT)
    else:
        ax.set_xlabel("rows, in dataset order", fontsize=plots.MIN_FONT_PT + 1, color="#24292f")
    ax.set_ylabel("seconds per image", fontsize=plots.MIN_FONT_PT + 1, color="#24292f")
    ax.legend(fontsize=plots.MIN_FONT_PT, frameon=False, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    return plots.render(fig)


def shard_steps_plot(shards: list[dict[str, Any]]) -> tuple[plots.Plot, str] | None:
    """Each committed shard's AR and DiT steps (wall time, stacked), labelled with the GPU memory peak
    of the step that came closest (the worst rank's) and what ran short: the AR's recovered OOMs and
    the allocator's retries (summary.json shards[].steps); with a caption that promises only what
    was recorded (a CPU run has no GPU memory). None for runs that recorded no steps."""
    from components.summary.run import step_record

    recorded = [s for s in shards if s.get("steps")][::-1]  # barh draws bottom-up: shard 0 on top
    if not recorded:
        return None
    labels, notes_by_shard = [], []
    for s in recorded:
        memories = [step_record(s, step, "memory") for step in ("ar", "dit")]
        peak = max(memories, key=lambda m: m.get("peak_reserved_gib") or 0.0)
        notes = [f"peak {peak['peak_reserved_gib']:.0f} / {peak['total_gib']:.0f} GiB"] \
            if peak.get("peak_reserved_gib") and peak.get("total_gib") else []
        ooms = step_record(s, "ar", "scheduler").get("oom_retries") or 0
        retries = sum(m.get("alloc_retries") or 0 for m in memories)
        if ooms:
            notes.append(f"{ooms} OOM(s) recovered")
        if retries:
            notes.append(f"{retries} allocator {'retry' if retries == 1 else 'retries'}")
        labels.append(f"shard {s['shard']}")
        notes_by_shard.append(" · ".join(notes))
    noted = any(notes_by_shard)
    fig, ax = plots.plt.subplots(figsize=(plots.FIG_WIDTH_IN, 0.9 + (0.62 if noted else 0.42) * len(recorded)))
    plots._style(ax)
    left = [0.0] * len(recorded)
    for step, label, color in (("ar", "AR", plots.INFO_COLOR), ("dit", "DiT + VAE", plots.PASS_COLOR)):
        values = [(s["steps"].get(step) or {}).get("wall_s") or 0.0 for s in recorded]
        ax.barh(labels, values, left=left, color=color, height=0.5 if noted else 0.6, label=label)
        left = [a + b for a, b in zip(left, values)]
    for y, note in enumerate(notes_by_shard):  # above its bar: the tick labels stay short
        if note:
            ax.text(0, y + 0.28, note, fontsize=plots.MIN_FONT_PT, color="#24292f", va="bottom")
    if noted:
        ax.set_ylim(-0.5, len(recorded) - 0.2)
    ax.set_xlabel("seconds (step wall time)", fontsize=plots.MIN_FONT_PT + 1, color="#24292f")
    ax.legend(fontsize=plots.MIN_FONT_PT, frameon=False, ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    memory = any(step_record(s, step, "memory").get("peak_reserved_gib") for s in recorded for step in ("ar", "dit"))
    caption = "Each shard's AR and DiT steps (wall time)" + (
        ", with the GPU memory peak of the fuller one and what ran short (recovered OOMs, allocator retries)."
        if memory else (": what ran short (recovered OOMs, allocator retries)." if noted
                        else "; no GPU memory was recorded (a CPU run)."))
    return plots.render(fig), caption


def judge_rows(manifest: dict[str, Any], run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The semantic judge over the run, where its dataset has a `target` column: ({row id: {verdict,
    target thumbnail}}, summary). None for a dataset without targets or not readable here."""
    import pyarrow.parquet as pq

    from components.evaluate import judge

    files = manifest.get("dataset_files") or []
    if not files or manifest.get("ids_derived") or not all(Path(f).is_file() for f in files):
        return None
    if any("target" not in pq.read_schema(f).names for f in files):
        return None
    per_row: dict[str, Any] = {}
    for f in files:
        try:
            results, _ = judge.judge_run(f, str(run_dir))
        except FileNotFoundError:  # no shard committed yet: nothing to judge
            return None
        targets = {r["id"]: r["target"] for r in pq.read_table(f, columns=["id", "target"]).to_pylist()}
        for row_id, verdict in results:
            per_row[row_id] = {"verdict": verdict, "target": _thumb(targets.get(row_id))}
    summary = judge.summarize([j["verdict"] for j in per_row.values() if j["verdict"] is not None])
    return per_row, {**summary, "rows": len(per_row)}  # rows without an image count as not passed


def _judge_card(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    v = entry["verdict"]
    if v is None:
        return {"target": entry["target"], "passed": False, "check": "", "detail": "no output image to judge",
                "psnr": "–", "ssim": "–"}
    return {"target": entry["target"], "passed": v.passed, "check": v.check, "detail": v.detail,
            "psnr": "∞ dB" if math.isinf(v.psnr) else f"{v.psnr:.1f} dB", "ssim": f"{v.ssim:.3f}"}


def build_job_context(run_dir: Path, report_path: Path, max_rows: int = 60) -> dict[str, Any]:
    from components.summary.run import summarize

    run_dir = run_dir.resolve()
    layout = RunLayout.open(str(run_dir.parent), run_dir.name)
    manifest = layout.manifest()
    summary = layout.read_json(layout.summary_key) or summarize(layout)
    settings = {step: layout.read_json(layout.settings_key(step)) or {} for step in ("ar", "dit")}
    rows: list[dict[str, Any]] = []
    for entry in manifest["shards"]:
        k = entry["shard"]
        if not layout.is_committed(k):
            continue
        inputs = {job.id: job for job in layout.read_inputs(k)}
        for r in layout.read_rows(k).to_pylist():
            rows.append({**r, "shard": k, "job": inputs.get(r["id"])})
    judged = judge_rows(manifest, run_dir)
    cards = []
    for r in rows[:max_rows]:
        job = r["job"]
        png = run_dir.parent / r["image_key"] if r.get("image_key") else None
        output = None
        if png is not None and png.is_file():
            with Image.open(png) as im:
                output = jpeg_data_uri(to_rgb(im))
        cards.append({
            "id": r["id"], "shard": r["shard"], "status": r["status"], "error": r.get("error") or "",
            "text": (job.text if job else None) or "", "input": _thumb(job.image) if job else None,
            "reference": _thumb(job.reference_image) if job else None, "output": output,
            "href": Path(os.path.relpath(png, report_path.parent)).as_posix() if output else "",  # full PNG
            "cot": r.get("cot_text") or "", "size": f"{r['width']}×{r['height']}" if r.get("width") else "",
            "kv": " · ".join(x for x in (r.get("kv_path"), r.get("kv_reason")) if x),
            "time": _secs(sum(r.get(c) or 0.0 for c in ("ar_prefill_s", "ar_decode_s", "kv_put_s", "kv_get_s",
                                                        "dit_total_s", "vae_decode_s")) or None),
            "judge": _judge_card(judged[0].get(r["id"])) if judged else None,
        })
    model = settings["dit"].get("model") or settings["ar"].get("model") or "–"
    generation = {setting_name(k): setting_value(v) for step in ("ar", "dit") for k, v in settings[step].items()
                  if k not in ("model", "weights", "recorded_at") and v is not None}
    steps = shard_steps_plot(summary.get("shards") or [])
    judge_line = None
    if judged:
        j = judged[1]
        judge_line = {"passed": j["passed"], "rows": j["rows"],
                      "psnr": "–" if j["mean_psnr"] is None else f"{j['mean_psnr']:.1f} dB"}
    return {
        "judge": judge_line,
        "run_id": layout.run_id, "kind": manifest.get("kind"), "dataset": manifest.get("dataset"), "model": model,
        "generation": generation, "summary": summary, "version": ardit_version(),
        "kv_paths": setting_value(summary.get("kv_paths") or {}),
        "errors": [r for r in rows if r["status"] != "ok"], "cards": cards, "n_rows": len(rows),
        "text_label": "instruction" if manifest.get("kind") == "edit" else "prompt",
        "time_plot": time_split_plot(summary.get("time_split_s") or {}), "rows_plot": row_times_plot(rows),
        "steps_plot": steps[0] if steps else None, "steps_caption": steps[1] if steps else "",
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"), "run_dir": str(run_dir),
    }


def write_job_report(run_dir: str | Path, out: str | Path | None = None, *, max_rows: int = 60) -> Path:
    """Write the job run's report (default OUT/RUN/report.html); returns its path."""
    run_dir = Path(run_dir)
    if not is_job_run(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a job run (no inputs/manifest.json): pass OUT/RUN of an "
                                "`ardit edit|generate` run")
    path = Path(out) if out else run_dir / "report.html"
    html = environment().from_string(TEMPLATE).render(**build_job_context(run_dir, path.absolute(), max_rows))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    return path


TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ardit run · {{ run_id }} · {{ summary.rows_ok }}/{{ summary.rows_total }} ok</title>
<link rel="icon" href="data:,">
<style>
* { box-sizing: border-box; }
body { margin: 0; background: #f3f5f8; color: #1f2328; overflow-wrap: break-word;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; }
main { max-width: 1400px; margin: 0 auto; padding: 28px 28px 60px; }
.panel { background: #fff; border: 1px solid #d1d9e0; border-radius: 12px; padding: 16px 20px; margin-bottom: 18px; }
h1 { margin: 0 0 4px; font-size: 22px; } h2 { font-size: 17px; margin: 28px 0 10px; }
.sub { color: #59636e; font-size: 13px; }
.facts { display: flex; flex-wrap: wrap; gap: 6px 22px; margin-top: 10px; font-size: 13px; }
.bad { color: #cf222e; } .good { color: #1a7f37; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { padding: 6px 8px; border-bottom: 1px solid #e6eaef; text-align: left; vertical-align: top; }
th { font-size: 12px; text-transform: uppercase; color: #59636e; background: #f6f8fa; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(360px, 100%), 1fr)); gap: 16px; }
.plots figure { margin: 0; min-width: 0; }
/* figures are narrow enough for a phone; wider screens zoom them up to their max-width */
.plots img { width: 100%; height: auto; display: block; margin: 0 auto; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(420px, 100%), 1fr)); gap: 16px;
  align-items: start; }
.card { background: #fff; border: 1px solid #d1d9e0; border-radius: 12px; padding: 12px 14px; min-width: 0; }
.card.error { border-color: #ffcecb; background: #fffafa; }
.card .head { display: flex; justify-content: space-between; gap: 8px; font: 600 13px ui-monospace, Menlo, monospace; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 10px; margin: 8px 0; align-items: start; }
.pair.three { grid-template-columns: 1fr 1fr 1fr; gap: 8px; }
.pair figure { margin: 0; min-width: 0; }
.judge { font-size: 13px; margin: 6px 0; } .judge .why { font-size: 12px; color: #424a53; }
/* never larger than its pixels (a tall thumbnail is 320 px high at most), never wider than its column */
.pair img { max-width: 100%; width: auto; height: auto; border-radius: 6px; background: #eee; display: block; }
.refimg { max-height: 48px; max-width: 96px; width: auto; height: auto; vertical-align: middle; }
figcaption { font-size: 12px; color: #59636e; margin-top: 3px; }
.missing { height: 120px; border-radius: 6px; background: #eff2f5; color: #59636e; font-size: 12px;
  display: flex; align-items: center; justify-content: center; text-align: center; padding: 6px; }
.text { font-size: 13px; margin: 6px 0; } .text b { color: #59636e; font-weight: 600; }
.cot { font-size: 12px; color: #424a53; white-space: pre-wrap; max-height: 220px; overflow: auto;
  background: #f6f8fa; border-radius: 6px; padding: 6px 8px; }
.meta { font-size: 12px; color: #59636e; margin-top: 6px; }
.reason { color: #82071e; font-size: 13px; }
{{ clamp_css }}
@media (max-width: 640px) {
  main { padding: 14px 10px 40px; }
  .panel { padding: 12px; }
  .card { padding: 10px; }
}
</style>
</head>
<body>
<main>
<div class="panel">
  <h1>{{ run_id }} <span class="sub">{{ kind }} job run</span></h1>
  <div class="sub">dataset {{ dataset }} · model {{ model }} · {{ run_dir }} · ardit {{ version }} · report {{ generated }}</div>
  <div class="facts">
    <span><b>{{ summary.rows_ok }}</b> of {{ summary.rows_total }} rows ok</span>
    <span class="{{ 'bad' if summary.rows_failed else 'good' }}"><b>{{ summary.rows_failed }}</b> failed</span>
    {% if summary.rows_pending %}<span><b>{{ summary.rows_pending }}</b> pending (shards not committed)</span>{% endif %}
    <span>images/min <b>{{ summary.images_per_minute if summary.images_per_minute is not none else '–' }}</b></span>
    <span>wall <b>{{ summary.wall_s if summary.wall_s is not none else '–' }} s</b></span>
    <span>KV {{ kv_paths }}</span>
  </div>
  {% if judge %}<div class="facts"><span class="{{ 'good' if judge.passed == judge.rows else 'bad' }}">judge: <b>{{ judge.passed }} / {{ judge.rows }}</b> rows pass, mean PSNR <b>{{ judge.psnr }}</b></span><span class="sub">the semantic judge against the dataset's targets</span></div>{% endif %}
  <div class="facts sub">{% for k, v in generation.items() %}<span>{{ k }} {{ v }}</span>{% endfor %}</div>
</div>

<h2>Time and throughput</h2>
<div class="panel plots">
  {% if time_plot %}<figure><img alt="time split" src="{{ time_plot.uri }}" width="{{ time_plot.width }}" height="{{ time_plot.height }}" style="max-width: {{ time_plot.max_width }}px" data-min-font-px="{{ time_plot.min_font_px }}"><figcaption>Where the wall time went: engine load, AR, KV handoff, DiT + VAE, the rest.</figcaption></figure>{% endif %}
  {% if rows_plot %}<figure><img alt="seconds per image" src="{{ rows_plot.uri }}" width="{{ rows_plot.width }}" height="{{ rows_plot.height }}" style="max-width: {{ rows_plot.max_width }}px" data-min-font-px="{{ rows_plot.min_font_px }}"><figcaption>Seconds per image by row (AR times are the row's share of its batch).</figcaption></figure>{% endif %}
  {% if steps_plot %}<figure><img alt="shard steps" src="{{ steps_plot.uri }}" width="{{ steps_plot.width }}" height="{{ steps_plot.height }}" style="max-width: {{ steps_plot.max_width }}px" data-min-font-px="{{ steps_plot.min_font_px }}"><figcaption>{{ steps_caption }}</figcaption></figure>{% endif %}
  {% if not time_plot and not rows_plot %}<div class="sub">no committed rows yet</div>{% endif %}
</div>

<h2>Error rows ({{ errors|length }})</h2>
<div class="panel">
{% if errors %}
<table><thead><tr><th>row</th><th>shard</th><th>reason</th></tr></thead><tbody>
{% for e in errors %}<tr><td>{{ e.id }}</td><td>{{ e.shard }}</td><td class="reason">{{ e.error|clamp }}</td></tr>{% endfor %}
</tbody></table>
{% else %}<span class="good">none</span>{% endif %}
</div>

<h2>Rows{% if cards|length < n_rows %} (first {{ cards|length }} of {{ n_rows }}){% endif %}</h2>
<div class="grid">
{% for c in cards %}
<div class="card {{ 'error' if c.status != 'ok' else '' }}">
  <div class="head"><span style="min-width: 0; overflow-wrap: anywhere">{{ c.id }}</span><span class="sub">shard {{ c.shard }}</span></div>
  <div class="pair{{ ' three' if c.judge and kind == 'edit' else '' }}">
    {% if kind == 'edit' %}
    <figure>{% if c.input %}<img alt="input {{ c.id }}" src="{{ c.input }}">{% else %}<div class="missing">no input image</div>{% endif %}<figcaption>input</figcaption></figure>
    {% endif %}
    <figure>{% if c.output %}<a href="{{ c.href }}"><img alt="output {{ c.id }}" src="{{ c.output }}"></a><figcaption>output {{ c.size }} · <a href="{{ c.href }}">full PNG</a></figcaption>
    {% else %}<div class="missing">no image</div><figcaption>output</figcaption>{% endif %}</figure>
    {% if c.judge %}<figure>{% if c.judge.target %}<img alt="target {{ c.id }}" src="{{ c.judge.target }}">{% else %}<div class="missing">no target</div>{% endif %}<figcaption>target</figcaption></figure>{% endif %}
  </div>
  {% if c.judge %}<div class="judge {{ 'good' if c.judge.passed else 'bad' }}"><b>{{ 'PASS' if c.judge.passed else 'FAIL' }}</b>{% if c.judge.check %} {{ c.judge.check }}{% endif %} · PSNR {{ c.judge.psnr }} · SSIM {{ c.judge.ssim }}<div class="why">{{ c.judge.detail|clamp }}</div></div>{% endif %}
  {% if c.reference %}<div class="meta">reference image: <img alt="reference {{ c.id }}" src="{{ c.reference }}" class="refimg"></div>{% endif %}
  <div class="text"><b>{{ text_label }}:</b> {{ c.text|clamp if c.text else '–' }}</div>
  {% if c.error %}<div class="reason">{{ c.error|clamp }}</div>{% endif %}
  {% if c.cot %}<div class="text"><b>CoT:</b></div><div class="cot">{{ c.cot }}</div>{% endif %}
  {% if c.status == 'ok' %}<div class="meta">{{ c.time }}{% if c.kv %} · KV {{ c.kv }}{% endif %}</div>{% endif %}
</div>
{% endfor %}
</div>
</main>
</body>
</html>
"""
