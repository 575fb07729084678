"""Attention instabilities: heads collapsing to one-hot, logits growing past their own history."""
from __future__ import annotations

import numpy as np
import polars as pl

from ..trends import held_since
from ._base import Family, Rule, Threshold, make
from ._shared import rising, solving
from ._signals import streams

ATTENTION_ENTROPY_COLLAPSE = Rule(
    "attention_entropy_collapse", "warning",
    "a layer's mean over heads of their mean `attention_entropy` is below `entropy_collapse` at every reading of a "
    "streak to the last, unless the logged loss over it has a median under half its median over as long a span "
    "before (a model finding a one-hot solution); critical where every head of the layer is below it",
    "attention heads put all their mass on one key (entropy collapse, often with growing logits): normalize queries "
    "and keys (QK-norm), lower the LR, or warm up longer",
    uses=("entropy_collapse",), reads=("attention_entropy", "loss"), also="critical")
ATTENTION_LOGIT_GROWTH = Rule(
    "attention_logit_growth", "warning",
    "a layer's largest `attention_logit` (the max over heads) is ≥ `logit_growth`× its first reading (a positive "
    "one) and ≥ `logit_limit` at every reading of a streak to the last, and rising over the recent readings",
    "attention logits keep growing, a precursor of loss divergence in large transformers: QK-norm or QK-clip, a lower "
    "LR, weight decay on the query and key projections",
    uses=("logit_limit", "logit_growth"), reads=("attention_logit",))


def _collapse(view, r):
    for layer, index, steps, g in streams(view.units, "attention_entropy", pl.col("mean").mean().alias("v"),
                                          pl.col("unit").filter(pl.col("mean") < r.entropy_collapse).alias("low"),
                                          pl.len().alias("heads")):
        v = g["v"].to_numpy()
        since = held_since(v < r.entropy_collapse, 1.0)
        if since is None or solving(view.loss, steps[since], steps[-1]):
            continue
        low, heads = g["low"][-1].sort().to_list(), g["heads"][-1]
        yield make(ATTENTION_ENTROPY_COLLAPSE, view.run, layer, steps[since],
                   f"mean head entropy {v[-1]:.3f} of its maximum at step {steps[-1]} (from {v[0]:.2f} at step "
                   f"{steps[0]}), below {r.entropy_collapse:g} since step {steps[since]}; {len(low)} of {heads} heads "
                   f"below it: {', '.join(map(str, low[:16]))}", severity="critical" if len(low) == heads else None,
                   score=1 - v[-1], value=v[-1], threshold=r.entropy_collapse, first=steps[since], last=steps[-1],
                   index=index)


def _growth(view, r):
    for layer, index, steps, g in streams(view.units, "attention_logit", pl.col("max").max().alias("v"),
                                          pl.col("unit").sort_by("max").last().alias("head")):
        v = g["v"].to_numpy()
        base = float(v[0])
        grown = (v >= r.logit_limit) & (v >= r.logit_growth * base) if base > 0 else np.zeros(len(v), bool)
        since = held_since(grown, 1.0)
        if since is None or not rising(steps, v):
            continue
        yield make(ATTENTION_LOGIT_GROWTH, view.run, layer, steps[since],
                   f"max attention logit {v[-1]:.3g} (head {g['head'][-1]}) at step {steps[-1]}, {v[-1] / base:.1f}× "
                   f"its {base:.3g} at step {steps[0]} and still rising; above {r.logit_limit:g} and "
                   f"{r.logit_growth:g}× since step {steps[since]}", score=v[-1] / base, value=v[-1],
                   threshold=r.logit_limit, first=steps[since], last=steps[-1], index=index)


def check(view, r):
    yield from _collapse(view, r)
    yield from _growth(view, r)


FAMILY = Family((ATTENTION_ENTROPY_COLLAPSE, ATTENTION_LOGIT_GROWTH), check, thresholds=(
    Threshold("entropy_collapse", 0.1, "a layer's mean head entropy (over its maximum, ln keys) below this: its heads "
              "near one-hot on every query (random init reads ~1)", high=1.0),
    Threshold("logit_limit", 10.0, "the largest attention logit above this (softmax then near one-hot) ...", low=0.0),
    Threshold("logit_growth", 5.0, "... and this many times its first reading, still rising", low=1.0)))
