"""`actrace check`: a CI gate over an analysis, with text, JSON and JUnit answers.

The default gate fails on every finding of severity `fail_on` or worse (critical: a NaN, units still
dying, vanishing or exploding gradients, and every run that did not finish cleanly: failed,
stopped, never closed, or closed without a stream it was set to record). Threshold options add
rules to that gate, at each layer's last reading; `allow` accepts findings of the rules it names.
A threshold with nothing to read (no gradient reading at all for `min_grad_norm`) is a violation,
not a pass.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass

import polars as pl

from actrace.format.schema import shown

from .findings import SEVERITY_RANK, Finding
from .metrics import last_reading

# threshold option → (stream it reads, metric column, sign: +1 fails above, -1 below, what it is)
LIMITS = {
    "max_dead": ("activation", "dead_fraction", +1, "dead fraction"),
    "max_saturation": ("activation", "saturation_value", +1, "saturated share of values"),
    "max_saturation_units": ("activation", "saturation_unit", +1, "share of units pinned for every input"),
    "min_grad_norm": ("param_grad", "grad_norm", -1, "gradient norm"),
    "max_grad_norm": ("param_grad", "grad_norm", +1, "gradient norm"),
}


@dataclass
class Violation:
    """One failed rule: `gate` is a threshold option (`max_dead`) or `findings`."""

    gate: str
    run: str
    layer: str
    rule: str
    step: int
    message: str
    value: float | None = None
    threshold: float | None = None


def violations(m: pl.DataFrame, found: list[Finding], runs: list[str], *, limits: dict[str, float] | None = None,
               no_nan: bool = False, fail_on: str = "critical", allow=()) -> list[Violation]:
    """Every violation of the gate, per run in the order given; `m`: the metrics, or their last
    readings (`Analysis.latest`: all the limits read)."""
    out = []
    last = last_reading(m, "run", "layer", "stream")
    for option, limit in (limits or {}).items():
        stream, column, sign, what = LIMITS[option]
        rows = last.filter((pl.col("stream") == stream) & pl.col(column).is_not_null())  # a tanh's, not a ReLU's
        for run in runs:
            if not rows.filter(pl.col("run") == run).height:
                out.append(Violation(option, run, "-", option, -1, f"no {stream} reading with a {what} to check "
                                     f"--{option.replace('_', '-')} against", None, limit))
        beyond = pl.col(column) > limit if sign > 0 else pl.col(column) < limit
        bad = rows.filter(beyond | pl.col(column).is_nan())  # NaN is neither above nor below: it fails both
        for r in bad.sort("run", "layer_index").iter_rows(named=True):
            said = f"{what} is NaN at step {r['step']}, not {'≤' if sign > 0 else '≥'} {limit:g}" if r[column] != r[
                column] else f"{what} {r[column]:.3g} at step {r['step']} {'exceeds' if sign > 0 else 'is below'} {limit:g}"
            out.append(Violation(option, r["run"], r["layer"], option, r["step"], said, r[column], limit))
    for f in found:
        gated = fail_on != "never" and SEVERITY_RANK[f.severity] <= SEVERITY_RANK[fail_on] and f.rule not in allow
        if gated or (no_nan and f.rule == "nan_inf"):
            out.append(Violation("findings", f.run, f.layer, f.rule, f.step,
                                 f"{f.severity} finding {f.rule}" + (f" since step {f.step}" if f.step >= 0 else "")
                                 + f": {f.evidence}", f.value, f.threshold))
    order = {run: i for i, run in enumerate(runs)}
    return sorted(out, key=lambda v: (order.get(v.run, len(order)), v.gate != "findings", v.gate, v.step))


def as_text(bad: list[Violation]) -> str:
    lines = [f"{shown(v.run)} / {shown(v.layer)}: {shown(v.message)}" for v in bad]
    return "\n".join([f"check: {len(bad)} violation(s)" if bad else "check: passed"] + lines) + "\n"


def as_json(bad: list[Violation], runs: list[str]) -> str:
    return json.dumps({"passed": not bad, "runs": runs, "violations": [asdict(v) for v in bad]}, indent=2) + "\n"


def as_junit(bad: list[Violation], runs: list[str], gates: list[str]) -> str:
    """One test case per run and gate, failed with its violations: what CI systems show as tests."""
    suites = ET.Element("testsuites", name="actrace check")
    for run in runs:
        mine = [v for v in bad if v.run == run]
        suite = ET.SubElement(suites, "testsuite", name=shown(run), tests=str(len(gates)),
                              failures=str(len({v.gate for v in mine})))
        for gate in gates:
            case = ET.SubElement(suite, "testcase", classname=f"actrace.{shown(run)}", name=gate)
            failed = [v for v in mine if v.gate == gate]
            if failed:
                failure = ET.SubElement(case, "failure", message=f"{len(failed)} violation(s) of {gate}")
                failure.text = "\n".join(f"{shown(v.layer)}: {shown(v.message)}" for v in failed)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"
