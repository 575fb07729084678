"""`actrace check` as a CI gate: it fails what must fail (a crashed, stopped or unfinished run, a
stream that never got a reading, a critical finding) and passes a healthy run; thresholds add to
that gate, `--allow` accepts a rule; its answer comes as text, JSON and JUnit."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import actrace
from actrace.analyzer.rules import REGISTRY, RULES_VERSION
from actrace.format import metadata
from conftest import HUNG
from traces import write_run

TRAIN = """
import signal, sys, time, torch
from torch import nn
from actrace.adapters.torch import Monitor
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, however the test was started
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mode = sys.argv[2]
with Monitor(model, torch.randn(32, 8), sys.argv[1], probe_every=5, flush_every=int(sys.argv[3])) as mon:
    for step in range(3000):  # ~30 s: a signal that goes missing fails the test rather than hanging it
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if mode != "no-step":
            mon.step(step)
        mon.log(step, loss=loss)
        opt.step()
        if step == 3:
            print("ready", flush=True)
        if mode == "raise" and step == 5:
            raise RuntimeError("planted")
        if mode == "no-step" and step == 20:
            break
        time.sleep(0.01)
"""


def train(tmp_path, mode: str, stop=None, flush_every=4096) -> tuple[subprocess.CompletedProcess, object]:
    """Run the training script; `stop`: the signal sent once it has taken a few steps."""
    (tmp_path / "train.py").write_text(TRAIN)
    out = tmp_path / f"{mode}.parquet"
    proc = subprocess.Popen([sys.executable, "train.py", str(out), mode, str(flush_every)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if stop is not None:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        proc.send_signal(stop)
    stdout, stderr = proc.communicate(timeout=HUNG)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out


# Python ends with SIGINT on an uncaught KeyboardInterrupt; SIGTERM ends in exit status 143 (128 + 15)
@pytest.mark.parametrize("stop,status,code", [(signal.SIGTERM, "terminated", 143), (signal.SIGINT, "interrupted", -2)])
def test_a_stopped_run_closes_its_trace_with_what_stopped_it_and_the_gate_fails_it(tmp_path, cli, stop, status, code):
    res, out = train(tmp_path, "run", stop)
    assert res.returncode == code, res.stderr[-2000:]
    assert metadata.read(out)["status"] == status and not (tmp_path / "run.parquet.parts").exists()
    steps = {r["step"] for r in actrace.read_table(out).to_pylist() if r["stream"] == "param_grad"}
    assert max(steps) >= 3 and steps == set(range(max(steps) + 1))  # nothing lost: every buffered reading is there
    gate = cli("check", out)
    assert gate.returncode == 1 and "critical finding run_stopped" in gate.stdout and status in gate.stdout


def test_a_failed_run_fails_the_gate_and_says_why(tmp_path, cli):
    res, out = train(tmp_path, "raise")
    assert res.returncode == 1 and "planted" in res.stderr
    assert metadata.read(out)["status"] == "failed: RuntimeError"
    gate = cli("check", out)
    assert gate.returncode == 1 and "run_failed" in gate.stdout and "RuntimeError" in gate.stdout


def test_a_run_killed_mid_way_fails_the_gate_as_unfinished(tmp_path, cli):
    res, out = train(tmp_path, "run", signal.SIGKILL, flush_every=1)
    assert res.returncode == -signal.SIGKILL
    parts = tmp_path / "run.parquet.parts"
    assert parts.is_dir() and metadata.read(next(parts.glob("part-*.parquet")))["status"] == "running"
    gate = cli("check", parts)
    assert gate.returncode == 1 and "run_unfinished" in gate.stdout


KILLED = """
import os, signal, sys
import numpy as np
import actrace
w = actrace.Writer(sys.argv[1], flush_seconds=3600)
w.record_activation(0, "fc", np.ones((2, 3), np.float32), kind="relu")
os.kill(os.getpid(), signal.SIGKILL)  # before any flush: its .parts folder holds no part file
"""


def test_a_run_killed_before_its_first_flush_or_closed_empty_fails_the_gate_among_others(tmp_path, cli):
    """Nothing about a run without a reading can pass a gate: a writer killed before it flushed (a
    `.parts` folder with no part file, found in a folder of traces) and a trace closed empty each fail
    it beside a healthy run; neither is the default baseline, and diff says what it could not compare."""
    runs = tmp_path / "runs"
    write_run(runs / "healthy.parquet", "healthy")
    killed = subprocess.run([sys.executable, "-c", KILLED, runs / "killed.parquet"], timeout=HUNG)
    assert killed.returncode == -signal.SIGKILL and not any((runs / "killed.parquet.parts").iterdir())
    actrace.Writer(runs / "empty.parquet").close()
    actrace.Writer(runs / "raised.parquet").close(RuntimeError("before any reading"))  # said as it ended, not empty
    for engine in ("polars", "duckdb"):  # (the SQL engines read the runs' status from the same footers)
        gate = cli("check", runs, "--engine", engine)
        assert gate.returncode == 1 and "killed / -: critical finding run_unfinished" in gate.stdout, gate.stdout
        assert "killed.parquet.parts holds no part file" in gate.stdout
        assert "empty / -: critical finding run_empty" in gate.stdout and "healthy / " not in gate.stdout
        assert "raised / -: critical finding run_failed" in gate.stdout and "raised / -: critical finding run_empty" \
            not in gate.stdout
    for command in (["summary"], ["report", "-o", tmp_path / "r.html"], ["inspect"], ["findings"]):  # the folder
        said = cli(*command, runs)
        assert said.returncode == 0 and "Traceback" not in said.stderr, (command, said.stderr[-2000:])
    assert "run_unfinished" in cli("summary", runs).stdout
    assert actrace.read_table(runs).num_rows == actrace.read_table(runs / "healthy.parquet").num_rows  # nothing there
    summary = cli("summary", runs / "empty.parquet", runs / "healthy.parquet")  # no baseline chosen: none taken
    assert summary.returncode == 0 and "against the baseline" not in summary.stdout, summary.stderr
    summary = cli("summary", runs / "empty.parquet", runs / "healthy.parquet", "--baseline", "healthy")
    assert "against the baseline healthy (chosen by --baseline)" in summary.stdout, summary.stdout
    refused = cli("diff", runs / "empty.parquet", runs / "healthy.parquet")
    assert refused.returncode == 2 and "holds no reading: nothing to compare with" in refused.stderr
    said = cli("diff", runs / "healthy.parquet", runs / "empty.parquet", runs / "killed.parquet.parts")
    assert said.returncode == 1 and said.stdout == ("empty: holds no reading: nothing compared\n"
                                                    "killed: holds no reading: nothing compared\n"), said.stdout
    listed = cli("diff", runs / "healthy.parquet", runs / "empty.parquet", "--format", "json")
    assert listed.returncode == 1 and json.loads(listed.stdout)["unread"] == ["empty"], listed.stdout
    table = cli("diff", runs / "healthy.parquet", runs / "empty.parquet", "--format", "csv")
    assert table.returncode == 1 and "empty: holds no reading: nothing compared" in table.stderr, table.stderr


def test_a_monitor_that_never_read_a_gradient_says_so_and_the_gate_fails_it(tmp_path, cli):
    res, out = train(tmp_path, "no-step")
    assert res.returncode == 0 and "step() was never called" in res.stderr
    assert metadata.read(out)["status"] == "incomplete: no param_grad reading"
    gate = cli("check", out, "--min-grad-norm", "1e-8")
    assert gate.returncode == 1 and "stream_missing" in gate.stdout
    assert "note: --min-grad-norm: nothing to read (no grad_norm) in 1 run(s): no-step: not judged there" in gate.stdout


def test_step_called_after_zero_grad_is_said_at_the_step_and_at_close(tmp_path):
    import torch
    from torch import nn

    from actrace.adapters.torch import Monitor

    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning) as said:
        with Monitor(model, torch.randn(8, 4), tmp_path / "z.parquet") as mon:
            for step in range(3):
                model(torch.randn(2, 4)).sum().backward()
                model.zero_grad()  # set_to_none: step() finds no gradient
                mon.step(step)
    text = " ".join(str(w.message) for w in said)
    assert "no gradient was read" in text and "before optimizer.zero_grad()" in text
    assert metadata.read(tmp_path / "z.parquet")["status"] == "incomplete: no param_grad reading"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gate")
    write_run(d / "healthy.parquet", "healthy")
    write_run(d / "stable.parquet", "stable", dead=lambda s: 24)              # 75 % dead: a warning only
    write_run(d / "nan.parquet", "nan", nan_at=300)                           # critical
    return d


def test_thresholds_add_to_the_default_gate_and_allow_accepts_a_rule(cli, runs):
    assert cli("check", runs / "healthy.parquet").returncode == 0
    assert cli("check", runs / "stable.parquet").returncode == 0  # dead_high is a warning
    assert cli("check", runs / "stable.parquet", "--max-dead", "0.5").returncode == 1
    nan = cli("check", runs / "nan.parquet", "--max-dead", "0.9")  # a threshold does not switch findings off
    assert nan.returncode == 1 and "nan_inf" in nan.stdout
    assert cli("check", runs / "nan.parquet", "--allow", "nan_inf").returncode == 0
    assert cli("check", runs / "stable.parquet", "--fail-on", "warning").returncode == 1
    bad = cli("check", runs / "nan.parquet", "--allow", "nan-inf")
    assert bad.returncode == 2 and "--allow 'nan-inf' is not a rule" in bad.stderr


def test_a_limit_with_nothing_to_read_is_said_once_and_fails_only_under_strict(cli, runs, tmp_path):
    """Saturation is a bounded kind's (tanh, sigmoid): a ReLU net has no saturated share for
    --max-saturation to read, which is said once and passes (two teams' gate over ReLU and tanh nets);
    --strict fails it; a run with a tanh below the limit passes."""
    import numpy as np

    with actrace.Writer(tmp_path / "relu.parquet") as w:
        w.record_activation(0, "fc.relu", np.abs(np.random.default_rng(0).normal(size=(64, 8))).astype(np.float32),
                            kind="relu")
    gate = cli("check", tmp_path / "relu.parquet", "--max-saturation", "0.3")
    assert gate.returncode == 0 and gate.stdout.count("note: --max-saturation: nothing to read (no saturation_value) "
                                                      "in 1 run(s): relu") == 1, gate.stdout
    strict = cli("check", tmp_path / "relu.parquet", "--max-saturation", "0.3", "--strict", "--format", "json")
    answer = json.loads(strict.stdout)
    assert strict.returncode == 1 and answer["runs"] == [{"run": "relu", "verdict": "failed",
                                                          "failed_rules": ["max_saturation"]}], strict.stdout
    assert cli("check", runs / "healthy.parquet", "--max-saturation", "0.3").returncode == 0

def test_the_gate_answers_in_json_and_junit_with_numbers_as_numbers(cli, runs, tmp_path):
    res = cli("check", runs / "healthy.parquet", runs / "stable.parquet", "--max-dead", "0.5", "--format", "json")
    answer = json.loads(res.stdout)
    assert res.returncode == 1 and answer["passed"] is False and answer["rules_version"] == RULES_VERSION
    assert answer["runs"] == [{"run": "healthy", "verdict": "passed", "failed_rules": []},
                              {"run": "stable", "verdict": "failed", "failed_rules": ["dead_high"]}]
    (v,) = [v for v in answer["violations"] if v["layer"] == "block2.relu"]
    assert (v["gate"], v["run"], v["rule"], v["value"], v["threshold"], v["step"]) == (
        "max_dead", "stable", "dead_high", 0.75, 0.5, 0)
    res = cli("check", runs / "healthy.parquet", runs / "nan.parquet", "--max-dead", "0.5", "--format", "junit",
              "-o", tmp_path / "junit.xml")
    suites = ET.parse(tmp_path / "junit.xml").getroot()
    cases = {(s.get("name"), c.get("name")): c.find("failure") is not None for s in suites for c in s}
    assert set(cases) == {(run, rule) for run in ("healthy", "nan") for rule in REGISTRY}
    assert {case for case, failed in cases.items() if failed} == {("nan", "nan_inf")}


def test_findings_json_carries_numbers_and_the_python_api_gives_frames(cli, runs):
    from actrace.analyzer import analyze

    records = json.loads(cli("findings", runs / "stable.parquet", "--format", "json").stdout)
    (dead,) = [r for r in records if r["rule"] == "dead_high" and r["layer"] == "block2.relu"]
    assert (dead["value"], dead["threshold"], dead["first_step"], dead["last_step"], dead["layer_index"]) == \
        (0.75, 0.2, 0, 500, 2)
    a = analyze(runs / "stable.parquet")
    frame = a.findings_frame
    assert frame.filter(frame["rule"] == "dead_high")["value"].to_list() == [0.75]
    assert a.metrics.height and frame.schema["step"].is_integer()


INTERRUPTED = """
import os, random, signal, threading, time
import torch
from torch import nn
from actrace.adapters.torch.trace import ForwardTrace

model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(50)])
def interrupt():  # Ctrl-C at a random moment, then again each second: one that torch's dispatch swallows
    time.sleep(random.uniform(0.05, 0.3))  # (seen once in a loaded suite: the loop ran on) hangs nothing
    while True:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
threading.Thread(target=interrupt, daemon=True).start()
try:
    while True:
        with torch.no_grad(), ForwardTrace(model, lambda o: None, lambda *_: True):
            model(torch.randn(4, 8))
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_inside_a_traced_forward_stays_a_ctrl_c(tmp_path):
    """Ctrl-C lands mostly while torch runs the trace's handler of some op, which leaves the mode
    off torch's stack: the trace's exit must not pop it again (that RuntimeError replaced the
    KeyboardInterrupt in 21 of 25 tries before), so the run ends as interrupted."""
    (tmp_path / "interrupted.py").write_text(INTERRUPTED)
    for _ in range(5):
        done = subprocess.run([sys.executable, tmp_path / "interrupted.py"], capture_output=True, text=True,
                              timeout=HUNG)
        assert done.stdout.strip() == "interrupted", done.stderr[-2000:]


def test_a_nan_gradient_norm_fails_a_minimum_and_a_maximum_alike(tmp_path, cli):
    """NaN is neither above nor below a limit: layer b's gradients NaN at the last step fail
    --min-grad-norm as they fail --max-grad-norm (a NaN compared as below passed it); layer a's pass."""
    path = tmp_path / "t.parquet"
    rng = np.random.default_rng(0)
    with actrace.Writer(path) as w:
        for step in range(3):
            for layer in ("a", "b"):
                g = rng.normal(size=(8, 8)) * (np.nan if layer == "b" and step == 2 else 1.0)
                w.record_param_grad(step, layer, "weight", g, kind="linear")
    for option, limit, bound in (("--min-grad-norm", "1e-6", "≥"), ("--max-grad-norm", "1e6", "≤")):
        gate = cli("check", path, "--fail-on", "never", option, limit)
        rule = "grad_norm_low" if bound == "≥" else "grad_norm_high"  # judged though a NaN explains it: nan_inf
        assert gate.returncode == 1 and gate.stdout.splitlines()[1:] == [  # is not gated here (--fail-on never)
            f"  t: failed ({rule})", f"t / b: warning finding {rule} since step 2 (because of nan_inf@b): gradient "
            f"norm is NaN at step 2, not {bound} {float(limit):g}"], gate.stdout


def test_layers_cut_off_from_the_loss_are_named_and_frozen_or_unfrozen_ones_are_not(tmp_path, cli):
    """Truth by construction: fc1's output is detached before fc2 (a bug: fc1 requires a gradient
    and never gets one); fc3 is frozen on purpose (requires_grad=False); fc2 is frozen until step 5,
    then trained (a linear probe, then fine-tuning). Only fc1's two parameters are named: at close,
    in the trace's `no_gradient` and as a gradient_missing warning that `check --fail-on warning`
    fails and the default gate lets pass."""
    import warnings

    import torch
    from torch import nn

    from actrace.adapters.torch import Monitor

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), \
                nn.Linear(16, 2)

        def forward(self, x):
            return self.head(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)).detach()))))

    torch.manual_seed(0)
    model, out = Net(), tmp_path / "cut.parquet"
    model.fc3.requires_grad_(False)
    model.fc2.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(model, torch.randn(32, 8), out, probe_every=5) as mon:
            for step in range(10):
                model.fc2.requires_grad_(step >= 5)
                loss = model(torch.randn(16, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                mon.step(step)
                mon.log(step, loss=loss)
                opt.step()
    assert json.loads(metadata.read(out)["no_gradient"]) == ["fc1/weight", "fc1/bias"]
    assert [str(w.message) for w in said if "never got one" in str(w.message)] == [
        f"actrace: {out}: 2 parameter(s) required a gradient and never got one (fc1/weight, fc1/bias): cut off from "
        "the loss (a .detach(), torch.no_grad) or unused; the trace says so"]
    gate = cli("check", out, "--fail-on", "warning")
    assert gate.returncode == 1 and gate.stdout.splitlines()[1:] == [
        "  cut: failed (gradient_missing)", "cut / fc1: warning finding gradient_missing: 2 parameter(s) of 1 layer(s) required a gradient and never got "
        "one: fc1/weight, fc1/bias"], gate.stdout
    assert cli("check", out).returncode == 0


def test_a_layer_used_only_between_gradient_readings_is_not_named_cut_off(tmp_path):
    """Two heads used on alternate steps, gradients read every second step (grad_every=2): head b's
    gradients arrive only between readings, yet it learns; it is not named in `no_gradient`, while
    head c, never used, is."""
    import warnings

    import torch
    from torch import nn

    from actrace.adapters.torch import Monitor

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.which = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2), "a"

        def forward(self, x):
            return getattr(self, self.which)(x)

    torch.manual_seed(0)
    model, out = Heads(), tmp_path / "t.parquet"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.b.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Monitor(model, torch.randn(8, 4), out, grad_every=2, probe_every=2) as mon:
            for step in range(6):
                model.which = "a" if step % 2 == 0 else "b"
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                mon.step(step)
                opt.step()
    assert not torch.equal(before, model.b.weight)  # b learned
    assert json.loads(metadata.read(out)["no_gradient"]) == ["c/weight", "c/bias"]
