"""`actrace report`: one self-contained, offline HTML page, for one run or two hundred.

`build_report` chooses what the page shows (`choose`: the runs' order, the finding it opens on, how
many steps each chart can carry), draws each section from its own frame (`draw`), and assembles the
page (`analyzer.page`). The first screen leads with the most urgent finding and an overview of runs ×
rules; a click there opens a run in every chart; a filter narrows the runs by name or config. The
Vega/Vega-Lite/vega-embed JavaScript is inlined (vl-convert ships it), so no request leaves the page.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass

import numpy as np
import polars as pl

from actrace.format import bins
from actrace.format.recurrent import describe

from . import charts, page
from .analysis import Analysis, Baseline
from .diff import as_text
from .findings import RULES_VERSION, SEVERITY_RANK, Finding, group
from .metrics import last_reading, non_finite
from .summary import NO_BASELINE

SIG_DIGITS = 3            # floats in the embedded data: what a chart or a tooltip resolves
HEAT_ROWS = 80_000        # (run, layer, step) rows of the heatmaps together: about 3 MiB of page at any fleet size
MAX_STEPS, MIN_STEPS = 60, 12
MAX_TREND_STEPS, MAX_TREND_RUNS = 40, 12  # runs overlaid in the trends: the baseline and the worst; all runs
#                                           are in the small multiples
MAX_HIST_PAIRS, MAX_HIST_STEPS = 12, 24
MULTIPLE_ROWS = 24_000    # points of the small multiples together


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


def _spec_json(chart) -> str:
    return json.dumps(chart.to_dict()).replace("<", "\\u003c")


@dataclass
class Choice:
    """What the page shows, decided once from the analysis."""

    first_run: str            # the run the menus open on: the baseline's first, else the first given
    compared: Baseline | None  # the baseline others are compared with (none unless one was chosen)
    menu_runs: list[str]      # the menus' order: the baseline, then the runs as given
    ranked_runs: list[str]    # worst first: by their worst finding's severity, then its score
    focus: Finding | None     # the finding the page opens on
    focus_aligned: str | None
    heat_steps: int           # steps per run the heatmaps carry
    colors: object            # one colour per run (charts.run_colors)
    search: dict[str, str]    # run → the text the filter matches: its name and config


def choose(analysis: Analysis, baseline: Baseline | None) -> Choice:
    found = analysis.findings
    names = [r.get("run_name") for r in analysis.read]
    menu = list(dict.fromkeys((baseline.runs if baseline else []) + names))
    first = menu[0]
    worst = {}
    for f in found:
        worst.setdefault(f.run, (SEVERITY_RANK[f.severity], -f.score))
    ranked = sorted(names, key=lambda n: (*worst.get(n, (len(SEVERITY_RANK), 0.0)), names.index(n)))
    focus = next((f for f in found if f.severity == "critical" and f.step >= 0),
                 next((f for f in found if f.step >= 0), None))
    focus_aligned = None
    if focus is not None:
        hit = analysis.aligned.filter((pl.col("run") == focus.run) & (pl.col("layer") == focus.layer))["aligned"]
        focus_aligned = hit[0] if hit.len() else None
    layers = analysis.metrics.select("run", "layer").unique().height
    heat_steps = int(np.clip(HEAT_ROWS / max(layers, 1), MIN_STEPS, MAX_STEPS))
    search = {r.get("run_name"): f"{r.get('run_name')} {r.get('config', '')}" for r in analysis.runs}
    return Choice(first, baseline, menu, ranked, focus, focus_aligned, heat_steps, charts.run_colors(menu), search)


@dataclass
class Section:
    chart_id: str
    title: str
    note: str
    chart: object


def _overview(analysis: Analysis, c: Choice) -> Section:
    rows = [{"run": g.first.run, "rule": g.first.rule, "severity": g.first.severity, "layers": len(g.layers),
             "step": g.first.step, "evidence": g.first.evidence} for g in group(analysis.findings)
            if g.first.cause is None]  # a consequence is its cause's cell
    seen = {r["run"] for r in rows}
    rows += [{"run": r, "rule": "no finding", "severity": "no finding", "layers": 0, "step": -1,
              "evidence": "every rule stayed silent"} for r in c.ranked_runs if r not in seen]
    rules = sorted({r["rule"] for r in rows}, key=lambda rule: (
        min(SEVERITY_RANK.get(r["severity"], 3) for r in rows if r["rule"] == rule), rule == "no finding", rule))
    df = pl.DataFrame(rows).with_columns(pl.col("run").replace_strict(c.search, default="").alias("search"))
    return Section("overview", "Overview", "Every run against every rule that fired, the worst run first; grey: "
                   "no finding. Click a cell to open that run below.", charts.overview_matrix(df, rules, c.ranked_runs))


def _multiples(analysis: Analysis, c: Choice) -> Section | None:
    """Per run and step: the loss, and the worst layer's dead fraction, saturation and the total gradient norm."""
    m = analysis.metrics
    parts = [analysis.scalars.filter(pl.col("name") == "loss").select("run", "step", pl.lit("loss").alias("metric"),
                                                                       "value")]
    acts = m.filter(pl.col("stream") == "activation").group_by("run", "step").agg(
        pl.col("dead_fraction").max().alias("dead_fraction"), pl.col("saturation_value").max().alias("saturation"))
    parts += [acts.select("run", "step", pl.lit(name).alias("metric"), pl.col(name).alias("value"))
              for name in ("dead_fraction", "saturation")]
    parts.append(m.filter(pl.col("stream") == "param_grad").group_by("run", "step").agg(
        (pl.col("grad_norm") ** 2).sum().sqrt().alias("value")).select("run", "step", pl.lit("grad_norm").alias(
            "metric"), "value"))
    df = pl.concat(parts).filter(pl.col("value").is_finite())
    if df["run"].n_unique() < 2:
        return None
    steps = int(np.clip(MULTIPLE_ROWS / (4 * df["run"].n_unique()), 8, 40))
    df = _compact(pl.concat([_thin_steps(g, steps) for _, g in df.group_by("metric", maintain_order=True)])
                  .sort("run", "metric", "step"))
    shown = [(k, t) for k, t in (("loss", "training loss"), ("dead_fraction", "worst layer's dead fraction"),
                                 ("saturation", "worst layer's saturation"), ("grad_norm", "total gradient norm"))
             if k in set(df["metric"])]
    return Section("multiples", "Every run at a glance", "One small chart per run, the worst first, of one metric "
                   "(menu) over its steps; each with its own scale.", charts.small_multiples(
                       df, shown, c.ranked_runs, pl.DataFrame({"run": list(c.search), "search": list(c.search.values())})))


def _loss(analysis: Analysis, c: Choice) -> Section | None:
    """The runs' logged loss (finite values, thinned) with their findings placed on it."""
    loss = analysis.scalars.filter((pl.col("name") == "loss") & pl.col("value").is_finite()
                                   & pl.col("run").is_in(_overlaid(c))).select("run", "step", "value")
    if not loss.height:
        return None
    found = analysis.findings_frame.filter(pl.col("severity").is_in(["critical", "warning"]) & (pl.col("step") >= 0))
    marks = found.select("run", "rule", "layer", "step", "severity", "evidence").sort("run", "step").join_asof(
        loss.sort("run", "step"), on="step", by="run", strategy="nearest", check_sortedness=False).drop_nulls("value")
    more = " The baseline and the worst runs; every run's loss is in the small multiples." \
        if loss["run"].n_unique() < len(c.menu_runs) and len(c.menu_runs) > MAX_TREND_RUNS else ""
    return Section("loss", "Loss and findings", "The training loss each run logged (`monitor.log(step, loss=...)`, "
                   "or its trainer's), every finding marked at the step it starts: a gradient norm that grows while "
                   f"the loss falls is a net learning; one that grows while the loss rises is not.{more}",
                   charts.loss_with_findings(_compact(_thin_steps(loss, 4 * MAX_TREND_STEPS)), _compact(marks),
                                             c.colors))


def _heatmaps(analysis: Analysis, c: Choice) -> Section | None:
    a = analysis.aligned
    acts = _thin_steps(a.filter(pl.col("stream") == "activation"), c.heat_steps)
    grads = _thin_steps(a.filter(pl.col("stream") == "param_grad"), c.heat_steps)
    heat = acts.select("run", "layer", "layer_index", "step", "dead_fraction", "saturation_value", "top_ratio",
                       "top_unit", non_finite().alias("activation_bad"))
    if grads.height:  # one row per (run, layer, step), its three numbers side by side
        heat = heat.join(grads.select("run", "layer", "layer_index", "step", "grad_norm", non_finite().alias("grad_bad")),
                         on=["run", "layer", "layer_index", "step"], how="full", coalesce=True, maintain_order="left")
    if not heat.height:
        return None
    return Section("heatmaps", "Layers × steps", "Per run (menu, or a click on the overview): dead fraction, saturated "
                   "share of values, gradient norm, and how far the largest unit stands above the median unit (the "
                   "same unit far above at every step is a massive activation; the tooltip names it) for every layer "
                   "and step; a black cell: that reading holds a NaN or an Inf. Layers run from input (top) to output.",
                   charts.layer_heatmaps(_compact(heat), [
                       ("dead_fraction", "dead fraction", "#b2182b", "no activation readings in this run"),
                       ("saturation_value", "saturation (values)", "#d94801",
                        "no bounded layers in this run|(saturation exists for tanh, sigmoid, …)"),
                       ("grad_norm", "gradient norm", "", "no gradient readings in this run|(an ONNX run has none)"),
                       ("top_ratio", "largest ÷ median unit", "", "no layer of 8 units or more in this run")],
                       c.menu_runs, default_run=c.focus.run if c.focus else c.first_run,
                       # black where a reading holds NaN/Inf; not saturation's: a layer of no bound has none anyway
                       bad={"dead_fraction": "activation_bad", "top_ratio": "activation_bad", "grad_norm": "grad_bad"}))


def _recurrent(analysis: Analysis, c: Choice) -> Section | None:
    """The activation readings of recurrent layers (spec §Recurrent layers: a module with a final
    hidden state `MODULE.lK.h_n`), in forward order."""
    acts = _thin_steps(analysis.aligned.filter(pl.col("stream") == "activation"), c.heat_steps)
    names = set(acts["layer"])
    own = [name for name in names if describe(name, names)]
    recurrent = _compact(acts.filter(pl.col("layer").is_in(own)).select(
        "run", "layer", "layer_index", "step", "saturation_value", "saturation_unit"))
    if not recurrent.height:
        return None
    default = next((f.run for f in analysis.findings if f.layer in set(recurrent["layer"])), c.first_run)
    return Section("recurrent", "Recurrent layers", "Per run (menu): each recurrent layer's gates, hidden state and "
                   "final states together, by layer and direction. A gate pinned open or closed for every input, or a "
                   "hidden state piling at ±1, carries no information.", charts.layer_heatmaps(recurrent, [
                       ("saturation_value", "saturation (values)", "#d94801", "no recurrent layer in this run"),
                       ("saturation_unit", "units pinned for every input", "#7f2704", "no recurrent layer in this run")],
                       c.menu_runs, default_run=default, menu="recurrent_run"))


def _heads(analysis: Analysis, c: Choice) -> Section | None:
    """Per attention head and step (spec §Derived readings): how peaked its distributions are
    (1 − mean entropy) and its mass on the first key, heads of one layer together, in depth order."""
    u = analysis.signals[1].filter(pl.col("kind").is_in(["attention_entropy", "attention_sink"]))
    if not u.height:
        return None
    u = u.with_columns(pl.col("layer").str.replace(r"\.attention_(entropy|sink)(#\d+)?$", "${2}").alias("scope"))
    entropy, sink = (u.filter(pl.col("kind") == k).select("run", "scope", "unit", "step", pl.col("layer_index"),
                                                          pl.col("mean").alias(k)) for k in ("attention_entropy",
                                                                                               "attention_sink"))
    heads = entropy.join(sink.drop("layer_index"), on=["run", "scope", "unit", "step"], how="left").select(
        "run", (pl.col("scope") + " · head " + pl.col("unit").cast(pl.String)).alias("layer"),
        (pl.col("layer_index").cast(pl.Int64) * 4096 + pl.col("unit")).alias("layer_index"), "step",
        (1 - pl.col("attention_entropy")).alias("peaked"), pl.col("attention_sink").alias("sink"))
    default = next((f.run for f in analysis.findings if f.rule.startswith("attention_")), c.first_run)
    return Section("heads", "Attention heads × steps", "Per run (menu): every attention head on the probe, recomputed "
                   "unfused whatever the kernel. Peakedness is 1 − its entropy over the most it could be: 0 spreads "
                   "evenly, 1 puts everything on one key (entropy collapse); the first-key mass is the attention sink.",
                   charts.layer_heatmaps(_compact(_thin_steps(heads, c.heat_steps)), [
                       ("peaked", "peakedness (1 − entropy)", "#6a3d9a", "no attention readings in this run"),
                       ("sink", "mass on the first key", "#1f78b4", "no attention readings in this run")],
                       c.menu_runs, default_run=default, menu="heads_run"))


def _trends(analysis: Analysis, c: Choice) -> Section | None:
    overlaid = _overlaid(c)
    a = analysis.aligned.filter(pl.col("run").is_in(overlaid))
    src = _compact(pl.concat([_thin_steps(a.filter(pl.col("stream") == s), MAX_TREND_STEPS)
                              for s in ("activation", "param_grad")], how="diagonal_relaxed").select(
        "run", "layer", "layer_index", "aligned", "x", "step", "dead_fraction", "sparsity", "saturation_value",
        "grad_norm"))
    if not src.height:
        return None
    more = f" The baseline and the {len(overlaid) - 1} worst runs are overlaid; every run is in the small " \
        "multiples." if len(overlaid) < len(c.menu_runs) else ""
    return Section("trends", "Trends", "Per layer (menu, aligned across runs): runs overlaid; click a run in the legend "
                   "to highlight it. Saturation exists for bounded kinds only (tanh, sigmoid, …), gradient norms for "
                   f"layers with parameters only.{more}", charts.trend_lines(
                       src, [("dead_fraction", "dead fraction"), ("sparsity", "sparsity (not death)"),
                             ("saturation_value", "saturation (values)"), ("grad_norm", "gradient norm")],
                       "fraction of training" if analysis.x == "progress" else "step", c.colors,
                       default_layer=c.focus_aligned,
                       why={"saturation_value": "not a bounded kind: no saturation",
                            "grad_norm": "no parameters, or no gradient readings",
                            "dead_fraction": "no activation readings", "sparsity": "no activation readings"}))


def _overlaid(c: Choice) -> list[str]:
    """The runs a chart overlays: the baseline, the run it opens on, then the worst."""
    return list(dict.fromkeys([c.first_run] + ([c.focus.run] if c.focus else []) + c.ranked_runs))[:MAX_TREND_RUNS]


def _profile(analysis: Analysis, c: Choice) -> Section | None:
    grads = analysis.metrics.filter((pl.col("stream") == "param_grad") & pl.col("run").is_in(_overlaid(c)))
    if not grads.height:
        return None
    last = _compact(last_reading(grads, "run").select("run", "layer", "layer_index", "step", "grad_norm"))
    return Section("profile", "Gradient norm across depth", "Healthy: roughly flat. Vanishing: falls towards the "
                   "input. Exploding: above 1 and rising.", charts.gradient_profile(last, c.colors))


def _histogram(analysis: Analysis, c: Choice) -> Section | None:
    flagged = ([(c.focus.run, c.focus.layer)] if c.focus else []) + [(f.run, f.layer) for f in analysis.findings
                                                                     if f.stream == "activation"]
    pairs = list(dict.fromkeys(flagged))[:MAX_HIST_PAIRS]
    if not pairs:  # no finding on an activation: the first run's layers
        pairs = [tuple(r) for r in analysis.metrics.filter((pl.col("run") == c.first_run) & (pl.col("stream") ==
                 "activation")).select("run", "layer").unique(maintain_order=True).rows()][:MAX_HIST_PAIRS]
    hist = _compact(histogram_frame(analysis.histograms(pairs)))
    if not hist.height:
        return None
    return Section("histogram", "Histogram over time", f"Share of values per fixed bin (exact zero and ±inf have bins "
                   f"of their own), for {len(pairs)} layer(s) with findings; every reading's histogram is in the "
                   "traces' `hist` column.", charts.histogram_over_time(
                       hist, f"{c.focus.run} · {c.focus.layer}" if c.focus else None))


SECTIONS = [("drawing the overview", _overview), ("drawing the loss", _loss), ("drawing heatmaps", _heatmaps),
            ("drawing recurrent layers", _recurrent), ("drawing attention heads", _heads),
            ("drawing every run", _multiples), ("drawing trends", _trends),
            ("drawing the gradient profile", _profile), ("reading histograms", _histogram)]


def draw(analysis: Analysis, c: Choice, progress=lambda msg: None) -> list[Section]:
    """Every section the analysis has something for, in the page's order."""
    import altair as alt

    alt.data_transformers.disable_max_rows()
    out = []
    for what, make in SECTIONS:
        progress(what)
        made = make(analysis, c)
        if made is not None:
            out.append(made)
    return out


def assemble(analysis: Analysis, c: Choice, sections: list[Section]) -> str:
    """The page: the lead and the overview first, the diff view after the charts of one run."""
    import vl_convert
    from altair.utils._importers import vl_version_for_vl_convert

    found = analysis.findings
    if c.compared is not None:
        others = [r for r in c.menu_runs if r not in c.compared.runs]
        parted = analysis.parted(c.compared)
        texts = {r: as_text(parted, [r]) for r in others}
        chosen = c.focus.run if c.focus and c.focus.run in texts else (others[0] if others else None)
    html_of = {s.chart_id: page.section(s.chart_id, s.title, s.note) for s in sections}
    body = [page.findings_table(found, c.search) if len(group(found)) <= 30 else
            f"<details><summary>All findings ({len(group(found))} groups of rule and run)</summary>"
            f"{page.findings_table(found, c.search)}</details>"]
    body += [html_of[k] for k in ("loss", "heatmaps", "recurrent", "heads") if k in html_of]
    body.append(page.diff_view(texts, c.compared.said, chosen) if c.compared is not None else
                f"<h2>Against the baseline</h2><p class='muted'>{html.escape(NO_BASELINE)}.</p>")
    body += [html_of[k] for k in ("multiples", "trends", "profile", "histogram") if k in html_of]
    runs = [{"run": meta.get("run_name"), "framework": f"{meta.get('framework')} {meta.get('framework_version')}",
             "adapter": meta.get("adapter"), "status": meta.get("status"), "mode": meta.get("mode"),
             "probe": meta.get("probe_fingerprint"), "created": meta.get("created"), "host": meta.get("host"),
             "config": meta.get("config"), "file": meta["file"]} for meta in analysis.runs]
    n_layers = analysis.metrics.select("run", "layer").unique().height
    return page.page(
        bundle=vl_convert.javascript_bundle(vl_version=vl_version_for_vl_convert()),
        subtitle=f"{len(analysis.runs)} run(s), {n_layers} layer readings series, {len(found)} finding(s) (rules "
                 f"{RULES_VERSION}; baseline: {c.compared.said if c.compared else 'none chosen'})",
        lead=page.urgent(found, len(analysis.runs)), overview=html_of.get("overview", ""), body="\n".join(body),
        runs_table=page.table(runs, ["run", "framework", "adapter", "status", "mode", "probe", "created", "host",
                                     "config", "file"], cls="runs", run_key="run", search=c.search),
        specs={s.chart_id: _spec_json(s.chart) for s in sections},
        first=c.focus.run if c.focus else None)


def build_report(analysis: Analysis, *, baseline: Baseline | None = None, progress=lambda msg: None) -> str:
    """The report of an analysis as one HTML page, runs compared with `baseline` (`Analysis.baseline`;
    none: no comparison, and the page says how to choose one)."""
    c = choose(analysis, baseline)
    sections = draw(analysis, c, progress)
    progress("writing page")
    return assemble(analysis, c, sections)
