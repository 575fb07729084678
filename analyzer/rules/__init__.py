"""The rule registry: every findings rule, its thresholds and what it explains, in one place.

Each module here (but those whose name starts with `_`) declares one `FAMILY` (`_base.Family`): the
rules one check says and the thresholds it reads. Adding a rule is adding a module and its test:
the analysis (`analyzer.findings`), the CLI's threshold flags, the gate (`analyzer.check`), the
rulebook (docs/rulebook.md, `rulebook()`) and `Rules` all come from the declarations.

The rules are versioned apart from the trace format (`RULES_VERSION`, docs/rulebook.md's changelog):
a verdict names the rules that produced it, so a CI job can pin them.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import field, make_dataclass

from ._base import SEVERITY_RANK, Family, Finding, Rule, RunView, Threshold

RULES_VERSION = "2.0"


def _families() -> tuple[Family, ...]:
    found = []
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
        family = getattr(importlib.import_module(f"{__name__}.{module}"), "FAMILY", None)
        if not isinstance(family, Family):
            raise ImportError(f"analyzer/rules/{module}.py declares no FAMILY: every rule module declares one")
        found.append(family)
    return tuple(found)


FAMILIES = _families()
REGISTRY: dict[str, Rule] = {rule.name: rule for family in FAMILIES for rule in family.rules}
THRESHOLDS: dict[str, Threshold] = {t.name: t for family in FAMILIES for t in family.thresholds}
Rules = make_dataclass("Rules", [(t.name, float | int | None, field(default=t.default)) for t in THRESHOLDS.values()],
                       frozen=True, namespace={"__doc__": "The findings rules' thresholds (analysis options, never "
                                                          "recorded in traces): one field per `Threshold` declared."})


def family_of(threshold: str) -> Family:
    """The family whose rules read `threshold`."""
    return next(f for f in FAMILIES if any(t.name == threshold for t in f.thresholds))


def rules_of(threshold: str) -> tuple[str, ...]:
    """The rules that test a threshold (`Rule.uses`): a gate given that threshold judges them."""
    return tuple(rule.name for rule in family_of(threshold).rules if threshold in rule.uses)


__all__ = ["FAMILIES", "REGISTRY", "RULES_VERSION", "Rules", "SEVERITY_RANK", "THRESHOLDS", "Finding",
           "Rule", "RunView", "Threshold", "family_of", "rules_of"]
