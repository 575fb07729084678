"""Limits a team sets on each layer's gradient norm at its last reading (off unless given)."""
from __future__ import annotations

import polars as pl

from ._base import Family, Rule, Threshold, make

GRAD_NORM_LOW = Rule("grad_norm_low", "warning", "a layer's gradient norm at its last reading is below "
                     "`min_grad_norm` (or NaN); off unless the limit is given",
                     "gradients below the team's limit: see vanishing_gradients' remedies", reads=("grad_norm",))
GRAD_NORM_HIGH = Rule("grad_norm_high", "warning", "a layer's gradient norm at its last reading is above "
                      "`max_grad_norm` (or NaN); off unless the limit is given",
                      "gradients above the team's limit: clip gradients, lower the LR", reads=("grad_norm",))


def check(view, r):
    if r.min_grad_norm is None and r.max_grad_norm is None:
        return
    last = view.gradients.filter(pl.col("step") == pl.col("step").max().over("layer"))
    for rule, limit, sign in ((GRAD_NORM_LOW, r.min_grad_norm, -1), (GRAD_NORM_HIGH, r.max_grad_norm, +1)):
        if limit is None:
            continue
        beyond = pl.col("grad_norm") < limit if sign < 0 else pl.col("grad_norm") > limit
        for row in last.filter(beyond | pl.col("grad_norm").is_nan()).sort("layer_index", "layer").iter_rows(named=True):
            norm = row["grad_norm"]  # NaN is neither above nor below: it fails both
            said = f"gradient norm is NaN at step {row['step']}, not {'≥' if sign < 0 else '≤'} {limit:g}" if \
                norm != norm else f"gradient norm {norm:.3g} at step {row['step']} " \
                                  f"{'is below' if sign < 0 else 'exceeds'} {limit:g}"
            yield make(rule, view.run, row["layer"], row["step"], said, stream="param_grad", value=norm,
                       threshold=limit, first=row["step"], last=row["step"], index=row["layer_index"])


FAMILY = Family((GRAD_NORM_LOW, GRAD_NORM_HIGH), check, thresholds=(
    Threshold("min_grad_norm", None, "a layer's gradient norm below this at its last reading is said"),
    Threshold("max_grad_norm", None, "a layer's gradient norm above this at its last reading is said")))
