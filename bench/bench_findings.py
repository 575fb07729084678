"""Findings bench: score every findings rule on the labelled corpus of bench/findings_corpus.py.

Per rule: false criticals and false warnings on the healthy runs (which really train: the bench
checks that their loss falls), recall on the pathological runs (the pathology found by one of its
rules, at its layer and step ± one probe reading), and for runs whose loss diverges the lead time:
steps from the first finding to the divergence. Traces are trained once into --out and reused
(--rebuild trains them again); two worker processes by default.
Run: .venv/bin/python bench/bench_findings.py [--out DIR] [--jobs 2] [--rebuild] [--only NAME ...] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from actrace.format import metadata
from actrace.analyzer import analyze
from actrace.analyzer.findings import findings
from actrace.files.reader import TraceError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from findings_corpus import CASES, PROBE_EVERY, STEPS, VERSION, Case, train  # noqa: E402


def _train(args) -> tuple[str, float]:
    case, path = args
    t0 = time.perf_counter()
    train(case, path)
    return case.name, time.perf_counter() - t0


def build(cases: list[Case], out: Path, jobs: int = 2, rebuild: bool = False) -> dict[str, Path]:
    """Each case's trace under `out`, trained where missing (or all, with `rebuild`)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {c.name: out / f"{c.name}.parquet" for c in cases}
    todo = [(c, paths[c.name]) for c in cases if rebuild or not current(paths[c.name])]
    if todo:
        print(f"training {len(todo)} of {len(cases)} runs with {jobs} worker(s)…", file=sys.stderr, flush=True)
        # a worker that dies breaks the pool loudly (BrokenProcessPool), rather than leaving it waiting
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for i, done in enumerate(as_completed([pool.submit(_train, job) for job in todo]), 1):
                name, seconds = done.result()
                print(f"  [{i}/{len(todo)}] {name} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    return paths


def current(path: Path) -> bool:
    """Whether a trace is there, made by this version of the corpus."""
    try:
        return json.loads(metadata.read(path)["config"]).get("corpus") == VERSION
    except (OSError, TraceError, ValueError, KeyError):
        return False


@dataclass
class Score:
    """What the rules said of one run, against its labels."""

    case: Case
    loss: np.ndarray                 # the logged training loss per step
    findings: list                   # its findings, info left out
    diverged_at: int | None          # the loss's divergence step, if it diverged
    matched: list                    # findings that are the injected pathology, where and when it is

    @property
    def trains(self) -> bool:
        """A healthy run really trains: its loss at the end is well below its start."""
        return bool(np.nanmean(self.loss[-20:]) < 0.8 * np.nanmean(self.loss[:5]))

    said_at: int | None = None       # the first step at which a live monitor would have said a finding
    live: list = field(default_factory=list)  # a healthy run: what a live monitor said along the way
    nested: list = field(default_factory=list)  # consequences, said under their cause

    @property
    def lead_time(self) -> int | None:
        if self.diverged_at is None or self.said_at is None:
            return None
        return self.diverged_at - self.said_at


def diverged_at(loss: np.ndarray) -> int | None:
    """The first step whose loss is NaN or Inf, or above both its first value and 3× its lowest so far."""
    low = np.fmin.accumulate(np.where(np.isfinite(loss), loss, np.inf))
    bad = ~np.isfinite(loss) | ((loss > loss[0]) & (loss > 3 * low))
    return int(np.argmax(bad)) if bad.any() else None


def live(a, run: str, steps) -> dict[int, list]:
    """What the rules say of `run` reading only what was recorded up to each of `steps` (a warning
    or worse): what a monitor watching the run live, or `actrace summary` of a running trace, says."""
    m, scalars = a.metrics.filter(pl.col("run") == run), a.scalars.filter(pl.col("run") == run)
    return {step: [f for f in findings(m.filter(pl.col("step") <= step), a.rules, (), a.th,
                                       scalars.filter(pl.col("step") <= step))
                   if f.severity != "info" and f.cause is None] for step in steps}


def first_said(a, run: str, until: int) -> int | None:
    """The first step at which a live monitor says anything of `run`, trying every step up to `until`."""
    steps = sorted(s for s in set(a.metrics.filter(pl.col("run") == run)["step"].to_list()) if s <= until)
    said = live(a, run, steps)
    return next((step for step in steps if said[step]), None)


def matches(case: Case, f, diverged: int | None) -> bool:
    if f.rule not in case.rules or not any(fnmatch.fnmatchcase(f.layer, p) for p in case.layers):
        return False
    if case.window:  # from the injection until the loss diverged, ± one reading
        return case.at - PROBE_EVERY <= f.step <= (diverged if diverged is not None else 10 ** 9) + PROBE_EVERY
    return abs(f.step - case.at) <= PROBE_EVERY


def score(cases: list[Case], paths: dict[str, Path]) -> list[Score]:
    """Analyze every trace at once, as `actrace summary` would, and score each run; a healthy run
    is also read live, at each probe reading, for what a monitor would have said along the way."""
    a = analyze([paths[c.name] for c in cases])
    scalars = a.scalars
    out = []
    for case in cases:
        loss = scalars.filter((pl.col("run") == case.name) & (pl.col("name") == "loss")).sort("step")["value"]
        loss = loss.to_numpy()
        said_all = [f for f in a.findings if f.run == case.name and f.severity != "info"]
        found = [f for f in said_all if f.cause is None]  # a consequence is said under its cause, not apart
        d = diverged_at(loss)
        said = first_said(a, case.name, d + PROBE_EVERY) if d is not None else None
        along = {(f.severity, f.rule, f.layer): f for fs in live(a, case.name, range(0, STEPS, PROBE_EVERY)).values()
                 for f in fs} if case.healthy else {}
        out.append(Score(case, loss, found, d, [f for f in found if matches(case, f, d)], said, list(along.values()),
                         [f for f in said_all if f.cause is not None]))
    return out


def table(scores: list[Score]) -> str:
    """The per-rule table of the note and docs/findings-benchmark.md (Markdown)."""
    healthy = [s for s in scores if s.case.healthy]
    sick = [s for s in scores if not s.case.healthy]
    rules = sorted({f.rule for s in scores for f in s.findings} | {r for s in sick for r in s.case.rules})
    lines = [f"{len(healthy)} healthy runs ({len({s.case.family for s in healthy})} families), "
             f"{len(sick)} pathological runs.", "",
             "| rule | false critical (healthy) | false warning (healthy) | live: false critical | live: false warning "
             "| pathologies it must find | found at layer and step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for rule in rules:
        counts = [sum(f.rule == rule and f.severity == sev for s in healthy for f in getattr(s, where))
                  for where in ("findings", "live") for sev in ("critical", "warning")]
        own = [s for s in sick if rule in s.case.rules]
        hit = sum(any(f.rule == rule for f in s.matched) for s in own)
        lines.append(f"| `{rule}` | " + " | ".join(map(str, counts)) + (f" | {len(own)} | {hit} |" if own else " | – | – |"))
    crit = sum(f.severity == "critical" for s in healthy for f in s.findings)
    warn = sum(f.severity == "warning" for s in healthy for f in s.findings)
    found = sum(bool(s.matched) for s in sick)
    live_crit = sum(f.severity == "critical" for s in healthy for f in s.live)
    live_warn = sum(f.severity == "warning" for s in healthy for f in s.live)
    nested = sum(len(s.nested) for s in sick)
    lines += ["", f"**Causes before consequences**: {nested} findings of the pathological runs are consequences, said "
                  "under their cause (a dead layer's zero gradients below it, everything after a NaN, a collapse's "
                  "drifting means): none of them counts, gates or is listed apart.",
              "", f"**Healthy runs**: {crit} false criticals, {warn} false warnings "
                  f"({warn / max(len(healthy), 1) * 10:.1f} per 10 runs) at the end of the run; read live at every "
                  f"probe reading, {live_crit} false criticals and {live_warn} false warnings said along the way; "
                  f"{sum(not s.trains for s in healthy)} whose loss did not fall.",
              f"**Pathologies found** at the right layer and step (± {PROBE_EVERY} steps, one probe reading): "
              f"{found} of {len(sick)} ({found / max(len(sick), 1):.0%}).", "",
              "Lead time: steps from the first finding a live monitor would have said (the rules reading only "
              "the readings up to that step) to the step where the loss diverged (NaN, or above its first value "
              "and 3× its lowest so far).", "",
              "| diverging run | loss diverges at step | first said at step | lead time (steps) |",
              "| --- | --- | --- | --- |"]
    for s in scores:
        if s.diverged_at is not None:
            lines.append(f"| {s.case.name} | {s.diverged_at} | {s.said_at if s.said_at is not None else '–'} | "
                         f"{s.lead_time if s.lead_time is not None else '–'} |")
    return "\n".join(lines)


def details(scores: list[Score]) -> str:
    """Every false alarm, every miss, and what each pathological run was found with."""
    lines = []
    for s in scores:
        if s.case.healthy:
            for f in s.findings:
                lines.append(f"  FALSE {f.severity:<8} {s.case.name}: {f.rule} {f.layer} @{f.step}: {f.evidence}")
            for f in s.live:
                if (f.severity, f.rule, f.layer) not in {(g.severity, g.rule, g.layer) for g in s.findings}:
                    lines.append(f"  LIVE  {f.severity:<8} {s.case.name}: {f.rule} {f.layer} @{f.step}: {f.evidence}")
            if not s.trains:
                lines.append(f"  NOT TRAINING     {s.case.name}: loss {s.loss[:5].mean():.3g} → {s.loss[-20:].mean():.3g}")
        else:
            said = "; ".join(f"{f.severity[0].upper()} {f.rule} {f.layer} @{f.step}" + "".join(
                f" [then {g.rule} {g.layer} @{g.step}]" for g in s.nested if g.cause == f.key) for f in s.findings) \
                or "nothing"
            lines.append(f"  {'found ' if s.matched else 'MISSED'} {s.case.name} (want {'|'.join(s.case.rules)} at "
                         f"{'|'.join(s.case.layers)} @{s.case.at}{'+' if s.case.window else ''}): {said}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/actrace-findings-corpus"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rebuild", action="store_true", help="train every run again")
    parser.add_argument("--only", nargs="*", metavar="NAME", help="these cases only (glob patterns)")
    parser.add_argument("--markdown", type=Path, metavar="FILE", help="also write the table here")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(fnmatch.fnmatchcase(c.name, p) for p in args.only)]
    t0 = time.perf_counter()
    paths = build(cases, args.out, args.jobs, args.rebuild)
    print(f"corpus ready in {time.perf_counter() - t0:.0f} s; scoring…", file=sys.stderr, flush=True)
    scores = score(cases, paths)
    print(details(scores))
    print()
    text = table(scores)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
