"""`actrace check`: a CI gate over an analysis: a verdict per run, with text, JSON and JUnit answers.

The gate fails a run on each of its findings of severity `fail_on` or worse (critical by default: a
NaN, units dying, a layer gone, vanishing or exploding gradients, and every run that did not finish
cleanly), and on every finding of the rules a threshold given on the command line is read by
(`--max-dead 0.2` gates dead_high, dead_growing and layer_dead at that level). A consequence (a
finding another explains: `Finding.cause`) is judged through its cause: on its own only where the
gate does not judge its cause but judges it (a NaN gradient norm under --min-grad-norm with --fail-on
never); allowing a rule (`--allow layer_dead`) allows what follows from its findings too.
A threshold with nothing to read in a run (`--max-saturation` on a ReLU-only net) is said once, as a
note, and fails only under `strict`. A run still being written (its writer holds the trace) is
`running`, not failed, unless `require_finished`. The answer is the same bytes for the same input.

Exit codes (the CLI's): 0 every run passed (or is running); 1 a run failed; 2 the input or an option
was refused (a trace that breaks the spec, a mistyped flag).
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field

import polars as pl

from actrace.format.schema import shown

from .findings import Finding
from .rules import REGISTRY, RULES_VERSION, SEVERITY_RANK, THRESHOLDS, rules_of


@dataclass
class Violation:
    """One failed rule of one run: `gate` is `findings`, or the threshold a rule was gated by."""

    gate: str
    run: str
    layer: str
    rule: str
    step: int
    message: str
    value: float | None = None
    threshold: float | None = None


@dataclass
class Verdict:
    """One run's answer: `passed`, `failed` (its `failed_rules`) or `running`."""

    run: str
    verdict: str
    failed_rules: list[str] = field(default_factory=list)


@dataclass
class Gate:
    verdicts: list[Verdict]
    violations: list[Violation]
    notes: list[str]
    gates: list[str]              # the rules (and, under --strict, thresholds) judged: JUnit's test cases per run

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.verdict == "failed"]


def unreadable(latest: pl.DataFrame, runs: list[str], given: dict) -> list[tuple[str, str, str]]:
    """(threshold, run, what it reads) for each given threshold that has nothing to read in a run:
    none of the metric-table columns the rules that test it read holds a value there."""
    out = []
    for name in given:
        columns = [c for rule in rules_of(name) for c in REGISTRY[rule].reads if c in latest.columns]
        if not columns:
            continue
        readable = latest.filter(pl.any_horizontal(pl.col(c).is_not_null() & ~pl.col(c).cast(pl.Float64).is_nan()
                                                   for c in dict.fromkeys(columns)))["run"].unique().to_list()
        out += [(name, run, " or ".join(dict.fromkeys(columns))) for run in runs if run not in readable]
    return out


def gate(latest: pl.DataFrame, found: list[Finding], runs: list[str], *, given: dict | None = None,
         no_nan: bool = False, fail_on: str = "critical", allow=(), strict: bool = False,
         require_finished: bool = False) -> Gate:
    """The gate's answer over the runs (in the order given): `latest`, each layer's last readings
    (`Analysis.latest`); `found`, the findings computed with the thresholds `given` (name → value)."""
    given = given or {}
    gated = {rule: name for name in given for rule in rules_of(name)}

    def fails(f: Finding) -> bool:
        allowed = f.rule in allow or (f.cause is not None and f.cause.split("@")[0] in allow)  # and what follows
        if allowed or (f.rule == "run_running" and not require_finished):
            return False
        severe = fail_on != "never" and SEVERITY_RANK[f.severity] <= SEVERITY_RANK[fail_on]
        return severe or f.rule in gated or (no_nan and f.rule == "nan_inf") or f.rule == "run_running"
    failing = {(f.run, f.key) for f in found if f.cause is None and fails(f)}
    out, notes = [], []
    for f in found:  # a consequence is judged through its cause: on its own only where its cause passes
        if fails(f) and (f.cause is None or (f.run, f.cause) not in failing):
            out.append(Violation(gated.get(f.rule, "findings"), f.run, f.layer, f.rule, f.step,
                                 f"{f.severity} finding {f.rule}" + (f" since step {f.step}" if f.step >= 0 else "")
                                 + (f" (because of {f.cause})" if f.cause else "") + f": {f.evidence}", f.value,
                                 f.threshold))
    silent: dict[str, list] = {}
    for name, run, columns in unreadable(latest, runs, given):
        said = f"{THRESHOLDS[name].flag}: nothing to read in run {shown(run)} (no {columns} there)"
        if strict:
            out.append(Violation(name, run, "-", name, -1, said + ", and --strict fails it", None, given[name]))
        else:
            silent.setdefault(name, []).append((run, columns))
    for name, where in silent.items():  # said once per threshold, whatever the number of runs
        names = ", ".join(shown(run) for run, _ in where[:5]) + (" …" if len(where) > 5 else "")
        notes.append(f"{THRESHOLDS[name].flag}: nothing to read (no {where[0][1]}) in {len(where)} run(s): {names}: "
                     "not judged there (--strict fails them)")
    order = {run: i for i, run in enumerate(runs)}
    out.sort(key=lambda v: (order.get(v.run, len(order)), v.gate != "findings", v.gate, v.step, v.layer, v.rule))
    running = {f.run for f in found if f.rule == "run_running"}
    verdicts = []
    for run in runs:
        rules = list(dict.fromkeys(v.rule for v in out if v.run == run))
        verdicts.append(Verdict(run, "failed" if rules else "running" if run in running else "passed", rules))
    return Gate(verdicts, out, notes, sorted(REGISTRY) + (sorted(given) if strict else []))


def as_text(g: Gate) -> str:
    n = len(g.verdicts)
    head = "check: passed" if g.passed else f"check: {len(g.failed)} of {n} run(s) failed, {len(g.violations)} " \
                                             f"violation(s)"
    lines = [f"{head} (rules {RULES_VERSION})"]
    lines += [f"  {shown(v.run)}: {v.verdict}" + (f" ({', '.join(v.failed_rules)})" if v.failed_rules else "")
              for v in g.verdicts]
    lines += [f"{shown(v.run)} / {shown(v.layer)}: {shown(v.message)}" for v in g.violations]
    lines += [f"note: {shown(n)}" for n in g.notes]
    return "\n".join(lines) + "\n"


def as_json(g: Gate) -> str:
    return json.dumps({"passed": g.passed, "rules_version": RULES_VERSION, "runs": [asdict(v) for v in g.verdicts],
                       "violations": [asdict(v) for v in g.violations], "notes": g.notes}, indent=2) + "\n"


def as_junit(g: Gate) -> str:
    """One test suite per run, one test case per run and rule (and given threshold), failed with its
    violations: what CI systems show as tests."""
    suites = ET.Element("testsuites", name=f"actrace check (rules {RULES_VERSION})")
    for verdict in g.verdicts:
        run = verdict.run
        mine = [v for v in g.violations if v.run == run]
        suite = ET.SubElement(suites, "testsuite", name=shown(run), tests=str(len(g.gates)),
                              failures=str(len({v.rule for v in mine})),
                              skipped=str(len(g.gates) if verdict.verdict == "running" else 0))
        for rule in g.gates:
            case = ET.SubElement(suite, "testcase", classname=f"actrace.{shown(run)}", name=rule)
            failed = [v for v in mine if v.rule == rule]
            if verdict.verdict == "running":  # judged when it ends (--require-finished fails it now)
                ET.SubElement(case, "skipped", message="the run is still being written")
            elif failed:
                failure = ET.SubElement(case, "failure", message=f"{len(failed)} violation(s) of {rule}")
                failure.text = "\n".join(f"{shown(v.layer)}: {shown(v.message)}" for v in failed)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"
