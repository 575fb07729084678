"""Analyzer metrics and findings on constructed pathologies; silence on a healthy run."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import actrace
from actrace.analyzer.compare import align
from actrace.analyzer.diff import diff
from actrace.analyzer.findings import Rules, findings
from actrace.analyzer.metrics import METRIC_COLUMNS, Thresholds, metrics

from traces import write_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    write_run(d / "healthy.parquet", "healthy")
    write_run(d / "dying.parquet", "dying", dead=lambda s: s // 25)          # 0 → 20 of 32 units
    write_run(d / "stable.parquet", "stable", dead=lambda s: 24)             # 75 % dead all along
    write_run(d / "saturating.parquet", "saturating", tanh_bias=lambda s: 6.0 if s >= 300 else 0.0)
    long = range(0, 2000, 100)  # trend rules need their readings: 20 of them
    write_run(d / "vanishing.parquet", "vanishing", steps=long, grad_scale=lambda s, i: 10.0 ** (-8 + i))
    # gradients flat until step 1000, then ×4 per reading; the loss falls until then, then rises
    write_run(d / "exploding.parquet", "exploding", steps=long, grad_scale=lambda s, i: 0.5 * 4 ** max(0, s / 100 - 10),
              loss=lambda s: 2.0 - s / 2000 if s < 1000 else 1.5 + (s - 1000) / 200)
    # a net leaving its plateau: gradients 30× larger from step 300 to 600, the loss falling throughout
    write_run(d / "plateau.parquet", "plateau", steps=long, grad_scale=lambda s, i: 0.05 * 30 ** min(max(s - 300, 0) / 300, 1),
              loss=lambda s: 2.0 - s / 2000)
    write_run(d / "nan.parquet", "nan", nan_at=300)
    write_run(d / "probe.parquet", "probe", fingerprint=lambda s: "aaaa" if s < 200 else "bbbb")
    write_run(d / "trainmode.parquet", "trainmode", mode="train")
    return d


def _by_run(found, run):
    return [f for f in found if f.run == run]


def test_metrics_have_the_documented_columns_and_ground_truth(runs):
    m = metrics(runs / "stable.parquet")
    assert m.columns[: len(METRIC_COLUMNS)] == METRIC_COLUMNS
    act = m.filter((pl.col("stream") == "activation") & (pl.col("layer") == "block2.relu"))
    assert act["dead_fraction"].to_list() == [0.75] * 6
    healthy = m.filter((pl.col("stream") == "activation") & (pl.col("layer") == "block0.relu"))
    assert healthy["dead_fraction"].max() == 0 and 0.45 < healthy["sparsity"].mean() < 0.55


def test_the_metric_table_is_sorted_whatever_the_order_of_the_traces_and_a_run_in_two_traces_joined(runs, tmp_path):
    """Each trace reduced on its own, their tables joined: given out of name order, every run's rows
    are where a sort puts them; a run split over two traces reads as the one trace it was."""
    from actrace.analyzer.metrics import ORDER

    given = [runs / "stable.parquet", runs / "dying.parquet", runs / "healthy.parquet"]
    m = metrics(given)
    assert m["run"].unique(maintain_order=True).to_list() == ["dying", "healthy", "stable"]
    assert m.equals(m.sort(ORDER)) and m.height == sum(metrics(p).height for p in given)
    whole = pq.read_table(runs / "healthy.parquet")
    for half, rows in (("a", whole.filter(pc.less(whole["step"], 300))), ("b", whole.filter(pc.greater_equal(
            whole["step"], 300)))):
        pq.write_table(rows, tmp_path / f"healthy-{half}.parquet")
    split = metrics([tmp_path / "healthy-b.parquet", tmp_path / "healthy-a.parquet"])
    assert split.equals(metrics(runs / "healthy.parquet")) and split["step"].n_unique() == 6
    with actrace.Writer(tmp_path / "both.parquet", run="r") as w:  # a layer's weight in one trace, its bias in another
        for step in (0, 1):
            w.record_param_grad(step, "fc", "weight", np.full((4, 4), 2.0, np.float32))
            w.record_param_grad(step, "fc", "bias", np.full(4, 3.0, np.float32))
    both = pq.read_table(tmp_path / "both.parquet")
    for param in ("weight", "bias"):
        pq.write_table(both.filter(pc.equal(both["param"], param)), tmp_path / f"{param}.parquet")
    grads = metrics([tmp_path / "weight.parquet", tmp_path / "bias.parquet"]).filter(pl.col("stream") == "param_grad")
    assert grads["grad_norm"].to_list() == pytest.approx([math.sqrt(16 * 4 + 4 * 9)] * 2)  # one norm over both
    assert grads.equals(metrics(tmp_path / "both.parquet").filter(pl.col("stream") == "param_grad"))


def test_dead_eps_is_chosen_at_analysis_time(tmp_path):
    with actrace.Writer(tmp_path / "eps.parquet") as w:
        w.record_activation(0, "fc", np.array([[0.0, 0.05, 0.5, 2.0]], np.float32), kind="relu")
    dead = {eps: metrics(tmp_path / "eps.parquet", Thresholds(dead_eps=eps))["dead_fraction"][0]
            for eps in (0.0, 0.1, 1.0)}
    assert dead == {0.0: 0.25, 0.1: 0.5, 1.0: 0.75}


def test_healthy_run_has_no_finding(runs):
    assert findings(metrics(runs / "healthy.parquet")) == []


def test_growing_dead_fraction_is_found_and_ranks_above_a_larger_stable_one(runs):
    found = findings(metrics([runs / "dying.parquet", runs / "stable.parquet"]))
    rules = [(f.rule, f.run, f.layer) for f in found]
    assert rules.index(("dead_growing", "dying", "block2.relu")) < rules.index(("dead_high", "stable", "block2.relu"))
    growing = next(f for f in found if f.rule == "dead_growing")
    # the evidence quotes the numbers the rule tested; the finding starts where the rise starts
    assert growing.severity == "critical" and "rose from 0% at step 0 to 62% at step 500" in growing.evidence
    assert growing.step == 0 and (growing.first_step, growing.last_step) == (300, 500) and growing.value >= 0.15


def test_saturation_spike_names_the_step(runs):
    (f,) = [f for f in findings(metrics(runs / "saturating.parquet")) if f.rule.startswith("saturation")]
    assert (f.rule, f.layer, f.step) == ("saturation_spike", "head.tanh", 300)


def analysis_of(path):
    from actrace.analyzer import analyze

    return analyze(path)


def test_vanishing_gradients_point_at_the_earliest_layer_and_quote_the_layers_compared(runs):
    found = _by_run(findings(metrics(runs / "vanishing.parquet")), "vanishing")
    assert [(f.rule, f.layer, f.step) for f in found] == [("vanishing_gradients", "block0.relu", 0)]
    # the first quarter of 7 layers (block0) against the last (head.tanh), both named in the evidence
    assert "in block0.relu vs" in found[0].evidence and "in head.tanh at step 1900" in found[0].evidence


def test_gradients_growing_while_the_loss_rises_explode_and_a_plateau_left_while_it_falls_does_not(runs):
    (f,) = [f for f in analysis_of(runs / "exploding.parquet").findings if f.rule == "exploding_gradients"]
    assert f.severity == "critical" and 1000 <= f.step <= 1200 and "the loss rose: its median" in f.evidence
    assert f.value >= 10 and f.threshold == 10
    assert [f.rule for f in analysis_of(runs / "plateau.parquet").findings] == []


@pytest.mark.parametrize("before, later, said", [
    ([2.2906], 2.0, "the loss still falls: its median 2.29 before, 2 since"),
    ([2.2906], 2.2904, "the loss held level: its median 2.29 before, 2.29 since"),
    ([2.2906], 2.5, "the loss rose: its median 2.29 before, 2.5 since"),
    ([1.2, 1.4, 1.3], 1.38, "the loss held level: its median 1.3 before, 1.38 since, within the spread of its "
                            "values before (±0.1)"),
    ([1.2, 1.4, 1.3], 1.45, "the loss rose: its median 1.3 before, 1.45 since")])
def test_the_loss_is_said_to_move_as_its_medians_read(before, later, said):
    """The evidence never contradicts its numbers: a loss whose medians print alike (2.2906 → 2.2904)
    held level, it does not "still fall"; a minibatch loss's noise (a median within the spread of
    the values before) is no rise."""
    from actrace.analyzer.rules._shared import loss_rose as _loss_rose

    values = (before * 10)[:10] + [later] * 10
    rose, evidence = _loss_rose(pl.DataFrame({"step": list(range(20)), "value": values}), 0, 10, 19, 10.0)
    assert rose == {"rose:": True, "still": False, "held": None}[said.split()[2]] and evidence == f"; {said}"


def test_gradients_exploding_while_the_loss_holds_level_are_a_warning_as_without_a_loss(tmp_path):
    """Gradients ×4 per reading from step 1000; the loss a minibatch's, alternating 1.9/2.1, +0.05 from
    there (within its spread): neither a rise nor a fall, so the explosion is judged as without a
    loss (100×), never dropped as if the loss fell: a warning while it stays under 1000× its history
    (capped at 4^4 = 256× here), critical where it goes on past that (4^10 by the end: rules 2.0)."""
    for cap, severity in ((4, "warning"), (10, "critical")):
        kw = dict(steps=range(0, 2000, 50), grad_scale=lambda s, i: 0.5 * 4 ** min(cap, max(0, s / 100 - 10)))
        write_run(tmp_path / "level.parquet", "level", loss=lambda s: 2.0 + 0.1 * (-1) ** (s // 50) + 0.05 * (s >= 1000),
                  **kw)
        (f,) = [f for f in analysis_of(tmp_path / "level.parquet").findings if f.rule == "exploding_gradients"]
        assert f.severity == severity and f.threshold == 100 and "the loss held level" in f.evidence, f


def test_a_run_s_findings_come_in_the_order_they_started_a_cause_before_what_follows(tmp_path):
    """By construction: units of block2 die from step 500 (dead_growing), then gradients explode
    from step 1000 as the loss rises (exploding_gradients, the larger score). The run's findings
    read in the order they started; a second, healthier run's come after the worse run's."""
    long = range(0, 2000, 100)
    write_run(tmp_path / "a.parquet", "a", steps=long, dead=lambda s: max(0, s - 500) // 60,
              grad_scale=lambda s, i: 0.5 * 4 ** max(0, s / 100 - 10),
              loss=lambda s: 2.0 - s / 2000 if s < 1000 else 1.5 + (s - 1000) / 200)
    write_run(tmp_path / "b.parquet", "b", steps=long, dead=lambda s: max(0, s - 200) // 60)
    found = [(f.run, f.rule, f.step) for f in findings(metrics(tmp_path), scalars=analysis_of(tmp_path).scalars)
             if f.severity == "critical"]
    assert [(run, rule) for run, rule, _ in found] == [("a", "dead_growing"), ("a", "exploding_gradients"),
                                                      ("b", "dead_growing")], found
    assert found[0][2] < found[1][2]


def test_without_a_logged_loss_growth_must_be_larger_and_is_critical_only_past_1000x(runs, tmp_path):
    for cap, severity in ((4, "warning"), (10, "critical")):  # 256× at most, or on to 4^10
        write_run(tmp_path / "e.parquet", "e", steps=range(0, 2000, 100),
                  grad_scale=lambda s, i: 0.5 * 4 ** min(cap, max(0, s / 100 - 10)))
        (f,) = [f for f in analysis_of(tmp_path / "e.parquet").findings if f.rule == "exploding_gradients"]
        assert f.severity == severity and "no loss was logged" in f.evidence and f.value >= 100, f


def test_nan_reports_first_step_and_layer(runs):
    (f,) = [f for f in findings(metrics(runs / "nan.parquet")) if f.rule == "nan_inf"]
    assert (f.step, f.layer, f.severity) == (300, "block3.relu", "critical")


@pytest.mark.parametrize("case", ["guarded", "log0", "forward"])
def test_a_loss_that_is_no_number_is_found_and_named_where_it_started(tmp_path, case):
    """Truth by construction, three layers: a loss made Inf at steps 3-4 whose steps a guard skipped
    (no reading holds one); a log(0) in the loss at step 3 (every gradient NaN with it, no
    activation); a NaN made in layer l1's forward at step 3 (the loss NaN with it). The first two
    are the loss's, their gradients named from the output back (l2 first); the third is l1's."""
    path = tmp_path / f"{case}.parquet"
    rng = np.random.default_rng(0)
    with actrace.Writer(path, run=case) as w:
        for step in range(8):
            bad = step == 3 or (case == "guarded" and step == 4)
            for i in range(3):
                h = np.abs(rng.normal(size=(16, 8))).astype(np.float32)
                if case == "forward" and step == 3 and i >= 1:
                    h[0, 0] = np.nan
                w.record_activation(step, f"l{i}", h, kind="relu")
                if not (case == "guarded" and bad):  # the guard skips the backward
                    g = rng.normal(size=(8, 8)) * (np.nan if bad else 1)
                    w.record_param_grad(step, f"l{i}", "weight", g, kind="relu")
            w.log(step, loss=(math.inf if case == "guarded" else math.nan) if bad else 1.0 / (step + 1))
    (f,) = [f for f in analysis_of(path).findings if f.rule == "nan_inf"]
    assert (f.severity, f.step, f.layer) == ("critical", 3, "l1" if case == "forward" else "loss"), f.evidence
    if case == "log0":
        assert "gradients non-finite from step 3 (param_grad of l2 first)" in f.evidence
    elif case == "guarded":
        assert "the loss not finite at 2 logged step(s), 0 readings affected" in f.evidence
    else:
        assert "the logged loss not finite from step 3" in f.evidence


def test_probe_change_and_train_mode_are_flagged(runs):
    assert [(f.rule, f.step) for f in findings(metrics(runs / "probe.parquet"))] == [("probe_changed", 200)]
    assert [f.rule for f in findings(metrics(runs / "trainmode.parquet"))] == ["train_mode"]


def test_thresholds_are_options(runs):
    m = metrics(runs / "stable.parquet")
    assert any(f.rule == "dead_high" for f in findings(m))
    assert not any(f.rule == "dead_high" for f in findings(m, Rules(max_dead=0.8)))


def test_a_layer_read_at_two_depths_aligns_once_per_reading():
    """A trace may give one layer two depths (a module called twice): each of its readings keeps
    one aligned key, the table its rows (no reading doubled by the join, none dropped)."""
    m = pl.DataFrame({"run": ["a", "a", "b"], "layer": ["l", "l", "l"], "layer_index": [0, 1, 0],
                      "kind": ["relu"] * 3, "stream": ["activation"] * 3, "step": [0, 1, 0]})
    out = align(m)
    assert out.select(m.columns).equals(m) and out["aligned"].to_list() == ["l", "l", "l"]


def test_an_infinite_unit_rms_is_never_dormant_and_leaves_the_others_as_the_sort_read_them():
    """Dormancy's reference from a partition (no NaN) reads an infinite RMS as the largest float,
    as the sort did: the infinite unit is not dormant, the three finite ones are (below τ of it)."""
    from actrace.analyzer.metrics import _dormant

    table = pa.table({"unit_sumsq": pa.array([[4.0, 1.0, math.inf, 1e-4]]), "unit_count": pa.array([[1, 1, 1, 1]])})
    dormant = _dormant(table, Thresholds(), np.zeros(4, bool), np.array([0]), np.array([False]))
    assert dormant.tolist() == [3.0]


def test_runs_with_other_layer_names_align_by_order_among_kinds(tmp_path):
    write_run(tmp_path / "a.parquet", "a", depth=3)
    write_run(tmp_path / "b.parquet", "b", depth=3, dead=lambda s: 16,
              layer_names=["l0", "l1", "l2", "out"])
    m = metrics(tmp_path)
    a = align(m)
    assert sorted(a.filter(pl.col("run") == "b")["aligned"].unique()) == ["relu[0]", "relu[1]", "relu[2]", "tanh[0]"]
    d = diff(a, ["a"], ["b"])  # half of b's third ReLU dead from the start: a difference, never a parting
    assert d.partings == [] and [(p.aligned, p.layer, p.metric, p.value) for p in d.from_start] == [
        ("relu[2]", "l2", "dead_fraction", 0.5)]


def test_progress_axis_lines_up_runs_of_different_lengths(tmp_path):
    write_run(tmp_path / "short.parquet", "short", steps=range(0, 300, 100))
    write_run(tmp_path / "long.parquet", "long", steps=range(0, 3000, 1000))
    a = align(metrics(tmp_path), x="progress")
    assert sorted(a["x"].unique().to_list()) == [0.0, 0.5, 1.0]


def test_a_sweep_read_a_batch_of_runs_at_a_time_says_what_its_whole_table_says(tmp_path):
    """Findings, the layer table and the comparison are computed a batch of runs at a time (the
    metric table held compressed per run): over more runs than a batch, every answer equals the one
    of the whole table, the layers keyed across every run (one run's other names align every run by
    order), and the planted partings are found at their step in each batch."""
    from actrace.analyzer import analyze
    from actrace.analyzer.summary import layer_table
    from actrace.analyzer.tables import AT_ONCE

    dying, names = {"r05", "r33", "r70"}, ["l0", "l1", "l2", "l3", "l4", "l5", "out"]
    for r in range(AT_ONCE * 2 + 8):
        run = f"r{r:02d}"
        write_run(tmp_path / f"{run}.parquet", run, dead=lambda s, d=run in dying: 24 if d and s >= 300 else 0,
                  nan_at=300 if run == "r40" else None, layer_names=names if run == "r71" else None)
    a = analyze(tmp_path)
    assert len(a.tables.runs) > 2 * AT_ONCE
    assert a.findings == findings(a.metrics, a.rules, a.runs, a.th, a.scalars, a.signals)
    assert {(f.run, f.rule, f.layer, f.step) for f in a.findings if f.rule in ("dead_high", "nan_inf")} == {
        *((run, "dead_high", "block2.relu", 300) for run in dying), ("r40", "nan_inf", "block3.relu", 300)}
    assert layer_table(a.latest) == layer_table(a.metrics)
    others = [r for r in a.tables.runs if r != "r00"]
    assert a.parted(a.baseline("r00")) == diff(align(a.metrics), ["r00"], others)
    first = {run: (p.aligned, p.metric, p.step) for run, p in a.parted(a.baseline("r00")).first.items()
             if run != "r40"}
    assert first == {run: ("relu[2]", "dead_fraction", 300) for run in dying}


def test_comparing_in_batches_keeps_a_run_on_both_sides_and_every_engine_refuses_a_run_the_metadata_does_not_name(
        tmp_path):
    """A resumed seed given among the baselines and as the run compared parts where it died, as it
    did before batches; no baseline left is said, not a crash. Rows of a run no metadata names (a
    trace breaking the spec) are refused by DuckDB as by Polars, naming the file (issue 60: it computed
    them before)."""
    from actrace.format.metadata import TraceError

    from actrace.analyzer import analyze

    write_run(tmp_path / "s1.parquet", "s1", dead=lambda s: 24 if s >= 300 else 0)
    write_run(tmp_path / "s2.parquet", "s2")
    write_run(tmp_path / "s3.parquet", "s3")
    write_run(tmp_path / "x.parquet", "s1", steps=range(600, 900, 100), dead=lambda s: 24)
    a = analyze(tmp_path)
    first = a.compared(["s1", "s2", "s3"], ["s1"]).first["s1"]
    assert (first.step, first.metric, first.layer) == (300, "dead_fraction", "block2.relu")
    with pytest.raises(ValueError, match="no baseline left"):
        a.compared([], ["s1"])
    write_run(tmp_path / "b.parquet", "b", nan_at=300)
    t = pq.read_table(tmp_path / "b.parquet")
    pq.write_table(t.set_column(t.column_names.index("run"), t.schema.field("run"),
                                pa.array(["renamed"] * len(t), t.schema.field("run").type)), tmp_path / "b.parquet")
    for engine in ("polars", "duckdb"):
        with pytest.raises(TraceError, match=r"b\.parquet: row 0 column 'run': .* name a run other than"):
            analyze(tmp_path / "b.parquet", engine=engine)


def test_traces_of_a_newer_minor_version_are_analyzed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_run(tmp_path / "a.parquet", "a", depth=2)
    t = pq.read_table(tmp_path / "a.parquet")
    meta = dict(t.schema.metadata) | {b"actrace:spec_version": b"1.4"}
    t = t.append_column("new_thing", pa.array([1] * len(t))).replace_schema_metadata(meta)
    pq.write_table(t, tmp_path / "a.parquet")
    assert metrics(tmp_path / "a.parquet").height > 0


def test_a_non_finite_gradient_has_no_norm_and_is_not_read_as_vanishing(tmp_path, cli):
    rng = np.random.default_rng(0)
    with actrace.Writer(tmp_path / "g.parquet", run="g") as w:
        for step in range(4):
            for i, layer in enumerate(("early", "late")):
                g = rng.normal(size=(16, 16)) * 0.1
                if step >= 2 and layer == "early":
                    g[:] = np.nan  # every value NaN: sumsq over the finite ones would be 0
                w.record_param_grad(step, layer, "weight", g, layer_index=i)
    m = metrics(tmp_path / "g.parquet").filter(pl.col("layer") == "early").sort("step")
    norms = m["grad_norm"].to_list()
    assert all(n > 0.5 for n in norms[:2]) and all(math.isnan(n) for n in norms[2:])
    rules = {f.rule for f in findings(metrics(tmp_path / "g.parquet"))}
    assert "nan_inf" in rules and "vanishing_gradients" not in rules
    early = next(line for line in cli("summary", tmp_path / "g.parquet").stdout.splitlines()
                 if line.strip().startswith("early"))
    assert early.split()[-1] == "nan"


def test_runs_that_share_a_name_are_read_apart_by_their_paths(tmp_path, cli):
    """old/baseline.parquet and new/baseline.parquet both name their run 'baseline' (their files'
    name) and hold the same layers and steps: two runs, not one with every reading twice (a run
    split over traces holds each reading once: it stays one, as above). The second's units die
    from step 300, and diff says so between them."""
    from actrace.analyzer import analyze

    old, new = tmp_path / "old" / "baseline.parquet", tmp_path / "new" / "baseline.parquet"
    write_run(old, "baseline")
    write_run(new, "baseline", dead=lambda s: 24 if s >= 300 else 0)
    with pytest.warns(UserWarning, match="each name their run 'baseline', most of their readings of the same layers"):
        a = analyze([old, new])
    assert [m["run_name"] for m in a.runs] == ["old/baseline", "new/baseline"]
    one = metrics(old)
    for run in ("old/baseline", "new/baseline"):
        rows = a.metrics.filter(pl.col("run") == run)
        assert rows.height == one.height and rows.select("layer", "stream", "step").n_unique() == one.height
    assert a.histograms([("new/baseline", "block2.relu")])["step"].to_list() == list(range(0, 600, 100))
    res = cli("diff", old, new)
    assert res.returncode == 1 and res.stdout.startswith("new/baseline parts from old/baseline at step 300 in "
                                                         "block2.relu: dead fraction"), res.stdout
    from actrace.analyzer.metrics import _labels

    assert _labels(["s3://lab/old/baseline.parquet", "s3://lab/new/baseline.parquet.parts"]) == ["old/baseline",
                                                                                                  "new/baseline"]


def test_a_resumed_run_whose_traces_share_a_few_steps_stays_one_run(tmp_path):
    """A run resumed from a checkpoint at step 400 writes its readings from there to a second trace:
    one of its six readings is also in the first. Most are not: one run, not two."""
    import warnings

    from actrace.analyzer import analyze

    write_run(tmp_path / "a.parquet", "r", steps=range(0, 500, 100))
    write_run(tmp_path / "b.parquet", "r", steps=range(400, 1000, 100))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: no run read apart
        a = analyze([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert [m["run_name"] for m in a.runs] == ["r", "r"] and a.metrics["run"].unique().to_list() == ["r"]
    assert a.metrics["step"].unique().sort().to_list() == list(range(0, 1000, 100))
