"""What a rule is: its declaration (name, severity, thresholds with their flags, the metrics it
reads, what it explains, its advice), the finding it makes, and the one run's view it reads.

A rule module of `analyzer/rules/` declares a `FAMILY`: one check function and the rules it can
say (one family holds the rules that exclude each other: a layer still dying is `dead_growing`, not
also `dead_high`). The registry (`analyzer.rules`) collects them; the CLI flags, the rulebook
(docs/rulebook.md), the gate and the tests all read the declarations.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Callable

import numpy as np
import polars as pl

SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Threshold:
    """One analysis threshold: its name (a field of `Rules`), default (None: the rule is off until
    it is given), what it means, and the bounds of a valid value. Its flag is `--NAME-WITH-DASHES`."""

    name: str
    default: float | int | None
    help: str
    low: float = 0.0
    high: float = float("inf")
    whole: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Rule:
    """One rule: `severity` is the one it says at (`also`: another it may say, with the reason in
    `means`); `uses` the thresholds (of its family) it tests, which a gate given one of them judges it
    by; `reads` the metric-table columns (or trace parts) it reads; `explains` the rules whose
    findings it causes, each with where they sit: `below` (at its layer or an earlier one: the
    gradients a dead layer starves), `above` (its layer or a later one: what a collapse feeds),
    `anywhere`; `explains=("*", "anywhere")` for every later finding of the run (a NaN)."""

    name: str
    severity: str
    means: str
    advice: str
    reads: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    also: str | None = None
    explains: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Family:
    """Rules that one check says, and the thresholds it reads. `scope` is `layer` (the check is
    called once per activation layer of a run: `check(view, layer, r)`) or `run` (once per run:
    `check(view, r)`); either returns a finding, None, or an iterable of findings."""

    rules: tuple[Rule, ...]
    check: Callable
    scope: str = "run"
    thresholds: tuple[Threshold, ...] = ()


@dataclass
class Finding:
    """One finding. `value` is the number the rule tested and `threshold` the limit it crossed;
    `first_step`/`last_step` the readings it read; `step` is where the pathology starts. `cause`,
    where another finding of the run explains this one (`rule@layer` of it): a consequence, said
    under its cause, with its cause's remedy."""

    severity: str
    rule: str
    run: str
    layer: str
    step: int
    evidence: str
    advice: str
    score: float = 0.0
    stream: str = "activation"
    value: float | None = None
    threshold: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    layer_index: int | None = None
    cause: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def key(self) -> str:
        """How a consequence names this finding as its cause."""
        return f"{self.rule}@{self.layer}"


def make(rule: Rule, run, layer, step, evidence, *, severity=None, score=0.0, stream="activation", advice=None,
         value=None, threshold=None, first=None, last=None, index=None) -> Finding:
    """A finding of `rule`, its numbers as plain floats and ints."""
    def num(v):
        return None if v is None else float(v)

    def whole(v):
        return None if v is None else int(v)
    return Finding(severity or rule.severity, rule.name, run, layer, int(step), evidence, advice or rule.advice,
                   float(score), stream, num(value), num(threshold), whole(first), whole(last), whole(index))


@dataclass
class Layer:
    """One activation layer's readings in step order, as numpy arrays (nulls NaN): `g["dead_fraction"]`;
    `what`: a recurrent reading's description (`actrace.format.recurrent.describe`)."""

    name: str
    g: dict
    what: tuple[str, str] | None

    @property
    def index(self) -> int:
        return int(self.g["layer_index"][0])

    @property
    def kind(self) -> str:
        return self.g["kind"][0]


@dataclass
class RunView:
    """What the rules read of one run: its metric rows (`m`, mode `skipped` left out: `skipped`), its
    activation layers, its logged loss, its derived readings (`series`, `units`), its trace metadata
    (`meta`, None for a run given as metrics alone) and the analysis thresholds (`th`)."""

    run: str
    m: pl.DataFrame
    skipped: pl.DataFrame
    layers: list[Layer]
    loss: pl.DataFrame | None
    non_finite_loss: pl.DataFrame | None
    series: pl.DataFrame | None
    units: pl.DataFrame | None
    meta: dict | None
    th: object

    @cached_property
    def gradients(self) -> pl.DataFrame:
        """The run's parameter-gradient readings with a norm, in step and depth order."""
        return self.m.filter((pl.col("stream") == "param_grad") & pl.col("grad_norm").is_not_null()).sort(
            "step", "layer_index")

    @cached_property
    def norms(self) -> tuple[np.ndarray, list[tuple[int, str]], np.ndarray, np.ndarray]:
        """The gradient readings as arrays: steps, the layers in depth order, and per (step, layer)
        the L2 norm and the RMS (norm over √values, which compares layers of different sizes)."""
        g = self.gradients
        depth = sorted(set(zip(g["layer_index"].to_list(), g["layer"].to_list())))
        column = {layer: i for i, (_, layer) in enumerate(depth)}
        steps, row = np.unique(g["step"].to_numpy(), return_inverse=True)
        col = np.array([column[layer] for layer in g["layer"].to_list()], dtype=np.int64)
        norm, count = np.full((len(steps), len(depth)), np.nan), np.full((len(steps), len(depth)), np.nan)
        norm[row, col] = g["grad_norm"].fill_null(np.nan).to_numpy()
        count[row, col] = g["values"].fill_null(np.nan).to_numpy()
        return steps, depth, norm, norm / np.sqrt(np.maximum(count, 1))
