"""`actrace report`: one self-contained, offline HTML page of findings, charts and run metadata.

The Vega/Vega-Lite/vega-embed JavaScript is inlined (vl-convert ships it), so no request leaves
the page. Every name from a trace is untrusted: HTML tables escape it, and chart specs are
embedded as JSON with `<` escaped so no string can close the script element.
"""
from __future__ import annotations

import html
import warnings
import json
from pathlib import Path

import numpy as np
import polars as pl

from actrace import bins
from actrace.recurrent import describe
from . import charts
from .analysis import Analysis
from .findings import Finding, group
from .metrics import last_reading

# one legend selection drives the runs' highlight in every trend chart: Altair says it merged them
warnings.filterwarnings("ignore", message="Automatically deduplicated selection parameter")

MAX_STEPS = 60           # heatmap columns per run
MAX_TREND_STEPS = 40     # points per run on a trend line
MAX_HIST_PAIRS = 12      # (run, layer) histograms embedded: layers with findings first
MAX_HIST_STEPS = 24
SIG_DIGITS = 3           # floats in the embedded data: what a chart or a tooltip resolves


def _compact(df: pl.DataFrame) -> pl.DataFrame:
    """Floats rounded to SIG_DIGITS significant digits: the page's size is its data's text."""
    floats = [c for c, t in df.schema.items() if t in (pl.Float64, pl.Float32)]
    return df.with_columns(pl.col(floats).round_sig_figs(SIG_DIGITS)) if floats else df


def _thin_steps(df: pl.DataFrame, limit: int) -> pl.DataFrame:
    """Keep at most `limit` evenly spaced steps per run (first and last always)."""
    keep = []
    for (run,), g in df.select("run", "step").unique().sort("run", "step").group_by(["run"], maintain_order=True):
        steps = g["step"].to_numpy()
        idx = np.unique(np.linspace(0, len(steps) - 1, min(limit, len(steps))).round().astype(int))
        keep.append(pl.DataFrame({"run": [run] * len(idx), "step": steps[idx]}))
    return df.join(pl.concat(keep), on=["run", "step"], how="semi", maintain_order="left") if keep else df


def _bin_labels() -> list[str]:
    lo, hi = bins.bin_bounds()
    labels = []
    for i, (a, b) in enumerate(zip(lo, hi)):
        labels.append("−inf" if i == 0 else "+inf" if i == bins.N_BINS - 1 else "0" if i == bins.ZERO_BIN
                      else f"[{a:.3g}, {b:.3g})" if a >= 0 else f"({a:.3g}, {b:.3g}]")
    return labels


def histogram_frame(hist: pl.DataFrame) -> pl.DataFrame:
    """Long (pair, step, bin, count, share) frame of activation histograms (run, layer, step, hist)."""
    labels = _bin_labels()
    df = _thin_steps(hist, MAX_HIST_STEPS) if hist.height else hist
    if not df.height:
        return pl.DataFrame()
    df = df.with_columns(pl.int_range(bins.N_BINS).implode().alias("bin"))
    df = df.explode("hist", "bin").filter(pl.col("hist") > 0).rename({"hist": "count"})
    return df.with_columns(
        (pl.col("run") + " · " + pl.col("layer")).alias("pair"),
        (pl.col("count") / pl.col("count").sum().over("run", "layer", "step")).alias("share"),
        pl.col("bin").map_elements(lambda i: labels[i], return_dtype=pl.String).alias("bin_label"),
    ).select("pair", "step", "bin", "bin_label", "count", "share")


def _table(rows: list[dict], columns: list[str], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _spec_json(chart) -> str:
    return json.dumps(chart.to_dict()).replace("<", "\\u003c").replace("\u2028", "\\u2028")


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="actrace report"><title>actrace report</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; img-src data:">
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ margin-bottom: 0 }} h2 {{ margin-top: 32px; border-bottom: 1px solid #ddd }}
table {{ border-collapse: collapse; margin: 8px 0 }} td, th {{ padding: 3px 8px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top }}
th {{ background: #f4f4f4 }} .critical td:first-child {{ color: #b00020; font-weight: 600 }}
tr.critical td:first-child {{ color: #b00020; font-weight: 600 }} tr.warning td:first-child {{ color: #a65f00; font-weight: 600 }}
.muted {{ color: #777 }} .chart {{ margin: 12px 0 }}
</style>
<script>{bundle}</script></head>
<body>
<h1>actrace report</h1>
<p class="muted">{subtitle}</p>
<h2>Findings</h2>
{findings}
{comparison}
{sections}
<h2>Runs</h2>
{runs}
<script>
const specs = {specs};
for (const [id, spec] of Object.entries(specs)) {{
  vegaEmbed('#' + id, spec, {{actions: false, renderer: 'svg'}}).catch(e => {{
    document.getElementById(id).textContent = 'chart failed: ' + e; console.error(e); }});
}}
</script>
</body></html>
"""


def _findings_html(found: list[Finding]) -> str:
    """One row per rule and run (its most urgent finding), the other layers behind a disclosure."""
    if not found:
        return "<p>No findings: every rule stayed silent.</p>"
    rows = []
    for g in group(found):
        f = g.first
        layer = html.escape(f.layer)
        if g.others:
            more = ", ".join(html.escape(f"{o.layer} (step {o.step})") for o in g.others)
            layer += f"<details><summary>+{len(g.others)} more layers</summary>{more}</details>"
        cells = [html.escape(str(v)) for v in (f.severity, f.rule, f.run)] + [layer] + \
                [html.escape(str(v)) for v in (f.step if f.step >= 0 else "–", f.evidence, f.advice)]
        rows.append(f'<tr class="{f.severity}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{c}</th>" for c in ("severity", "rule", "run", "layer", "since step", "evidence",
                                             "what people usually do"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _comparison_html(compared: pl.DataFrame | None, per_metric: int = 5) -> str:
    """The layers that differ most from the baseline run, per metric."""
    if compared is None or compared.is_empty():
        return ""
    rows = [dict(r, value=f"{r['value']:.3g}", baseline_value=f"{r['baseline_value']:.3g}",
                 difference=f"{r['difference']:+.3g}")
            for r in compared.group_by("metric", maintain_order=True).head(per_metric).iter_rows(named=True)]
    return (f"<h2>Differences from the baseline run {html.escape(compared['baseline'][0])}</h2>"
            "<p class='muted'>Mean over the aligned steps; for std and gradient norm the difference is in "
            "orders of magnitude (log10 ratio).</p>"
            + _table(rows, ["metric", "run", "aligned", "stream", "value", "baseline_value", "difference",
                            "points"]))


def _recurrent(acts: pl.DataFrame) -> pl.DataFrame:
    """The activation readings of recurrent layers (spec §Recurrent layers: a module with a final
    hidden state `MODULE.lK.h_n`), in forward order."""
    names = set(acts["layer"])
    own = [name for name in names if describe(name, names)]
    return _compact(acts.filter(pl.col("layer").is_in(own)).select("run", "layer", "layer_index", "step", "saturation_value",
                                            "saturation_unit"))


def _loss_marks(analysis: Analysis) -> tuple[pl.DataFrame, pl.DataFrame] | None:
    """The runs' logged loss (finite values, thinned) and their findings placed on it, or None."""
    loss = analysis.scalars.filter((pl.col("name") == "loss") & pl.col("value").is_finite()).select(
        "run", "step", "value")
    if not loss.height:
        return None
    found = analysis.findings_frame.filter(pl.col("severity").is_in(["critical", "warning"]) & (pl.col("step") >= 0))
    marks = found.select("run", "rule", "layer", "step", "severity", "evidence").sort("run", "step").join_asof(
        loss.sort("run", "step"), on="step", by="run", strategy="nearest", check_sortedness=False).drop_nulls("value")
    return _compact(_thin_steps(loss, 4 * MAX_TREND_STEPS)), _compact(marks)


def build_report(analysis: Analysis, *, baseline: str | None = None, progress=lambda msg: None) -> str:
    """The report of an analysis as one HTML page, runs compared with `baseline` (default: the first)."""
    import altair as alt
    import vl_convert
    from altair.utils._importers import vl_version_for_vl_convert

    alt.data_transformers.disable_max_rows()
    m, found, x = analysis.metrics, analysis.findings, analysis.x
    progress("aligning runs")
    a = analysis.aligned
    compared = analysis.compared(baseline)
    acts = _thin_steps(a.filter(pl.col("stream") == "activation"), MAX_STEPS)
    grads = _thin_steps(a.filter(pl.col("stream") == "param_grad"), MAX_STEPS)
    heat = acts.select("run", "layer", "layer_index", "step", "dead_fraction", "saturation_value")
    if grads.height:
        heat = pl.concat([heat, grads.select("run", "layer", "layer_index", "step", "grad_norm")],
                         how="diagonal_relaxed")
    heat = _compact(heat)
    # the menus open on the baseline, then the runs in the order given
    first = baseline or analysis.baseline
    runs = [first] + [r.get("run_name") for r in analysis.runs if r.get("run_name") != first]
    specs, sections = {}, []
    focus = next((f for f in found if f.rule.startswith(("dead", "saturation"))), found[0] if found else None)
    focus_aligned = None
    if focus is not None:
        hit = a.filter((pl.col("run") == focus.run) & (pl.col("layer") == focus.layer))["aligned"]
        focus_aligned = hit[0] if hit.len() else None

    def section(title: str, note: str, chart_id: str, chart) -> None:
        specs[chart_id] = _spec_json(chart)
        sections.append(f"<h2>{html.escape(title)}</h2><p class='muted'>{note}</p>"
                        f"<div id='{chart_id}' class='chart'></div>")

    progress("drawing the loss")
    loss = _loss_marks(analysis)
    if loss is not None:
        section("Loss and findings", "The training loss each run logged (`monitor.log(step, loss=...)`, or its "
                "trainer's), with every finding marked at the step it starts: a gradient norm that grows while the "
                "loss falls is a net learning; one that grows while the loss rises is not.", "loss",
                charts.loss_with_findings(*loss))
    progress("drawing heatmaps")
    if heat.height:
        section("Layers × steps", "Per run (menu): dead fraction, saturated share of values and gradient norm "
                "for every layer and step. Layers run from input (top) to output.", "heatmaps",
                charts.layer_heatmaps(heat, [
                    ("dead_fraction", "dead fraction", "#b2182b", "no activation readings in this run"),
                    ("saturation_value", "saturation (values)", "#d94801",
                     "no bounded layers in this run|(saturation exists for tanh, sigmoid, …)"),
                    ("grad_norm", "gradient norm", "", "no gradient readings in this run|(an ONNX run has none)")],
                    runs, default_run=focus.run if focus else first))
    recurrent = _recurrent(acts)
    if recurrent.height:
        section("Recurrent layers", "Per run (menu): each recurrent layer's gates, hidden state and final states "
                "together, by layer and direction. A gate pinned open or closed for every input, or a hidden state "
                "piling at ±1, carries no information.", "recurrent",
                charts.layer_heatmaps(recurrent, [
                    ("saturation_value", "saturation (values)", "#d94801", "no recurrent layer in this run"),
                    ("saturation_unit", "units pinned for every input", "#7f2704", "no recurrent layer in this run")],
                    runs, default_run=next((f.run for f in found if f.layer in set(recurrent["layer"])), first),
                    menu="recurrent_run"))
    progress("drawing trends")
    trend_src = _compact(pl.concat([_thin_steps(acts, MAX_TREND_STEPS), _thin_steps(grads, MAX_TREND_STEPS)],
                                   how="diagonal_relaxed").select(
        "run", "layer", "layer_index", "aligned", "x", "step", "dead_fraction", "sparsity", "saturation_value",
        "grad_norm"))
    if trend_src.height:
        section("Trends", "Per layer (menu, aligned across runs): runs overlaid; click a run in the legend "
                "to highlight it. Saturation exists for bounded kinds only (tanh, sigmoid, …), gradient norms for "
                "layers with parameters only.", "trends",
                charts.trend_lines(trend_src, [("dead_fraction", "dead fraction"), ("sparsity", "sparsity (not death)"),
                                               ("saturation_value", "saturation (values)"),
                                               ("grad_norm", "gradient norm")],
                                   "fraction of training" if x == "progress" else "step", default_layer=focus_aligned,
                                   why={"saturation_value": "not a bounded kind: no saturation",
                                        "grad_norm": "no parameters, or no gradient readings",
                                        "dead_fraction": "no activation readings",
                                        "sparsity": "no activation readings"}))
    if grads.height:
        last = last_reading(grads, "run")
        section("Gradient norm across depth", "Healthy: roughly flat. Vanishing: falls towards the input. "
                "Exploding: above 1 and rising.", "profile", charts.gradient_profile(last))
    progress("reading histograms")
    flagged = ([(focus.run, focus.layer)] if focus else []) + [(f.run, f.layer) for f in found
                                                               if f.stream == "activation"]
    pairs = list(dict.fromkeys(flagged))[:MAX_HIST_PAIRS]
    if not pairs:  # no finding on an activation: the first run's layers
        pairs = [tuple(r) for r in acts.filter(pl.col("run") == first).select("run", "layer").unique(
            maintain_order=True).rows()][:MAX_HIST_PAIRS]
    hist = _compact(histogram_frame(analysis.histograms(pairs)))
    if hist.height:
        section("Histogram over time", f"Share of values per fixed bin (exact zero and ±inf have bins of their "
                f"own), for {len(pairs)} layer(s) with findings; every reading's histogram is in the traces' "
                "`hist` column.", "histogram", charts.histogram_over_time(
                    hist, f"{focus.run} · {focus.layer}" if focus else None))
    progress("writing page")
    runs = [{"run": meta.get("run_name"), "framework": f"{meta.get('framework')} {meta.get('framework_version')}",
             "adapter": meta.get("adapter"), "mode": meta.get("mode"), "probe": meta.get("probe_fingerprint"),
             "created": meta.get("created"), "host": meta.get("host"), "config": meta.get("config"),
             "file": meta["file"]} for meta in analysis.runs]
    n_runs = m["run"].n_unique()
    n_layers = m.select("run", "layer").unique().height
    page = PAGE.format(
        bundle=vl_convert.javascript_bundle(vl_version=vl_version_for_vl_convert()),
        subtitle=html.escape(f"{n_runs} run(s), {n_layers} layer readings series, "
                             f"{len(found)} finding(s)"),
        findings=_findings_html(found), comparison=_comparison_html(compared), sections="\n".join(sections),
        runs=_table(runs, ["run", "framework", "adapter", "mode", "probe", "created", "host", "config", "file"]),
        specs="{" + ",".join(f'"{k}": {v}' for k, v in specs.items()) + "}")
    return page
