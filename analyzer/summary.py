"""The terminal forms of an analysis: findings, a per-layer table, the comparison, CSV/JSON metrics."""
from __future__ import annotations

import polars as pl

from actrace.format.schema import shown

from .diff import Diff, as_text
from .findings import RULES_VERSION, Finding, findings_frame, group
from .meaning import DORMANT_KINDS
from .metrics import METRIC_COLUMNS, last_reading


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "nan"  # a NaN or Inf reading: not "does not apply"
    return f"{v:.0%}" if pct else f"{v:.3g}"


def format_findings(found: list[Finding]) -> str:
    """Findings grouped by rule and run, most urgent first; every affected layer is named."""
    if not found:
        return f"findings: none (every rule stayed silent; rules {RULES_VERSION})"
    groups = group(found)
    lines = [f"findings: {len(found)} in {len(groups)} group(s) of rule and run (rules {RULES_VERSION})"]
    for g in groups:
        f = g.first
        since = f" since step {f.step}" if f.step >= 0 else ""  # a run's status has no step
        pad = "    " if f.cause else ""  # a consequence, under its cause
        head = f"  {pad}because of it: {f.rule} " if f.cause else f"  {f.severity.upper():<8} {f.rule:<20} "
        lines.append(f"{head}{shown(f.run)} / {shown(f.layer)}{since}: {shown(f.evidence)}")
        if g.others:
            names = ", ".join(shown(o.layer) for o in g.others[:12]) + (", …" if len(g.others) > 12 else "")
            lines.append(f"  {pad}{'':<8} {'':<20} also {len(g.others)} more layer(s): {names}")
        if not f.cause:  # a consequence's remedy is its cause's, said there
            lines.append(f"  {'':<8} {'':<20} → {f.advice}")
    return "\n".join(lines)


def layer_table(m: pl.DataFrame) -> str:
    """Per run and layer, the activation metrics at the last reading and the last gradient norm."""
    act = m.filter(pl.col("stream") == "activation")
    act = last_reading(act, "run", "layer")
    grad = m.filter(pl.col("stream") == "param_grad")
    grad = last_reading(grad, "run", "layer").select("run", "layer", pl.col("layer_index").alias("_grad_index"),
                                                     "grad_norm")
    t = act.drop("grad_norm").join(grad, on=["run", "layer"], how="full", coalesce=True).with_columns(
        pl.coalesce("layer_index", "_grad_index").alias("layer_index")).sort("run", "layer_index", "layer",
                                                                              nulls_last=True, maintain_order=True)
    width = max([len(shown(n)) for n in t["layer"].to_list()] + [5])  # names shown whole: query, key, value
    header = f"  {'layer':<{width}} {'kind':<10} {'units':>6} {'step':>7} {'dead':>6} {'dorm':>6} {'sparse':>7} " \
             f"{'sat.v':>6} {'sat.u':>6} {'mean':>9} {'std':>9} {'grad':>9}"
    legend = ("  dead: share of units zero for every probe input; dorm: share of live units barely firing (RMS at "
              "most --dormant-tau times the layer's mean unit RMS; activation functions only); sparse: share of values exactly 0 (not death); "
              "sat.v / sat.u: saturated share of values / of units pinned for every input; grad: last parameter "
              "gradient norm; nan: the reading held a NaN or Inf; - : does not apply (saturation: bounded kinds only)")
    lines = []
    for (run,), g in t.group_by(["run"], maintain_order=True):
        lines += [f"run {shown(run)}", header]
        for r in g.iter_rows(named=True):
            lines.append(
                f"  {shown(r['layer']):<{width}} {(r['kind'] or '-'):<10} {_fmt(r['units']):>6} {_fmt(r['step']):>7} "
                f"{_fmt(r['dead_fraction'], True):>6} "
                f"{_fmt(r['dormant_fraction'] if r['kind'] in DORMANT_KINDS else None, True):>6} "
                f"{_fmt(r['sparsity'], True):>7} "
                f"{_fmt(r['saturation_value'], True):>6} {_fmt(r['saturation_unit'], True):>6} "
                f"{_fmt(r['mean']):>9} {_fmt(r['std']):>9} {_fmt(r['grad_norm']):>9}")
    return "\n".join(lines + [legend])


NO_BASELINE = ("no baseline chosen, so no run is compared with another: name one with --baseline RUN (or "
               "--baseline KEY=VALUE for the runs whose config holds it), or put baseline = \"RUN\" in actrace.toml")


def format_parting(d: Diff, baseline, runs: list[str]) -> str:
    """Where each run parts from the baseline (analyzer.diff): only differences outside its band."""
    return f"against the baseline {shown(baseline.said)} (actrace diff: differences outside its band only):\n" + \
        "\n".join("  " + line for line in as_text(d, runs).splitlines())


def machine_findings(found: list[Finding], fmt: str) -> str:
    """The findings, most urgent first, as CSV or a JSON array of records (FINDING_COLUMNS)."""
    table = findings_frame(found)
    return table.write_csv() if fmt == "csv" else table.write_json()


def machine_metrics(m: pl.DataFrame, fmt: str) -> str:
    """Per (run, layer, step) metrics in the documented column order, as CSV or a JSON array of records."""
    table = m.select(METRIC_COLUMNS)
    return table.write_csv() if fmt == "csv" else table.write_json()
