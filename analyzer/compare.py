"""Cross-run alignment: which layer of one run is which layer of another (analyzer.diff compares them).

Layers align by name when every run has the same layer names, else by order among layers of
the same kind (`relu[2]` is each run's third ReLU), or by a user mapping file. The x-axis is
the step, or the fraction of training (`progress`), so runs of different lengths line up.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import polars as pl

def load_mapping(path) -> dict[tuple[str, str], str]:
    """A mapping file: CSV with columns run,layer,aligned or JSON {run: {layer: aligned}}."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            return {(run, layer): aligned for run, layers in data.items() for layer, aligned in layers.items()}
        with path.open(newline="") as f:
            return {(row["run"], row["layer"]): row["aligned"] for row in csv.DictReader(f)}
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path}: not a layer mapping (CSV run,layer,aligned or JSON "
                         f"{{run: {{layer: aligned}}}}): {exc}") from None


def align(m: pl.DataFrame, mapping: dict | None = None, x: str = "step") -> pl.DataFrame:
    """Add `aligned` (a layer key shared across runs) and `x` (step or progress in [0, 1])."""
    return with_keys(m, layer_keys(m.select("run", "layer", "layer_index", "kind"), mapping), x)


def layer_keys(layers: pl.DataFrame, mapping: dict | None = None) -> pl.DataFrame:
    """run, layer, kind → aligned: the key each run's layer (of `layers`: run, layer, layer_index,
    kind) compares under."""
    layers = layers.unique().sort("run", "layer_index", "layer", "kind")
    if mapping:
        layers = layers.with_columns(pl.struct("run", "layer").map_elements(
            lambda r: mapping.get((r["run"], r["layer"]), r["layer"]), return_dtype=pl.String).alias("aligned"))
    else:  # a name every run has aligns by name; the other layers by their order among their kind
        shared = pl.col("run").n_unique().over("layer", "kind") == layers["run"].n_unique()
        order = pl.col("layer_index").rank("dense").over("run", "kind", shared).cast(pl.Int64) - 1
        layers = layers.with_columns(pl.when(shared).then(pl.col("layer"))
                                     .otherwise(pl.col("kind") + "[" + order.cast(pl.String) + "]").alias("aligned"))
    # a layer read under two kinds (an LSTM's output sequence `tanh`, its parameters `other`) keeps each
    # one key per (run, layer, kind), that of its first depth should a trace give it two
    return layers.unique(["run", "layer", "kind"], keep="first", maintain_order=True).select(
        "run", "layer", "kind", "aligned")


def with_keys(m: pl.DataFrame, keys: pl.DataFrame, x: str = "step") -> pl.DataFrame:
    """The metrics `m` with their `aligned` key (of `layer_keys`; the key column alone joined, the
    table's others shared) and `x`: the step, or the share of its run's steps (`progress`)."""
    if x not in ("step", "progress"):
        raise ValueError(f"--x must be 'step' or 'progress', got {x!r}")
    out = m.with_columns(m.select("run", "layer", "kind").join(keys, on=["run", "layer", "kind"], how="left",
                                                               maintain_order="left")["aligned"])
    if x == "progress":
        span = pl.col("step").max().over("run") - pl.col("step").min().over("run")
        prog = (pl.col("step") - pl.col("step").min().over("run")) / pl.when(span > 0).then(span).otherwise(1)
        return out.with_columns(prog.alias("x"))
    return out.with_columns(pl.col("step").cast(pl.Float64).alias("x"))
