"""A dead expert: one no probe token reaches."""
from __future__ import annotations

import numpy as np
import polars as pl

from ..trends import held_since
from ._base import Family, Rule, Threshold, make
from ._signals import streams

DEAD_EXPERT = Rule(
    "dead_expert", "warning",
    "an expert's tokens (`unit_sum` of `expert_load`) are 0 at every reading of a streak to the last, while the "
    "router's experts average ≥ `expert_tokens` tokens there",
    "an expert no probe token reaches stops learning: raise the router's load-balancing loss, add router noise or a "
    "capacity limit, or re-initialize that expert's router weights", uses=("expert_tokens",), reads=("expert_load",))


def check(view, r):
    for layer, index, steps, g in streams(view.units, "expert_load", (pl.col("mean") * pl.col("count")).alias("tokens"),
                                          pl.col("unit").alias("expert")):
        tokens = np.vstack(g["tokens"].to_numpy())  # [step, expert]
        enough = tokens.mean(1) >= r.expert_tokens  # else too few probe tokens per expert to tell
        for e in np.flatnonzero((tokens[-1] == 0) & enough[-1]):
            since = held_since((tokens[:, e] == 0) & enough, 1.0)
            yield make(DEAD_EXPERT, view.run, layer, steps[since],
                       f"expert {g['expert'][-1][int(e)]} got no probe token at step {steps[-1]} (the others "
                       f"{int(np.delete(tokens[-1], e).min())} to {int(tokens[-1].max())}), none since step "
                       f"{steps[since]}", score=tokens.mean(1)[-1], value=0, threshold=r.expert_tokens,
                       first=steps[since], last=steps[-1], index=index)


FAMILY = Family((DEAD_EXPERT,), check, thresholds=(
    Threshold("expert_tokens", 5.0, "an expert with no token is said where the router's experts average this many"),))
