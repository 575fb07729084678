"""Cross-run alignment and comparison: which runs and layers differ most from a baseline run.

Layers align by name when every run has the same layer names, else by order among layers of
the same kind (`relu[2]` is each run's third ReLU), or by a user mapping file. The x-axis is
the step, or the fraction of training (`progress`), so runs of different lengths line up.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import polars as pl

COMPARED = ["dead_fraction", "sparsity", "saturation_value", "saturation_unit", "mean", "std", "grad_norm"]


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
    if x not in ("step", "progress"):
        raise ValueError(f"--x must be 'step' or 'progress', got {x!r}")
    layers = m.select("run", "layer", "layer_index", "kind").unique().sort("run", "layer_index", "layer", "kind")
    if mapping:
        layers = layers.with_columns(pl.struct("run", "layer").map_elements(
            lambda r: mapping.get((r["run"], r["layer"]), r["layer"]), return_dtype=pl.String).alias("aligned"))
    else:  # a name every run has aligns by name; the other layers by their order among their kind
        shared = pl.col("run").n_unique().over("layer", "kind") == layers["run"].n_unique()
        order = pl.col("layer_index").rank("dense").over("run", "kind", shared).cast(pl.Int64) - 1
        layers = layers.with_columns(pl.when(shared).then(pl.col("layer"))
                                     .otherwise(pl.col("kind") + "[" + order.cast(pl.String) + "]").alias("aligned"))
    # a layer read under two kinds (an LSTM's output sequence `tanh`, its parameters `other`) keeps each
    out = m.join(layers.select("run", "layer", "kind", "aligned"), on=["run", "layer", "kind"], how="left",
                 maintain_order="left")
    if x == "progress":
        span = pl.col("step").max().over("run") - pl.col("step").min().over("run")
        prog = (pl.col("step") - pl.col("step").min().over("run")) / pl.when(span > 0).then(span).otherwise(1)
        return out.with_columns(prog.alias("x"))
    return out.with_columns(pl.col("step").cast(pl.Float64).alias("x"))


NOISE = 1e-6  # relative: differences within it are float rounding between frameworks' kernels


def compare(a: pl.DataFrame, baseline: str | None = None, *, x: str = "step", top: int = 20) -> pl.DataFrame:
    """Per metric, the (run, layer) pairs that differ most from the baseline run on average, from
    metrics aligned by `align(m, mapping, x)`."""
    runs = a["run"].unique(maintain_order=True).to_list()
    if len(runs) < 2:
        return pl.DataFrame()
    baseline = baseline or runs[0]
    if baseline not in runs:
        raise ValueError(f"--baseline {baseline!r} is not one of the runs: {', '.join(runs)}")
    bins = 20  # progress is compared on a grid of 5 % of training; steps compare exactly
    key = (pl.col("x") * bins).round() / bins if x == "progress" else pl.col("x")
    long = (a.with_columns(key.alias("x")).unpivot(index=["run", "aligned", "stream", "x", "units"], on=COMPARED,
                                                  variable_name="metric").drop_nulls("value")
            .group_by("run", "aligned", "stream", "x", "metric").agg(pl.col("value").mean(), pl.col("units").max()))
    base = long.filter(pl.col("run") == baseline).drop("run").rename({"value": "baseline_value",
                                                                      "units": "baseline_units"})
    other = long.filter(pl.col("run") != baseline)
    joined = other.join(base, on=["aligned", "stream", "x", "metric"], how="inner", maintain_order="left")
    scale = pl.when(pl.col("metric").is_in(["grad_norm", "std"]))
    diff = scale.then((pl.col("value").abs() + 1e-12).log10() - (pl.col("baseline_value").abs() + 1e-12).log10()
                      ).otherwise(pl.col("value") - pl.col("baseline_value"))
    return (joined.with_columns(diff.alias("difference"))
            .group_by("metric", "run", "aligned", "stream")
            .agg(pl.col("value").mean(), pl.col("baseline_value").mean(), pl.col("difference").mean(),
                 pl.len().alias("points"), pl.col("units").max(), pl.col("baseline_units").max())
            .with_columns(pl.col("difference").abs().alias("_abs"))
            # float rounding is not a difference (two frameworks' kernels round apart); NaN runs are nan_inf's
            .filter((pl.col("_abs") > NOISE * pl.max_horizontal(pl.col("value").abs(), pl.col("baseline_value").abs(),
                                                                pl.lit(1.0))) & pl.col("_abs").is_finite())
            .sort(["_abs", "metric", "run", "aligned", "stream"], descending=[True, False, False, False, False]).drop("_abs")
            .group_by("metric", maintain_order=True).head(top)
            .with_columns(pl.lit(baseline).alias("baseline")))
