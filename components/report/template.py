"""The report's Jinja2 template (kept in Python so it ships with the package)."""

TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ardit sweep · {{ meta.name }} · {{ verdict }}</title>
<link rel="icon" href="data:,">
<style>
:root {
  --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --soft: #f6f8fa; --card: #ffffff;
  --pass: #1a7f37; --pass-bg: #dafbe1; --fail: #cf222e; --fail-bg: #ffebe9;
  --info: #0969da; --info-bg: #ddf4ff; --ref: #59636e; --ref-bg: #eff2f5;
}
* { box-sizing: border-box; }
body { margin: 0; background: #f3f5f8; color: var(--fg); overflow-wrap: break-word;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1400px; margin: 0 auto; padding: 28px 28px 60px; }
header.top { display: flex; align-items: flex-start; justify-content: space-between; gap: 24px;
  background: var(--card); border: 1px solid var(--line); border-radius: 12px; padding: 22px 26px; }
h1 { margin: 0 0 4px; font-size: 22px; letter-spacing: -0.01em; }
h1 small { color: var(--muted); font-weight: 500; }
h2 { font-size: 17px; margin: 34px 0 10px; }
h3 { font-size: 14px; margin: 0; }
.sub { color: var(--muted); font-size: 13px; }
.facts { display: flex; flex-wrap: wrap; gap: 8px 22px; margin-top: 12px; font-size: 13px; }
.facts b { font-weight: 600; }
.verdict { font-size: 20px; font-weight: 700; padding: 10px 20px; border-radius: 10px; white-space: nowrap;
  text-align: center; }
.verdict small { display: block; font-size: 12px; font-weight: 500; margin-top: 2px; }
.verdict.PASS { background: var(--pass-bg); color: var(--pass); border: 1px solid #aceebb; }
.verdict.FAIL { background: var(--fail-bg); color: var(--fail); border: 1px solid #ffcecb; }
.panel { background: var(--card); border: 1px solid var(--line); border-radius: 12px; padding: 16px 18px; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; font-size: 12.5px; }
th, td { padding: 6px 6px; border-bottom: 1px solid #e6eaef; text-align: right; white-space: nowrap; }
/* headers wrap (MEAN |Δ| MAX on two lines), so all 13 columns fit a 1360 px page */
th { white-space: normal; vertical-align: bottom; font-size: 11.5px; text-transform: uppercase; letter-spacing: .03em; color: var(--muted);
  font-weight: 600; background: var(--soft); }
th:first-child, td:first-child, td.l, th.l { text-align: left; }
tbody tr:hover { background: #fafbfc; }
td.good { color: var(--pass); }
td.wrap { white-space: normal; min-width: 80px; }
td.noisy { color: #8c959f; font-style: italic; }
.timing { font-size: 12.5px; color: var(--muted); margin: 10px 2px 0; }
.timing.warn { color: #9a6700; background: #fff8c5; border-radius: 6px; padding: 6px 10px; }
td.bad { color: var(--fail); background: var(--fail-bg); font-weight: 600; }
td.name { white-space: normal; overflow-wrap: anywhere; min-width: 110px; max-width: 190px; font-weight: 600; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
td.varied { color: var(--muted); white-space: normal; overflow-wrap: anywhere; min-width: 130px; max-width: 200px; text-align: left; font-size: 12px; }
td.varied .role { display: block; font-size: 11px; color: #8c959f; }
td.measure { white-space: normal; min-width: 220px; text-align: left; }
.badge { display: inline-block; font-size: 11px; font-weight: 700; padding: 2px 8px; border-radius: 999px;
  letter-spacing: .03em; }
.badge.PASS { background: var(--pass-bg); color: var(--pass); }
.badge.FAIL { background: var(--fail-bg); color: var(--fail); }
.badge.INFO { background: var(--info-bg); color: var(--info); }
.badge.REF { background: var(--ref-bg); color: var(--ref); }
.badge.BIT { background: #fbefff; color: #8250df; }
.badge.SIZE { background: #fff8c5; color: #9a6700; }
ul.fails { margin: 12px 0 0; padding: 10px 14px 10px 30px; background: var(--fail-bg); border-radius: 8px;
  color: #82071e; font-size: 12.5px; }
ul.fails li { margin: 2px 0; }
.gates { font-size: 12.5px; color: var(--muted); margin: 10px 2px 0; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(420px, 100%), 1fr)); gap: 16px; }
.plots figure { margin: 0; min-width: 0; }
/* figures are narrow enough for a phone; wider screens zoom them up to their max-width (MAX_ZOOM) */
.plots img { width: 100%; height: auto; display: block; margin: 0 auto; }
figcaption { font-size: 12px; color: var(--muted); margin-top: 6px; }
.bnote { display: block; color: var(--muted); font-weight: 400; font-size: 11.5px; max-width: 360px; }
.rowcard { background: var(--card); border: 1px solid var(--line); border-radius: 12px; padding: 14px 16px;
  margin-bottom: 16px; }
.rowhead { display: flex; align-items: baseline; gap: 14px; flex-wrap: wrap; margin-bottom: 10px; }
.rowhead .sub { font-size: 12.5px; }
.strip { display: grid; grid-template-columns: repeat({{ n_cells }}, minmax(120px, 1fr)); gap: 12px; overflow-x: auto;
  padding-bottom: 4px; }
.cell { min-width: 0; }
.cell .title { overflow: hidden; text-overflow: ellipsis; font: 600 12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; margin-bottom: 5px; min-height: 20px;
  display: flex; justify-content: space-between; align-items: center; gap: 4px; }
/* small images (under 200 px) are magnified, pixelated, to show single-pixel differences; thumbnails
   of real ones are never shown larger than their pixels */
.cell img { {{ 'width: 100%' if pixelated else 'width: auto; max-width: 100%' }}; height: auto; max-height: 260px;
  object-fit: contain; display: block; border-radius: 6px; background: #eee;
  image-rendering: {{ 'pixelated' if pixelated else 'auto' }}; }
.cell img.heat { margin-top: 6px; }
.cell .m { font-size: 11.5px; color: var(--muted); margin-top: 5px; line-height: 1.35;
  font-variant-numeric: tabular-nums; }
.cell .m b { color: var(--fg); font-weight: 600; }
.cell .m b.bad { color: var(--fail); }
.cell.ref img { box-shadow: 0 0 0 2px #8c959f; }
.failbox { min-height: 80px; border-radius: 6px; background: var(--fail-bg); color: #82071e;
  font-size: 12px; padding: 10px; white-space: normal; }
details { margin-top: 8px; font-size: 12.5px; }
details summary { cursor: pointer; color: var(--muted); }
details pre { white-space: pre-wrap; background: var(--soft); padding: 10px; border-radius: 8px; font-size: 12px;
  max-height: 220px; overflow: auto; }
.legend { display: flex; flex-wrap: wrap; align-items: center; gap: 6px 14px; margin: 0 0 12px; font-size: 12px; color: var(--muted); }
.legend img { max-width: 100%; height: auto; }
.ask { font-size: 13px; margin: 0 0 10px; white-space: pre-wrap; overflow-wrap: anywhere; }
.ask b { color: var(--muted); font-weight: 600; margin-right: 6px; }
.cell.input img { box-shadow: 0 0 0 2px #d4a72c; }
.cell .m.fails { color: var(--fail); font-weight: 600; }
.cell a { display: block; }
details.spec pre { max-height: 420px; }
dl.defs { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 4px 16px; font-size: 12.5px; color: var(--muted); }
dl.defs dt { font-weight: 600; color: var(--fg); }
dl.defs dd { margin: 0; overflow-wrap: anywhere; }
footer { margin-top: 30px; font-size: 12px; color: var(--muted); }
{{ clamp_css }}
@media (max-width: 640px) {
  main { padding: 14px 10px 40px; }
  header.top { flex-direction: column; gap: 12px; padding: 16px; }
  .panel, .rowcard { padding: 12px; }
  h1 { font-size: 19px; }
  dl.defs { grid-template-columns: minmax(0, 1fr); }
  dl.defs dd { margin-bottom: 6px; }
  /* the image strip wraps instead of scrolling */
  .strip { grid-template-columns: repeat(auto-fill, minmax(100px, 1fr)); overflow-x: visible; }
  .cell .title { flex-wrap: wrap; overflow-wrap: anywhere; }
}
</style>
</head>
<body>
<main>
<header class="top">
  <div>
    <h1>ardit sweep · {{ meta.name }} <small>{{ meta.sweep_id }}</small></h1>
    {% if meta.description %}<div class="sub">{{ meta.description }}</div>{% endif %}
    <div class="facts">
      <span>reference <b>{{ meta.reference }}</b></span>
      <span>model <b>{{ meta.base.model }}</b></span>
      <span>dataset <b>{{ meta.dataset }}</b></span>
      <span>rows <b>{{ n_rows }}</b></span>
      <span>configs <b>{{ configs|length }}</b></span>
      <span>finished <b>{{ meta.finished }}</b></span>
      <span>ardit <b>{{ version }}</b></span>
    </div>
    {% if spec_text %}<details class="spec"><summary>the spec (spec.yaml)</summary><pre>{{ spec_text }}</pre></details>{% endif %}
  </div>
  <div class="verdict {{ verdict }}">{{ verdict }}<small>{{ n_gated_pass }}/{{ n_gated }} gated configs pass</small></div>
</header>

<h2>Summary</h2>
<div class="panel">
  <div class="scroll">
  <table>
    <thead><tr>
      <th class="l">config</th><th class="l">varies</th><th>status</th><th>rows ok</th>
      <th>PSNR mean</th><th>PSNR min</th><th>SSIM min</th><th>mean |Δ| max</th><th>p99 |Δ| max</th>
      <th>bitwise</th><th>CoT sim</th><th>time / img</th><th>vs ref</th>
    </tr></thead>
    <tbody>
    {% for c in configs %}
      <tr>
        <td class="name">{{ c.name }}</td>
        <td class="varied">{{ c.label }}{% if c.role_label %}<span class="role">{{ c.role_label }}</span>{% endif %}</td>
        <td><span class="badge {{ c.status }}" title="{{ c.status_title }}">{{ c.status }}</span></td>
        <td class="{{ c.cls.rows }}">{{ c.rows_ok }}</td>
        <td>{{ c.psnr_mean }}</td>
        <td class="{{ c.cls.psnr }}">{{ c.psnr_min }}</td>
        <td class="{{ c.cls.ssim }}">{{ c.ssim_min }}</td>
        <td class="{{ c.cls.mean_abs }}">{{ c.mean_abs_max }}</td>
        <td class="{{ c.cls.p99 }}">{{ c.p99_abs_max }}</td>
        <td class="{{ c.cls.bitwise }}">{{ c.bitwise }}</td>
        <td>{{ c.cot }}</td>
        <td class="wrap">{{ c.time }}</td>
        <td class="wrap {{ c.speed.cls }}" title="{{ c.speed.title }}">{{ c.speed.text }}</td>
      </tr>
    {% endfor %}
    </tbody>
  </table>
  </div>
  <div class="timing{{ ' warn' if timing_warn else '' }}">{{ timing_line }}</div>
  <div class="gates">Gates (per image, every row must pass): {{ gates_text }}{% if overrides_text %} · per-config gates: {{ overrides_text }}{% endif %}. PSNR/SSIM/|Δ| are against each config's baseline (the reference); the reference row is its own comparison.</div>
  {% if failures %}
  <ul class="fails">{% for f in failures %}<li>{{ f }}</li>{% endfor %}</ul>
  {% endif %}
</div>

<h2>Speed and fidelity</h2>
<div class="plots">
  {% if speed_plot %}<figure class="panel"><img src="{{ speed_plot.uri }}" width="{{ speed_plot.width }}" height="{{ speed_plot.height }}" style="max-width: {{ speed_plot.max_width }}px" data-min-font-px="{{ speed_plot.min_font_px }}" alt="speed vs fidelity plot"><figcaption>Each point is a config: median time per image over its timing samples (bars: fastest to slowest sample) against mean PSNR vs the reference. Shape and colour give the verdict: ★ reference, ● pass, ✖ fail, ■ not gated; a hollow marker's time is within the timing noise (no speed difference shown). {{ timing_line }}</figcaption></figure>{% endif %}
  {% if delta_plot %}<figure class="panel"><img src="{{ delta_plot.uri }}" width="{{ delta_plot.width }}" height="{{ delta_plot.height }}" style="max-width: {{ delta_plot.max_width }}px" data-min-font-px="{{ delta_plot.min_font_px }}" alt="|Δ| percentile profile"><figcaption>|Δ| percentiles of the worst row per config (log scale; exact zeros drawn at the floor). Configs with the same profile share one line, named together in the legend.</figcaption></figure>{% endif %}
</div>

<h2>Precision budget</h2>
<div class="panel">
  {% if budget %}
  <div class="scroll">
  <table>
    <thead><tr>
      <th class="l">measure</th><th class="l">config</th><th>rows</th><th>bitwise</th><th>PSNR mean</th><th>PSNR min</th>
      <th>SSIM mean</th><th>mean |Δ|</th><th>p99 |Δ|</th><th>CoT sim</th><th>tokens =</th><th>1st div.</th>
      <th>latent cos</th>
    </tr></thead>
    <tbody>
    {% for b in budget %}
      <tr>
        <td class="measure"><b>{{ b.measure }}</b>{% if b.note %}<span class="bnote">{{ b.note }}</span>{% endif %}</td><td class="name">{{ b.config }}</td><td>{{ b.rows }}</td><td>{{ b.bitwise }}</td>
        <td>{{ b.psnr_mean }}</td><td>{{ b.psnr_min }}</td><td>{{ b.ssim_mean }}</td><td>{{ b.mean_abs }}</td>
        <td>{{ b.p99 }}</td><td>{{ b.cot }}</td><td>{{ b.tokens }}</td><td>{{ b.div }}</td><td>{{ b.latent }}</td>
      </tr>
    {% endfor %}
    </tbody>
  </table>
  </div>
  <div class="gates">Seed PR for scale (HunyuanImage-3, 50 steps): reuse re-runs bitwise; non-reuse re-runs 26.7 dB; reuse vs non-reuse 10.2 dB.</div>
  {% else %}
  <div class="sub">No precision-budget configs in this sweep.</div>
  {% endif %}
</div>

<h2>Images <span class="sub">({{ shown_rows }} of {{ n_rows }} rows, failures first, then by {{ ranked_by }})</span></h2>
<div class="legend"><span>|Δ| heatmap (mean over RGB):</span><img src="{{ colorbar.uri }}" width="{{ colorbar.width }}" height="{{ colorbar.height }}" data-min-font-px="{{ colorbar.min_font_px }}" alt="heatmap colour scale"><span>Click an image for the full-size PNG.</span></div>
{% for r in rows %}
<section class="rowcard">
  <div class="rowhead">
    <h3>{{ r.id }}</h3>
    <span class="sub">worst: {{ r.worst }}</span>
    {% if r.prompt %}<span class="sub">prompt: {{ r.prompt }}</span>{% endif %}
  </div>
  {% if r.instruction %}<div class="ask"><b>{{ r.instruction_label }}</b>{{ r.instruction|clamp }}</div>{% endif %}
  <div class="strip">
    {% if has_inputs %}
    <div class="cell input">
      <div class="title"><span>input</span></div>
      {% if r.input_img %}<img src="{{ r.input_img }}" alt="input image {{ r.id }}"><div class="m">{{ r.input_info }}</div>{% else %}<div class="m">no input image</div>{% endif %}
    </div>
    {% endif %}
    <div class="cell ref">
      <div class="title"><span>{{ meta.reference }}</span><span class="badge REF">REF</span></div>
      {% if r.ref_img %}<a href="{{ r.ref_link }}"><img src="{{ r.ref_img }}" alt="reference image {{ r.id }}"></a>{% else %}<div class="failbox">{{ r.ref_error }}</div>{% endif %}
      <div class="m">{{ r.ref_info }}</div>
    </div>
    {% for c in r.cells %}
    <div class="cell">
      <div class="title"><span>{{ c.config }}</span>{% if c.bitwise %}<span class="badge BIT">bitwise</span>{% elif c.badge %}<span class="badge {{ c.badge }}">{{ c.badge }}</span>{% endif %}</div>
      {% if c.error %}
        <div class="failbox">{{ c.error }}</div>
      {% elif c.size_note %}
        <a href="{{ c.link }}"><img src="{{ c.img }}" alt="{{ c.config }} image {{ r.id }}"></a>
        <div class="m"><b class="{{ 'bad' if c.badge == 'FAIL' else '' }}">{{ c.size_note }}</b> · no pixel metrics{% if c.extra %}<br>{{ c.extra }}{% endif %}</div>
      {% else %}
        <a href="{{ c.link }}"><img src="{{ c.img }}" alt="{{ c.config }} image {{ r.id }}"></a>
        <img class="heat" src="{{ c.heat }}" alt="{{ c.config }} difference heatmap {{ r.id }}">
        <div class="m">PSNR <b class="{{ c.psnr_cls }}">{{ c.psnr }}</b> · SSIM <b class="{{ c.ssim_cls }}">{{ c.ssim }}</b><br>
          |Δ| mean <b class="{{ c.mean_abs_cls }}">{{ c.mean_abs }}</b> · p99 <b class="{{ c.p99_cls }}">{{ c.p99 }}</b>{% if c.extra %}<br>{{ c.extra }}{% endif %}</div>
        {% if c.fails %}<div class="m fails">✗ fails: {{ c.fails|join('; ') }}</div>{% endif %}
      {% endif %}
    </div>
    {% endfor %}
  </div>
  {% if r.cot %}<details><summary>reference CoT ({{ r.cot|length }} chars)</summary><pre>{{ r.cot }}</pre></details>{% endif %}
</section>
{% endfor %}

<h2>Definitions</h2>
<div class="panel">
<dl class="defs">
  {% for word, meaning in verdict_words.items() %}<dt><span class="badge {{ word }}">{{ word }}</span></dt><dd>{{ meaning }}</dd>
  {% endfor %}<dt>PSNR</dt><dd>skimage.metrics.peak_signal_noise_ratio, data_range 1, pixels in [0, 1]; ∞ when identical.</dd>
  <dt>SSIM</dt><dd>skimage.metrics.structural_similarity, channel_axis −1, data_range 1, 7×7 window.</dd>
  <dt>|Δ|</dt><dd>absolute difference of every channel value; mean and percentiles over H×W×C.</dd>
  <dt>bitwise</dt><dd>decoded pixel arrays identical.</dd>
  <dt>CoT sim</dt><dd>difflib ratio of the chain-of-thought texts; tokens equal / 1st divergence compare generated token ids.</dd>
  <dt>time / img</dt><dd>ar_prefill_s + ar_decode_s + dit_total_s + vae_decode_s per row, averaged over a run; the median over the config's timing samples (its run, timing.repeats rounds, and for the reference its determinism re-run), n and the spread (max − min) / min when there are several.</dd>
  <dt>vs ref</dt><dd>how much faster or slower than the reference (its time divided by this one), only where that is a finding: at least 3 timing samples for the config and for the reference, their ranges apart (the ratio from the samples excludes 1) and the medians further apart than the timing noise (the largest spread of any config's samples). Otherwise the cell says “within noise (n=…)” in grey and the ratio, which means nothing, is only in its tooltip.</dd>
  <dt>other aspect ratio</dt><dd>the config's image has another width:height than the reference's (the model picked another ratio, e.g. under another seed): no pixel metrics. “resized”: the same ratio at another size.</dd>
</dl>
</div>
<footer>Generated by ardit {{ version }} at {{ generated }} · sweep directory {{ sweep_dir }}</footer>
</main>
</body>
</html>
"""
