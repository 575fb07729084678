"""The derived readings' series as the signal rules read them (spec §Derived readings)."""
from __future__ import annotations

import polars as pl


def streams(frame: pl.DataFrame | None, kind: str, *values: pl.Expr):
    """(layer, layer_index, steps, rows) of each derived reading of `kind` in a run's `frame`, per step
    the `values` aggregated over its units (heads, experts)."""
    if frame is None or not frame.height:
        return
    g = frame.filter(pl.col("kind") == kind).group_by("layer", "layer_index", "step").agg(*values)
    for (layer, index), rows in g.sort("layer_index", "layer", "step").group_by("layer", "layer_index",
                                                                              maintain_order=True):
        yield layer, index, rows["step"].to_numpy(), rows
