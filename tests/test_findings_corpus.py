"""A slice of the labelled corpus of bench/bench_findings.py, trained and scored as the bench does:
healthy runs that really train give no finding (a net leaving its initial plateau is not
exploding, nor a body unfrozen after a linear probe; BERT's tiny query/key gradients at
initialization are not vanishing), and each injected pathology is found by its rule at its layer
and step (a layer dying one unit at a time; a loss made NaN, named as the loss)."""
from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from bench_findings import build, score  # noqa: E402
from findings_corpus import CASES  # noqa: E402

HEALTHY = ["mlp-plateau-gelu", "mlp-plateau-tanh", "mlp-relu-few-dead", "mlp-relu-lpft", "bert-adam", "llama-adamw-clip"]
SICK = ["kill-relu2", "dying-slow-relu2", "saturate-tanh2", "vanishing-deep-sigmoid", "exploding-unnormalized-mlp",
        "nan-planted-fc2", "nan-loss-mlp", "lstm-forget-pinned"]


@pytest.fixture(scope="module")
def scores(tmp_path_factory):
    cases = [c for c in CASES if c.name in HEALTHY + SICK]
    return {s.case.name: s for s in score(cases, build(cases, tmp_path_factory.mktemp("corpus"), jobs=2))}


@pytest.mark.parametrize("name", HEALTHY)
def test_a_healthy_run_that_trains_gets_no_finding_at_its_end_nor_along_the_way(scores, name):
    s = scores[name]
    assert s.trains, f"{name} does not train: its loss went {s.loss[:5].mean():.3g} → {s.loss[-20:].mean():.3g}"
    assert [(f.severity, f.rule, f.layer, f.evidence) for f in s.findings] == []
    assert [(f.severity, f.rule, f.layer, f.step) for f in s.live if f.severity == "critical"] == []


@pytest.mark.parametrize("name", SICK)
def test_an_injected_pathology_is_found_by_its_rule_at_its_layer_and_step(scores, name):
    s = scores[name]
    said = [(f.severity, f.rule, f.layer, f.step) for f in s.findings]
    assert s.matched, f"{name}: want {s.case.rules} at {s.case.layers} step {s.case.at}, got {said}"


def test_an_explosion_is_said_before_the_loss_diverges(scores):
    s = scores["exploding-unnormalized-mlp"]
    assert s.diverged_at is not None and s.lead_time is not None and s.lead_time > 0
