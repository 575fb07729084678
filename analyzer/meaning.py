"""Where a metric means nothing (spec §Metrics): the one owner of that, for every engine and command.

A number the metric table holds is one that means what the spec says; where it would mean
nothing it is null, never 0: a softmax's exact zeros are masked or unchosen entries, no dead units;
a reading holding a NaN or an Inf says nothing of which units are dead or dormant (its units may
hold nothing else); dormancy is a property of an activation function's neurons (ReDo), not of a
linear or norm output. The Polars metric table (`analyzer.metrics`) and the SQL engines'
(`analyzer.sql`) both apply `NO_MEANING`, so `summary`, `check`, `diff`, `sweep`, the report and
the findings rules read one number one way.
"""
from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from actrace.format.schema import ACTIVATION_KINDS

# whose units dormancy is read in (ReDo's neurons: an activation function's outputs), not a linear or
# norm output (units at −100 before a ReLU, dead after it, would make the healthy rest read dormant
# there), nor a softmax (rarely chosen classes are no dormant neurons)
DORMANT_KINDS = ACTIVATION_KINDS - {"softmax"}


@dataclass(frozen=True)
class Meaningless:
    """Where `metric` means nothing: in a reading of one of `kinds`, of a kind outside `only`
    (when given), or (`non_finite`) holding a NaN or an Inf."""

    metric: str
    why: str
    kinds: frozenset = frozenset()
    only: frozenset | None = None
    non_finite: bool = True

    def polars(self) -> pl.Expr:
        """True where the metric means nothing (a reading of no kind: kept)."""
        cond = pl.col("kind").is_in(sorted(self.kinds)).fill_null(False)
        if self.only is not None:
            cond = cond | ~pl.col("kind").is_in(sorted(self.only)).fill_null(True)
        if self.non_finite:
            cond = cond | ((pl.col("nan_count").fill_null(0) + pl.col("inf_count").fill_null(0)) > 0)
        return cond

    def sql(self, strs) -> str:
        """The same as an SQL condition; `strs` spells a tuple of strings in the dialect."""
        cond = [f"(kind IS NOT NULL AND kind IN {strs(sorted(self.kinds))})"] if self.kinds else []
        if self.only is not None:
            cond.append(f"(kind IS NOT NULL AND kind NOT IN {strs(sorted(self.only))})")
        if self.non_finite:
            cond.append("(coalesce(nan_count, 0) + coalesce(inf_count, 0) > 0)")
        return " OR ".join(cond) or "FALSE"


NO_MEANING = (
    Meaningless("dead_fraction", "a softmax's zeros are masked or unchosen entries, not dead units; a reading "
                "holding a NaN or an Inf says nothing of which units are dead", kinds=frozenset({"softmax"})),
    Meaningless("dormant_fraction", "dormancy is read in an activation function's outputs (not a softmax's); a "
                "reading holding a NaN or an Inf says nothing of it", only=frozenset(DORMANT_KINDS)),
)


def masked(lf: pl.LazyFrame | pl.DataFrame):
    """The metric rows with every metric null where it means nothing (`NO_MEANING`)."""
    return lf.with_columns(pl.when(m.polars()).then(None).otherwise(pl.col(m.metric)).alias(m.metric)
                           for m in NO_MEANING)


def sql_masked(metric: str, expr: str, strs) -> str:
    """`expr`, the SQL of `metric`, null where it means nothing."""
    for m in NO_MEANING:
        if m.metric == metric:
            return f"CASE WHEN {m.sql(strs)} THEN NULL ELSE {expr} END"
    return expr
