"""The rulebook (docs/rulebook.md), written from the rule registry: what each rule says, when, at
what thresholds (with their flags), what it reads and what it explains. Regenerate it with
`python -m actrace.analyzer.rulebook > docs/rulebook.md`; a test holds the file to the registry.
"""
from __future__ import annotations

from .meaning import NO_MEANING
from .rules import FAMILIES, RULES_VERSION

CHANGELOG = """\
## Changelog

- **2.0** (2026-12-07): the rules leave the trace format's spec (`spec/trace-v1.md` keeps the file
  format and the metrics) and are versioned here; every findings output names this version.
  New: `layer_dead` (critical: a layer ≥ 95 % dead, however it got there: a layer gone mid-run is no
  "fixed capacity tax"), `run_running` (a trace its writer still holds: `check` says `running`, not
  failed), `grad_norm_low` / `grad_norm_high` (`check`'s gradient limits as rules), `readings_lost`
  and `trace_unreadable` (critical: a trace missing readings its writer dropped, a trace
  `--skip-invalid` left out). Each rule names the thresholds it tests (`uses`): a threshold given to
  `check` gates those rules. Causes before
  consequences: a finding another explains (`explains` below) is nested under it, with its cause's
  remedy, and never gates on its own. `variance_collapse` reads the unit std (each unit's spread
  across the probe), at 5 % of its first reading (a layer's std at 1 % before). `exploding_gradients`:
  a spike the run recovers from within a window is none; one logged loss 10× its median before counts
  as a rise (`loss_catastrophic`); 1000× without a rising loss is critical; a rise is a trend only where
  the last two readings hold it. `attention_logit_growth`: ≥ 5× its first
  reading and ≥ 10 (≥ 50 before, which a model soft-capped at 50 never reaches).
  `attention_entropy_collapse`: critical where every head of the layer collapsed. A softmax's and a
  NaN reading's dead fraction are null metrics (`analyzer/meaning.py`), no rule's exception.
- **1.4** and earlier: the rules were stated in the trace format's spec (spec/trace-v1.md's changelog).
"""


def _table_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rulebook() -> str:
    """The rulebook as Markdown."""
    out = [f"# actrace rulebook {RULES_VERSION}", "",
           "The findings rules of the reference analyzer (`actrace.analyzer`), generated from its registry "
           "(`analyzer/rules/`, one module per family). The metrics they read are the trace format's "
           "(spec/trace-v1.md §Metrics). Every threshold is an analysis option of every analyzer command "
           "(`actrace summary|findings|check|report|diff|sweep`), calibrated on the labelled corpus of "
           "`bench/bench_findings.py` (docs/findings-benchmark.md). `check` fails a run on each finding of "
           "severity `--fail-on` or worse, and on every finding of a family whose threshold was given.", "",
           "*Recent readings* are the last half of a layer's readings (the last three, of fewer than six); a "
           "*robust rise* over them is the Theil–Sen slope times their span of steps. A finding's `step` is "
           "where its pathology starts.", "",
           "## Where a metric means nothing", "",
           "| metric | null where | why |", "| --- | --- | --- |"]
    for m in NO_MEANING:
        where = [f"kind {', '.join(sorted(m.kinds))}"] if m.kinds else []
        where += [f"a kind not in {', '.join(sorted(m.only))}"] if m.only is not None else []
        where += ["a reading holding a NaN or an Inf"] if m.non_finite else []
        out.append(f"| `{m.metric}` | {'; '.join(where)} | {_table_cell(m.why)} |")
    out += ["", "## Rules", "", "| rule | severity | fires when | reads | explains | remedy |",
            "| --- | --- | --- | --- | --- | --- |"]
    for family in FAMILIES:
        for rule in family.rules:
            severity = rule.severity + (f" (or {rule.also})" if rule.also else "")
            explains = ", ".join(f"{r} ({where})" if r != "*" else "every later finding" for r, where in rule.explains)
            out.append(f"| `{rule.name}` | {severity} | {_table_cell(rule.means)} | "
                       f"{', '.join(f'`{r}`' for r in rule.reads)} | {explains or '–'} | {_table_cell(rule.advice)} |")
    out += ["", "## Thresholds", "", "| threshold | flag | default | rules | meaning |", "| --- | --- | --- | --- | --- |"]
    for family in FAMILIES:
        for t in family.thresholds:
            rules = ", ".join(f"`{r.name}`" for r in family.rules if t.name in r.uses)
            out.append(f"| `{t.name}` | `{t.flag}` | {t.default if t.default is not None else 'off'} | {rules} | "
                       f"{_table_cell(t.help)} |")
    return "\n".join(out) + "\n\n" + CHANGELOG


if __name__ == "__main__":
    print(rulebook(), end="")
