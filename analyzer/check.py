"""`actrace check`: gate rules over the metrics at each layer's last reading, for CI."""
from __future__ import annotations

import polars as pl

from .findings import SEVERITY_RANK, Finding
from .metrics import last_reading


def violations(m: pl.DataFrame, found: list[Finding], *, max_dead=None, max_saturation=None,
               max_saturation_units=None, no_nan=False, min_grad_norm=None, max_grad_norm=None,
               fail_on=None) -> list[str]:
    """One line per violated rule; with no explicit rule, critical findings are the rules."""
    last = last_reading(m, "run", "layer", "stream")
    out = []

    def over(df, column, limit, sign, what):
        bad = df.filter(pl.col(column) > limit if sign > 0 else pl.col(column) < limit)
        for r in bad.sort("run", "layer_index").iter_rows(named=True):
            out.append(f"{r['run']} / {r['layer']}: {what} {r[column]:.3g} at step {r['step']} "
                       f"{'exceeds' if sign > 0 else 'is below'} {limit:g}")

    act = last.filter(pl.col("stream") == "activation")
    grad = last.filter(pl.col("stream") == "param_grad")
    if max_dead is not None:
        over(act, "dead_fraction", max_dead, +1, "dead fraction")
    if max_saturation is not None:
        over(act, "saturation_value", max_saturation, +1, "saturated share of values")
    if max_saturation_units is not None:
        over(act, "saturation_unit", max_saturation_units, +1, "share of units pinned for every input")
    if min_grad_norm is not None:
        over(grad, "grad_norm", min_grad_norm, -1, "gradient norm")
    if max_grad_norm is not None:
        over(grad, "grad_norm", max_grad_norm, +1, "gradient norm")
    if no_nan:
        out += [f"{f.run} / {f.layer}: {f.evidence}" for f in found if f.rule == "nan_inf"]
    explicit = any(v is not None for v in (max_dead, max_saturation, max_saturation_units, min_grad_norm,
                                           max_grad_norm)) or no_nan
    fail_on = fail_on or ("never" if explicit else "critical")
    if fail_on != "never":
        out += [f"{f.run} / {f.layer}: {f.severity} finding {f.rule} since step {f.step}: {f.evidence}"
                for f in found if SEVERITY_RANK[f.severity] <= SEVERITY_RANK[fail_on]]
    return out
