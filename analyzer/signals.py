"""The derived readings (spec §Derived readings) as signals of their own, apart from the layers'
health metrics: per head of an attention, per expert of a router, per position of an LM head.
A head of entropy 0 is a collapsed head, not a dead unit, so no health metric reads these rows.
"""
from __future__ import annotations

import polars as pl

from actrace.format.schema import DERIVED_KINDS, PER_UNIT_KINDS

_KEY = ["run", "layer", "layer_index", "kind", "step"]


def series(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per derived reading: its mean, min and max over every value (all heads, positions,
    tokens), how many finite values and how many not."""
    n = pl.col("count") - pl.col("nan_count") - pl.col("inf_count")
    return (rows.filter(pl.col("kind").is_in(DERIVED_KINDS))
            .select(*_KEY, pl.when(n > 0).then(pl.col("sum") / n).alias("mean"), "min", "max", n.alias("values"),
                    (pl.col("nan_count") + pl.col("inf_count")).alias("non_finite"))
            .sort("run", "layer_index", "layer", "step"))


def units(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per unit (head, expert) of each per-unit derived reading: `unit`, its `mean`
    (unit_sum / unit_count, null for a unit of no finite value), `min`, `max` and `count`."""
    lists = ["unit_sum", "unit_count", "unit_min", "unit_max"]
    d = rows.filter(pl.col("kind").is_in(PER_UNIT_KINDS)).select(*_KEY, *lists)
    if not d.height:
        return pl.DataFrame(schema={**dict(zip(_KEY, (pl.String, pl.String, pl.Int32, pl.String, pl.Int64))),
                                    "unit": pl.Int64, "mean": pl.Float64, "min": pl.Float64, "max": pl.Float64,
                                    "count": pl.Int64})
    d = d.with_columns(pl.int_ranges(pl.col("unit_sum").list.len(), dtype=pl.Int64).alias("unit")).explode(
        ["unit", *lists])
    return d.select(*_KEY, "unit",
                    pl.when(pl.col("unit_count") > 0).then(pl.col("unit_sum") / pl.col("unit_count")).alias("mean"),
                    pl.col("unit_min").cast(pl.Float64).alias("min"), pl.col("unit_max").cast(pl.Float64).alias("max"),
                    pl.col("unit_count").alias("count")).sort("run", "layer_index", "layer", "step", "unit")
