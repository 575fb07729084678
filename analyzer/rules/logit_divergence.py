"""Output-logit divergence: the LM head's log Z drifting up (a z-loss's business)."""
from __future__ import annotations

import polars as pl

from ..trends import held_since
from ._base import Family, Rule, Threshold, make
from ._shared import rising, solving
from ._signals import streams

LOGIT_DIVERGENCE = Rule(
    "logit_divergence", "warning",
    "an LM head's mean `log_z` is ≥ `log_z_rise` above its first reading at every reading of a streak to the last, "
    "and rising, unless the loss falls steeply over it (as attention_entropy_collapse reads it)",
    "the output logits' log-partition (log Z) drifts up: add a z-loss (1e-4 · log²Z), lower the LR",
    uses=("log_z_rise",), reads=("log_z", "loss"))


def check(view, r):
    for layer, index, steps, g in streams(view.series, "log_z", pl.col("mean").first().alias("v")):
        v = g["v"].to_numpy()
        since = held_since(v - v[0] >= r.log_z_rise, 1.0)
        if since is None or not rising(steps, v) or solving(view.loss, steps[since], steps[-1]):
            continue
        yield make(LOGIT_DIVERGENCE, view.run, layer, steps[since],
                   f"mean log Z {v[-1]:.3g} at step {steps[-1]}, {v[-1] - v[0]:.3g} nats above its {v[0]:.3g} at step "
                   f"{steps[0]} and still rising; {r.log_z_rise:g} above since step {steps[since]}",
                   score=v[-1] - v[0], value=v[-1] - v[0], threshold=r.log_z_rise, first=steps[since],
                   last=steps[-1], index=index)


FAMILY = Family((LOGIT_DIVERGENCE,), check, thresholds=(
    Threshold("log_z_rise", 5.0, "the LM head's mean log Z this many nats above its first reading, still rising (the "
              "corpus's healthy language models drift up to 1.7)"),))
