"""The report's Altair charts: each a small function from a DataFrame to a chart.

Each function returns one self-contained chart (its own parameters), so every chart is embedded
in its own view and no two share a signal name.
"""
from __future__ import annotations

import altair as alt
import polars as pl

def palette(n: int) -> list[str]:
    """`n` distinct colours, none a lighter twin of another: Tableau's ten, then hues spaced by the
    golden angle at alternating lightness (many runs are told apart by highlighting, not by hue)."""
    base = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
            "#bab0ac"]
    out = base[:n]
    for i in range(len(out), n):
        hue, light = (i * 137.508) % 360, (42, 58, 50)[i % 3]
        out.append(f"hsl({hue:.0f}, 62%, {light}%)")
    return out


def run_colors(runs: list[str]) -> alt.Scale:
    """One colour per run, in the order given."""
    return alt.Scale(domain=list(runs), range=palette(len(runs)))


SEVERITY = alt.Scale(domain=["critical", "warning", "info", "no finding"],
                     range=["#b00020", "#e08000", "#7c8fa6", "#e4e7eb"])


def _select(name: str, options: list[str], label: str, default: str | None = None,
            labels: list[str] | None = None) -> alt.Parameter:
    value = default if default in options else options[0]
    return alt.param(name=name, value=value, bind=alt.binding_select(options=options, name=label,
                                                                     labels=labels or alt.Undefined))


def inline(df: pl.DataFrame) -> alt.InlineData:
    """A frame as inline CSV, once for every chart of a section: a third of the size of JSON rows,
    which repeat every key (the page's size is its data)."""
    parse = {c: "number" for c, t in df.schema.items() if t.is_numeric()}
    return alt.InlineData(values=df.write_csv(), format=alt.DataFormat(type="csv", parse=parse))


LOG_COLUMNS = ("grad_norm", "top_ratio")  # drawn on a logarithmic scale
TOOLTIPS = {"top_ratio": ["top_unit:Q"]}  # what a cell's tooltip says besides its value


def _plottable(df: pl.DataFrame, column: str) -> pl.DataFrame:
    """Rows a chart can draw: non-null, and finite and positive where the scale is logarithmic."""
    keep = pl.col(column).is_not_null()
    if column in LOG_COLUMNS:
        keep &= pl.col(column).is_finite() & (pl.col(column) > 0)
    return df.filter(keep)


def _drawable(column: str):
    """The same test in the chart, for data shared by charts of several columns."""
    valid = f"isValid(datum['{column}']) && isFinite(datum['{column}'])"
    return valid + (f" && datum['{column}'] > 0" if column in LOG_COLUMNS else "")


def _layer_axis(n_layers: int, sort) -> alt.Y:
    return alt.Y("layer:N", sort=sort, title="layer (input → output)",
                 axis=alt.Axis(labelLimit=220, labelFontSize=10 if n_layers < 60 else 7,
                               labels=n_layers <= 120))


def layer_heatmaps(df: pl.DataFrame, metrics: list[tuple[str, str, str, str]], runs: list[str],
                   default_run=None, menu: str = "heatmap_run", bad: dict[str, str] | None = None) -> alt.HConcatChart:
    """Per run (chosen in the menu named `menu`, in the order of `runs`), a layer × step heatmap
    for each (column, title, colour at 1, why a run may have none); 0 is near white, so a healthy
    layer looks healthy, and a run with nothing to show in a panel gets that reason written there.
    `bad`: per column, the column counting its reading's NaN and Inf values: such a cell is black
    (its metric is unknown, and drawn as nothing would read as healthy)."""
    bad = {c: b for c, b in (bad or {}).items() if b in df.columns}
    present = set(df["run"])
    runs = [r for r in runs if r in present]
    run = _select(menu, runs, "run ", default_run)
    order = df.select("layer", "layer_index").unique().sort("layer_index", "layer")["layer"].to_list()
    n_layers = len(order)
    height = min(max(12 * n_layers, 160), 1800)
    charts = []
    drawn_metrics = [m for m in metrics if m[0] in df.columns and not df[m[0]].is_null().all()]
    width = 260 if len(drawn_metrics) <= 3 else 220  # four panels fit a page's width, each legend above its panel
    for column, title, colour, why in drawn_metrics:
        log = column in LOG_COLUMNS
        data = _plottable(df, column)
        scale = alt.Scale(type="log", scheme="blues") if log else alt.Scale(domain=[0, 1], range=["#f7f7f7", colour])
        legend = alt.Legend(orient="top", direction="horizontal", title=None, gradientLength=width - 20,
                            format=".0e" if log else ".0%")
        rects = alt.Chart().mark_rect().encode(
            x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True)),
            y=_layer_axis(n_layers, order),
            color=alt.Color(f"{column}:Q", title=title, scale=scale, legend=legend),
            tooltip=["layer:N", "step:Q", alt.Tooltip(f"{column}:Q", format=".3g"), *TOOLTIPS.get(column, [])],
        ).transform_filter(alt.datum.run == run).transform_filter(_drawable(column))
        drawn = set(data["run"])
        empty = [r for r in runs if r not in drawn]
        note = alt.Chart(pl.DataFrame({"run": empty, "note": [why] * len(empty)}, schema={
            "run": pl.String, "note": pl.String})).mark_text(fontSize=12, color="#666", lineBreak="|").encode(
            text="note:N", x=alt.value(130), y=alt.value(height / 2)).transform_filter(alt.datum.run == run)
        broken = [alt.Chart().mark_rect(color="#111").encode(
            x=alt.X("step:O"), y=_layer_axis(n_layers, order),
            tooltip=["layer:N", "step:Q", alt.Tooltip(f"{bad[column]}:Q", title="NaN/Inf values")],
        ).transform_filter(alt.datum.run == run).transform_filter(alt.datum[bad[column]] > 0)] if column in bad else []
        charts.append(alt.layer(rects, *broken, note).properties(title=title, width=width, height=height))
    shown = [c for c, *_ in metrics if c in df.columns]
    columns = ["run", "layer", "step"] + shown + [t.split(":")[0] for c in shown for t in TOOLTIPS.get(c, [])] + \
        list(dict.fromkeys(bad.values()))
    return alt.hconcat(*charts, data=inline(df.select(columns))).add_params(run).resolve_scale(color="independent")


def trend_lines(df: pl.DataFrame, columns: list[tuple[str, str]], x_title: str, colors: alt.Scale,
                default_layer=None, why: dict[str, str] | None = None) -> alt.VConcatChart:
    """Per aligned layer (chosen in a menu), each metric over x with runs overlaid; click the
    legend to highlight one run. A layer with nothing to show in a chart gets `why[column]`."""
    why = why or {}
    layers = df.sort("layer_index", "aligned")["aligned"].unique(maintain_order=True).to_list()
    names = df.group_by("aligned").agg(pl.col("layer").unique(maintain_order=True))
    own = dict(zip(names["aligned"], names["layer"].to_list()))
    labels = [", ".join(own[a][:3]) + ("" if own[a] == [a] else f"  ({a})") for a in layers]
    layer = _select("trend_layer", layers, "layer ", default_layer, labels)
    highlight = alt.selection_point(name="trend_run", fields=["run"], bind="legend")
    charts = []
    for column, title in columns:
        if column not in df.columns or df[column].is_null().all():
            continue
        lines = alt.Chart().mark_line(point=True).encode(
            x=alt.X("x:Q", title=x_title), y=alt.Y(f"{column}:Q", title=title,
                                                   scale=alt.Scale(type="log") if column == "grad_norm" else alt.Undefined),
            color=alt.Color("run:N", scale=colors, legend=alt.Legend(symbolLimit=30)),
            opacity=alt.condition(highlight, alt.value(1.0), alt.value(0.15)),
            tooltip=["run:N", "aligned:N", "step:Q", alt.Tooltip(f"{column}:Q", format=".3g")],
        ).transform_filter(alt.datum.aligned == layer).transform_filter(_drawable(column))
        if not charts:  # the legend's selection lives in one view; the others read it
            lines = lines.add_params(highlight)
        has = set(_plottable(df, column)["aligned"])
        empty = [a for a in layers if a not in has]
        note = alt.Chart(pl.DataFrame({"aligned": empty, "note": [why.get(column, "nothing to show")] * len(empty)},
                                      schema={"aligned": pl.String, "note": pl.String})).mark_text(
            fontSize=12, color="#666").encode(text="note:N", x=alt.value(170), y=alt.value(100)).transform_filter(
            alt.datum.aligned == layer)
        charts.append(alt.layer(lines, note).properties(title=title, width=340, height=200))
    rows = [alt.hconcat(*charts[i: i + 2]) for i in range(0, len(charts), 2)]
    data = df.select("run", "aligned", "x", "step", *[c for c, _ in columns if c in df.columns])
    return alt.vconcat(*rows, data=inline(data)).add_params(layer)


def histogram_over_time(hist: pl.DataFrame, default_pair: str | None = None) -> alt.Chart:
    """One layer's histogram (chosen run · layer) as bin × step counts, log-coloured."""
    pairs = hist["pair"].unique(maintain_order=True).to_list()
    pair = _select("hist_pair", pairs, "run · layer ", default_pair)
    n_bins = hist["bin"].n_unique()
    order = hist.select("bin", "bin_label").unique().sort("bin", descending=True)["bin_label"].to_list()
    return alt.Chart(inline(hist.select("pair", "step", "bin_label", "count", "share"))).mark_rect().encode(
        x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True)),
        y=alt.Y("bin_label:N", sort=order, title="value bin", axis=alt.Axis(labelFontSize=9 if n_bins < 50 else 7)),
        color=alt.Color("share:Q", title="share of values", scale=alt.Scale(type="log", scheme="viridis")),
        tooltip=["step:Q", "bin_label:N", "count:Q", alt.Tooltip("share:Q", format=".2%")],
    ).transform_filter(alt.datum.pair == pair).add_params(pair).properties(
        title="histogram over time", width=520, height=min(max(9 * n_bins, 240), 900))


def gradient_profile(df: pl.DataFrame, colors: alt.Scale) -> alt.Chart:
    """Gradient norm across depth at each run's last gradient reading, runs overlaid."""
    highlight = alt.selection_point(name="profile_run", fields=["run"], bind="legend")
    return alt.Chart(inline(_plottable(df, "grad_norm"))).mark_line(point=True).encode(
        x=alt.X("layer_index:Q", title="depth (layer index, input → output)"),
        y=alt.Y("grad_norm:Q", scale=alt.Scale(type="log"), title="gradient L2 norm"),
        color=alt.Color("run:N", scale=colors, legend=alt.Legend(symbolLimit=30)),
        opacity=alt.condition(highlight, alt.value(1.0), alt.value(0.15)),
        tooltip=["run:N", "layer:N", "step:Q", alt.Tooltip("grad_norm:Q", format=".3g")],
    ).add_params(highlight).properties(title="gradient norm across depth (last reading)", width=560, height=260)


def loss_with_findings(loss: pl.DataFrame, marks: pl.DataFrame, colors: alt.Scale) -> alt.LayerChart:
    """Each run's logged loss over steps, with its findings marked where they start (a critical
    finding as a red cross, a warning as an orange triangle): the findings read against the loss.
    The axis ends at three times the largest of the runs' losses over their first tenth (a loss that
    blows up leaves the chart at the top, clipped, rather than flattening every other curve)."""
    highlight = alt.selection_point(name="loss_run", fields=["run"], bind="legend")
    early = loss.filter(pl.col("step") <= pl.col("step").min().over("run")
                        + 0.1 * (pl.col("step").max() - pl.col("step").min()).over("run"))
    top = 3 * float(early.group_by("run").agg(pl.col("value").median())["value"].max())
    low = min(0.0, float(loss["value"].min()))
    lines = alt.Chart(inline(loss)).mark_line(clip=True).encode(
        x=alt.X("step:Q", title="step"),
        y=alt.Y("value:Q", title="training loss", scale=alt.Scale(domain=[low, top])),
        color=alt.Color("run:N", scale=colors, legend=alt.Legend(symbolLimit=30)),
        opacity=alt.condition(highlight, alt.value(1.0), alt.value(0.15)),
        tooltip=["run:N", "step:Q", alt.Tooltip("value:Q", format=".4g", title="loss")]).add_params(highlight)
    points = alt.Chart(inline(marks.with_columns(pl.col("value").clip(upper_bound=top)))).mark_point(
        size=90, filled=True).encode(
        x="step:Q", y="value:Q",
        shape=alt.Shape("severity:N", scale=alt.Scale(domain=["critical", "warning"], range=["cross", "triangle-up"])),
        color=alt.Color("severity:N", scale=alt.Scale(domain=["critical", "warning"], range=["#b00020", "#e08000"]),
                        legend=None),
        tooltip=["run:N", "rule:N", "layer:N", "step:Q", "evidence:N"])
    return alt.layer(lines, points).resolve_scale(color="independent").properties(
        title="loss, with findings where they start", width=760, height=260)


def _filtered(chart, search: pl.DataFrame | None = None):
    """A chart narrowed to the runs whose name or config holds the page's filter text (`run_filter`,
    set by the page's script); `search` (run, search) looks the text up where the data lacks it."""
    text = alt.param(name="run_filter", value="")
    if search is not None:
        chart = chart.transform_lookup(lookup="run", from_=alt.LookupData(inline(search), "run", ["search"]))
    return chart.add_params(text).transform_filter("indexof(lower(datum.search), run_filter) >= 0")


def overview_matrix(df: pl.DataFrame, rules: list[str], runs: list[str]) -> alt.Chart:
    """Runs (worst first) × rules: each cell a rule's worst finding in that run, by severity; a run
    with no finding has one grey cell. A click on a cell opens that run in the other charts."""
    height = len(runs) * (14 if len(runs) <= 60 else 9)
    return _filtered(alt.Chart(inline(df)).mark_rect(stroke="white").encode(
        x=alt.X("rule:N", sort=rules, title=None, axis=alt.Axis(orient="top", labelAngle=-35)),
        y=alt.Y("run:N", sort=runs, title=None, axis=alt.Axis(labelLimit=260, labelFontSize=11 if len(runs) <= 60
                                                              else 8)),
        color=alt.Color("severity:N", scale=SEVERITY, title="worst finding"),
        tooltip=["run:N", "rule:N", "severity:N", "layers:Q", "step:Q", "evidence:N"],
    )).properties(title="runs × rules (worst run first; click a cell to open the run)", width=max(60 * len(rules), 240),
                  height=height)


def small_multiples(df: pl.DataFrame, metrics: list[tuple[str, str]], runs: list[str],
                    search: pl.DataFrame) -> alt.Chart:
    """One small chart per run (worst first) of one metric over steps, chosen in a menu: every run
    at a glance, told apart by place rather than colour."""
    metric = _select("multiples_metric", [m for m, _ in metrics], "metric ", labels=[t for _, t in metrics])
    return _filtered(alt.Chart(inline(df)).mark_line(clip=True).encode(
        x=alt.X("step:Q", title=None, axis=alt.Axis(labels=False, ticks=False)),
        y=alt.Y("value:Q", title=None, axis=alt.Axis(tickCount=3, labelFontSize=8, format="~s")),
        tooltip=["run:N", "step:Q", alt.Tooltip("value:Q", format=".3g")],
    ).transform_filter(alt.datum.metric == metric).properties(width=120, height=48).facet(
        facet=alt.Facet("run:N", sort=runs, title=None, header=alt.Header(labelFontSize=9, labelLimit=120)),
        columns=8).resolve_scale(y="independent").add_params(metric), search)
