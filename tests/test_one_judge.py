"""One judge: one trace gives one meaning in every command, causes come before their consequences,
the gate answers per run, and the rules are one registry (spec §Metrics; docs/rulebook.md)."""
from __future__ import annotations

import csv
import io
import json
import pkgutil

import numpy as np
import pytest

import actrace
from actrace.analyzer import analyze
from actrace.analyzer.rulebook import rulebook
from actrace.analyzer.rules import FAMILIES, REGISTRY, RULES_VERSION, THRESHOLDS
from conftest import ROOT
from traces import relu_layer, write_run

STEPS = range(0, 300, 20)


def masked_softmax_and_nan(path, masked: int = 4, lr: float = 0.1):
    """A softmax half of whose entries are masked to exact zeros (no dead unit: a softmax's zeros are
    masked entries), a ReLU with 12 of 32 units killed (dead 37.5 %), a linear layer whose reading
    holds a NaN at the last step (no dead fraction to read there), and healthy gradients."""
    rng = np.random.default_rng(0)
    with actrace.Writer(path, run=path.stem, overwrite=True, config={"lr": lr}) as w:
        for step in STEPS:
            logits = rng.normal(size=(64, 8))
            logits[:, 8 - masked:] = -np.inf
            p = np.exp(logits - logits.max(1, keepdims=True))
            w.record_activation(step, "attn", (p / p.sum(1, keepdims=True)).astype(np.float32), kind="softmax")
            w.record_activation(step, "relu", relu_layer(rng, 32, 12), kind="relu")
            h = rng.normal(size=(64, 16)).astype(np.float32)
            h[:, :3] = 0.0
            if step == STEPS[-1]:
                h[0, 5] = np.nan
            w.record_activation(step, "proj", h, kind="linear")
            w.record_param_grad(step, "relu", "weight", rng.normal(size=(32, 8)) * 0.1, kind="relu")
            w.log(step, loss=2.0 - step / 1000)


def test_one_trace_reads_one_way_in_every_command_and_engine(tmp_path, cli):
    """A softmax's zeros and a NaN reading say nothing of dead units: null in the Polars and the DuckDB
    metric tables alike, never failing `check --max-dead`, never a finding; the ReLU's 12/32 is read
    12/32 everywhere."""
    path = tmp_path / "one.parquet"
    masked_softmax_and_nan(path)
    tables = {}
    for engine in ("polars", "duckdb"):
        res = cli("summary", path, "--format", "csv", "--engine", engine)
        assert res.returncode == 0, res.stderr
        rows = list(csv.DictReader(io.StringIO(res.stdout)))
        tables[engine] = {(r["layer"], r["step"]): r["dead_fraction"] for r in rows if r["stream"] == "activation"}
    assert tables["polars"] == tables["duckdb"]
    last = str(STEPS[-1])
    assert {tables["polars"][("attn", str(s))] for s in STEPS} == {""}  # null, not 0.5
    assert tables["polars"][("proj", last)] == "" and float(tables["polars"][("proj", "0")]) == 3 / 16
    assert {float(tables["polars"][("relu", str(s))]) for s in STEPS} == {12 / 32}
    assert path.stem == "one"
    gate = cli("check", path, "--max-dead", "0.2", "--format", "json")
    answer = json.loads(gate.stdout)
    assert gate.returncode == 1 and answer["rules_version"] == RULES_VERSION
    assert {(v["layer"], v["rule"]) for v in answer["violations"]} == {("relu", "dead_high"), ("proj", "nan_inf")}
    assert cli("check", path, "--max-dead", "0.4", "--allow", "nan_inf").returncode == 0  # 37.5 % passes 40 %
    found = json.loads(cli("findings", path, "--format", "json", "--max-dead", "0.2").stdout)
    assert {(f["rule"], f["layer"]) for f in found} == {("dead_high", "relu"), ("nan_inf", "proj")}
    assert {f["rules_version"] for f in found} == {RULES_VERSION}
    table = cli("summary", path).stdout
    assert [line.split()[4] for line in table.splitlines() if line.strip().startswith("attn ")] == ["-"]
    other = tmp_path / "two.parquet"  # 6 of 8 entries masked where `one` masks 4: as many 'dead' units, if read so
    masked_softmax_and_nan(other, masked=6, lr=1.0)
    parted = json.loads(cli("diff", path, other, "--format", "json").stdout)
    assert not [p for p in parted["partings"] if p["metric"] == "dead_fraction"], parted
    swept = json.loads(cli("sweep", path, other, "--by", "lr", "--format", "json").stdout)
    assert {o["rule"] for o in swept["onsets"]} == {"nan_inf", "dead_high"}  # the ReLU's 37.5 %, not the softmax
    assert swept["rules_version"] == RULES_VERSION


def dying_stack(path, *, zeroed_at=None, dead_from=100):
    """Three ReLU layers (fc1→relu1→fc2→relu2→fc3→relu3→head) whose units all die at `dead_from` (the
    lr 0.3 sweep's runs): from then on their gradients, and the gradients of every layer before them,
    are exactly 0, while the head's are not. `zeroed_at`: relu2's weights zeroed at that step alone."""
    rng = np.random.default_rng(1)
    with actrace.Writer(path, run="dying", overwrite=True) as w:
        for step in range(0, 300, 10):
            gone = step >= dead_from if zeroed_at is None else False
            for i in (1, 2, 3):
                killed = 32 if gone or (zeroed_at is not None and i == 2 and step >= zeroed_at) else 0
                w.record_activation(step, f"fc{i}", rng.normal(size=(64, 32)).astype(np.float32) *
                                    (0.0 if killed and i == 2 and zeroed_at is not None else 1.0), kind="linear")
                w.record_activation(step, f"relu{i}", relu_layer(rng, 32, killed, batch=64), kind="relu")
            w.record_activation(step, "head", rng.normal(size=(64, 4)).astype(np.float32), kind="linear")
            for i, layer in enumerate(("fc1", "fc2", "fc3", "head")):
                starved = (gone and layer != "head") or (zeroed_at is not None and step >= zeroed_at and i < 2)
                w.record_param_grad(step, layer, "weight", rng.normal(size=(32, 32)) * (0.0 if starved else 0.05),
                                    kind="linear")
            w.log(step, loss=1.0 if step < dead_from else 1.386)


def test_a_dead_stack_is_the_cause_and_its_zero_gradients_below_are_said_under_it(tmp_path, cli):
    """The real cause (every unit dead) is the critical finding, with its remedy; the zero gradients
    below it are a consequence, nested under it ("because of it"), never a critical of their own with
    residual connections as the remedy."""
    path = tmp_path / "dying.parquet"
    dying_stack(path)
    found = analyze(path).findings
    causes = [(f.severity, f.rule, f.layer) for f in found if f.cause is None]
    assert causes[0] == ("critical", "layer_dead", "relu1"), causes
    vanishing = [f for f in found if f.rule == "vanishing_gradients"]
    assert vanishing and all(f.cause == "layer_dead@relu1" for f in vanishing), vanishing
    assert all(f.advice.startswith("a consequence of layer_dead@relu1: the layer is gone") for f in vanishing)
    said = cli("summary", path).stdout
    assert "CRITICAL layer_dead" in said and "because of it: vanishing_gradients dying / fc1" in said, said
    assert "residual connections" not in said
    gate = json.loads(cli("check", path, "--format", "json").stdout)
    assert gate["runs"] == [{"run": "dying", "verdict": "failed", "failed_rules": ["layer_dead"]}], gate


def test_a_layer_zeroed_mid_run_is_critical_not_a_capacity_tax(tmp_path):
    """fc2's weights zeroed at step 150: its output is 0 for every input (dead), the ReLU after it and
    the zero gradients below it follow: one critical cause, the rest said under it."""
    path = tmp_path / "zeroed.parquet"
    dying_stack(path, zeroed_at=150)
    found = analyze(path).findings
    (dead,) = [f for f in found if f.cause is None]
    assert (dead.severity, dead.rule, dead.layer, dead.step) == ("critical", "layer_dead", "fc2", 150), dead
    assert "fixed capacity tax" not in dead.advice
    assert {(f.rule, f.layer) for f in found if f.cause == "layer_dead@fc2"} >= {
        ("layer_dead", "relu2"), ("vanishing_gradients", "fc1")}


def spiking(path, *, recovers: bool):
    """Gradients ×1000 and the loss ×50 from step 100: for 3 steps (one corrupted batch, the run
    recovers to below its first gradient norm) or to the end (a real explosion)."""
    rng = np.random.default_rng(2)
    with actrace.Writer(path, run="spike", overwrite=True) as w:
        for step in range(200):
            up = step >= 100 and (not recovers or step < 103)
            scale = (1000.0 if up else 1.0) * (0.3 if recovers and step >= 103 else 1.0)
            for layer in ("fc1", "fc2"):
                w.record_param_grad(step, layer, "weight", rng.normal(size=(16, 16)) * 0.1 * scale, kind="linear")
            w.log(step, loss=(50.0 if up else 1.0) * (1 + 0.01 * rng.normal()))


@pytest.mark.parametrize("recovers", [True, False], ids=["one-bad-batch", "stays-up"])
def test_a_spike_the_run_recovers_from_is_no_explosion_and_one_that_stays_is_critical(tmp_path, recovers):
    path = tmp_path / "spike.parquet"
    spiking(path, recovers=recovers)
    exploding = [(f.severity, f.step) for f in analyze(path).findings if f.rule == "exploding_gradients"]
    assert exploding == ([] if recovers else [("critical", 100)]), exploding


def test_a_representation_collapse_is_found_from_each_units_spread(tmp_path):
    """Every input gives each unit the same output (units at different constants, so the layer-wide
    std stays ~1): the unit std falls 0.11 → 0.002 and variance_collapse says so; the layer's std
    alone never would."""
    rng = np.random.default_rng(3)
    centres = rng.normal(size=16)
    with actrace.Writer(tmp_path / "c.parquet", run="collapse", overwrite=True) as w:
        for step in range(0, 200, 20):
            spread = 0.114 * (0.002 / 0.114) ** (step / 180)
            h = centres + spread * rng.normal(size=(128, 16))
            w.record_activation(step, "enc", h.astype(np.float32), kind="linear")
    a = analyze(tmp_path / "c.parquet")
    unit_std = a.metrics.filter(a.metrics["layer"] == "enc")["unit_std"].to_list()
    assert unit_std[0] == pytest.approx(0.114, rel=0.1) and unit_std[-1] == pytest.approx(0.002, rel=0.1)
    assert min(a.metrics["std"].to_list()) > 0.5  # the layer-wide std looks fine
    assert [f.rule for f in a.findings] == ["variance_collapse"]


def test_a_trace_still_being_written_is_running_not_failed(tmp_path, cli):
    path = tmp_path / "live.parquet"
    w = actrace.Writer(path, run="live", flush_every=1)
    try:
        rng = np.random.default_rng(4)
        for step in range(3):
            w.record_activation(step, "relu", relu_layer(rng, 16, 0), kind="relu")
        w.flush()
        gate = cli("check", tmp_path)
        assert gate.returncode == 0 and "  live: running" in gate.stdout, gate.stdout
        strict = cli("check", tmp_path, "--require-finished")
        assert strict.returncode == 1 and "live: failed (run_running)" in strict.stdout, strict.stdout
    finally:
        w.close()
    assert cli("check", path).stdout.splitlines()[:2] == [f"check: passed (rules {RULES_VERSION})", "  live: passed"]


def test_the_same_input_gives_the_same_bytes_from_every_command(tmp_path, cli):
    for i, run in enumerate(("a", "b")):
        write_run(tmp_path / f"{run}.parquet", run, dead=lambda step, i=i: 4 * i * step // 100, loss=lambda s: 1.0)
    for command in (["summary"], ["findings", "--format", "json"], ["check", "--format", "junit"],
                    ["summary", "--baseline", "a"], ["diff", tmp_path / "a.parquet"]):
        outputs = {cli(*command, tmp_path / "b.parquet", tmp_path / "a.parquet").stdout for _ in range(3)}
        assert len(outputs) == 1, command


def test_every_rule_module_declares_its_family_and_the_rulebook_is_the_registry():
    """Adding a rule is adding a module of analyzer/rules with its FAMILY (and its test): the
    registry, the CLI flags and the rulebook follow from the declarations."""
    modules = [m.name for m in pkgutil.iter_modules([str(ROOT / "analyzer" / "rules")]) if not m.name.startswith("_")]
    assert len(modules) == len(FAMILIES)
    assert all(rule.advice and rule.means and rule.severity in ("critical", "warning", "info")
               for rule in REGISTRY.values())
    explained = {r for rule in REGISTRY.values() for r, _ in rule.explains} - {"*"}
    assert explained <= set(REGISTRY)
    from actrace.cli import build_parser

    check = build_parser()._subparsers._group_actions[0].choices["check"]
    flags = {o for action in check._actions for o in action.option_strings}
    assert {t.flag for t in THRESHOLDS.values()} <= flags
    assert (ROOT / "docs" / "rulebook.md").read_text() == rulebook(), \
        "docs/rulebook.md is stale: python -m actrace.analyzer.rulebook > docs/rulebook.md"


def test_attention_logits_grown_tenfold_past_their_history_are_said_well_below_50(tmp_path):
    """Llama's layer 1 q/k ×1.5 a reading (its logits ×2.25): said once 10× its first readings and
    above 10 (14.4 here), where the old fixed 50 (which a model soft-capped at 50 never reaches) was silent."""
    import torch
    from test_derived import llama, scale, signal_findings

    torch.manual_seed(0)
    model = llama("eager")
    found = signal_findings(model, torch.randint(0, 64, (4, 12)), tmp_path / "g.parquet", steps=7,
                            grow=lambda step: scale(model, "1", ("q_proj.weight", "k_proj.weight"), 1.5))
    (growth,) = found["attention_logit_growth"]
    assert growth.layer == "model.layers.1.self_attn.attention_logit" and 10 <= growth.value < 50, growth


def test_every_head_of_a_gpt2_layer_collapsed_fails_the_default_gate(tmp_path, cli):
    """GPT-2's layer 1 attention weights ×20, then ×1.6 a reading: every head one-hot on every query,
    no loss falling to explain it: critical, so `check` fails the run by default (a warning passed it)."""
    import torch
    from test_derived import gpt2, scale, signal_findings

    torch.manual_seed(0)
    model = gpt2("eager")
    found = signal_findings(model, torch.randint(0, 64, (4, 12)), tmp_path / "c.parquet", steps=6,
                            grow=lambda step: scale(model, "1", ("c_attn.weight",), 20.0 if step == 0 else 1.6))
    (collapse,) = found["attention_entropy_collapse"]
    assert collapse.severity == "critical" and "4 of 4 heads" in collapse.evidence, collapse
    gate = cli("check", tmp_path / "c.parquet", "--allow", "stream_missing")
    assert gate.returncode == 1 and "failed (attention_entropy_collapse" in gate.stdout, gate.stdout


@pytest.mark.parametrize("loss", ["unlogged", "one-catastrophic-step"])
def test_gradients_grown_far_past_their_history_are_critical_without_a_rising_loss_median(tmp_path, loss):
    """An LR ramp to a gradient norm 12,000× its history with no loss logged, and a ×1000 gradient bug
    whose loss hits 114 at one step and then holds level (its median ignores that step): both critical."""
    rng = np.random.default_rng(5)
    with actrace.Writer(tmp_path / "g.parquet", run="g", overwrite=True) as w:
        for step in range(200):
            up = 1.0 if step < 100 else (1.1 ** (step - 100) if loss == "unlogged" else 1000.0)
            for layer in ("fc1", "fc2"):
                w.record_param_grad(step, layer, "weight", rng.normal(size=(16, 16)) * 0.1 * up, kind="linear")
            if loss != "unlogged":
                w.log(step, loss=114.0 if step == 102 else 2.0 + 0.01 * rng.normal())
    (f,) = [f for f in analyze(tmp_path / "g.parquet").findings if f.rule == "exploding_gradients"]
    assert f.severity == "critical" and f.step == 100 if loss != "unlogged" else f.step > 100, f
    assert ("the loss hit 114" in f.evidence) == (loss != "unlogged"), f.evidence
    assert ("and on to" in f.evidence) == (loss == "unlogged"), f.evidence  # 12,000×: where it went
