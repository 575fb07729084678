"""`actrace sweep --by KEY`: what changes along runs that differ in one config key (width, lr).

Two readings of a sweep: a µP-style coordinate check (each aligned layer's activation RMS,
√(mean² + std²), at each run's last reading against the key on log–log axes: a layer whose scale
grows or shrinks with the key, |slope| above `slope_limit`, is named with its slope; under a good
parametrization hidden activations keep their scale as the width grows), and the value of the key at
which each rule first fires (the learning rate from which units die, say).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from actrace.format.schema import shown

from .findings import RULES_VERSION, SEVERITY_RANK, Finding
from .metrics import last_reading
from .trends import theil_sen


@dataclass
class Scaling:
    """One aligned layer whose activation scale moves with the key."""

    aligned: str
    slope: float             # d log RMS / d log key
    rms: dict[str, float]    # key value (as text) → RMS at the last reading


@dataclass
class Onset:
    """The smallest value of the key at which a rule fires, and in how many of the runs at each value."""

    rule: str
    severity: str
    first: float
    runs: dict[str, str]     # key value → "k of n"


@dataclass
class Sweep:
    key: str
    values: dict[str, float]            # run → its value of the key
    also_differ: list[str]              # other config keys that vary across the runs
    scaling: list[Scaling]
    onsets: list[Onset]


def config_values(runs: list[dict], key: str) -> tuple[dict[str, float], list[str]]:
    """run → its numeric value of `key` from each trace's `config`; the other keys that vary."""
    configs = {m.get("run_name"): json.loads(m.get("config") or "{}") for m in runs}
    missing = [r for r, c in configs.items() if not isinstance(c.get(key), (int, float)) or isinstance(c.get(key), bool)]
    if missing:
        raise ValueError(f"--by {key}: {len(missing)} run(s) have no numeric {key!r} in their config "
                         f"({', '.join(missing[:5])}); the keys they have: "
                         f"{', '.join(sorted({k for c in configs.values() for k in c}))}")
    values = {r: float(c[key]) for r, c in configs.items()}
    if len(set(values.values())) < 2:
        raise ValueError(f"--by {key}: every run has {key} = {next(iter(values.values()))}: nothing to sweep")
    keys = {k for c in configs.values() for k in c} - {key}
    also = sorted(k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs.values()}) > 1)
    return values, also


def sweep(aligned: pl.DataFrame, found: list[Finding], runs: list[dict], key: str,
          slope_limit: float = 0.25) -> Sweep:
    """Scaling and onsets along `key` from the aligned metrics (or their last readings alone:
    `Analysis.latest_aligned`), the findings and the runs' configs."""
    values, also = config_values(runs, key)
    scaling = []
    acts = last_reading(aligned.filter(pl.col("stream") == "activation"), "run", "layer").with_columns(
        (pl.col("mean") ** 2 + pl.col("std") ** 2).sqrt().alias("rms"))
    for (layer,), g in acts.group_by(["aligned"], maintain_order=True):
        g = g.filter(pl.col("rms") > 0).with_columns(pl.col("run").replace_strict(values, default=None).alias("k"))
        g = g.drop_nulls("k").sort("k")
        if g["k"].n_unique() < 2:
            continue
        x, y = np.log10(g["k"].to_numpy()), np.log10(g["rms"].to_numpy())
        slope = theil_sen(x, y) if len(x) >= 3 else float((y[-1] - y[0]) / (x[-1] - x[0]))
        if abs(slope) > slope_limit:
            scaling.append(Scaling(layer, slope, {f"{k:g}": float(r) for k, r in zip(g["k"], g["rms"])}))
    onsets = []
    found = [f for f in found if f.cause is None]  # a consequence fires with its cause, not apart
    by_value = {v: [r for r in values if values[r] == v] for v in sorted(set(values.values()))}
    for rule in sorted({f.rule for f in found if f.severity != "info"}):
        fired = {f.run for f in found if f.rule == rule}
        worst = min((f.severity for f in found if f.rule == rule), key=SEVERITY_RANK.get)
        firing = [v for v, rs in by_value.items() if fired & set(rs)]
        onsets.append(Onset(rule, worst, firing[0], {f"{v:g}": f"{len(fired & set(rs))} of {len(rs)}"
                                                     for v, rs in by_value.items()}))
    return Sweep(key, values, also, sorted(scaling, key=lambda s: -abs(s.slope)),
                 sorted(onsets, key=lambda o: (o.first, SEVERITY_RANK[o.severity], o.rule)))


def as_text(s: Sweep) -> str:
    values = sorted(set(s.values.values()))
    lines = [f"sweep over {s.key}: {len(s.values)} run(s) at {', '.join(f'{v:g}' for v in values)}"]
    if s.also_differ:
        lines.append(f"  (they also differ in {', '.join(s.also_differ)}: what follows is not {s.key}'s alone)")
    lines.append(f"activation scale against {s.key} (RMS at the last reading, log–log slope):")
    if not s.scaling:
        lines.append(f"  every layer keeps its scale as {s.key} changes (|slope| ≤ 0.25)")
    for sc in s.scaling:
        lines.append(f"  {shown(sc.aligned)}: slope {sc.slope:+.2f} ({'grows' if sc.slope > 0 else 'shrinks'} as "
                     f"{s.key}^{sc.slope:.2f}): RMS " + ", ".join(f"{v:.3g} at {k}" for k, v in sc.rms.items()))
    lines.append(f"where each rule first fires along {s.key}:")
    if not s.onsets:
        lines.append("  no rule fires in any run")
    for o in s.onsets:
        lines.append(f"  {o.rule} ({o.severity}) from {s.key} = {o.first:g}: " +
                     ", ".join(f"{n} runs at {v}" for v, n in o.runs.items()))
    return "\n".join(lines) + "\n"


def as_json(s: Sweep) -> str:
    return json.dumps({**asdict(s), "rules_version": RULES_VERSION}, indent=2,
                      default=lambda v: None if isinstance(v, float) and math.isnan(v) else v) + "\n"
