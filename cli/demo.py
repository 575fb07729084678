"""`actrace demo`: six small PyTorch runs that go wrong in the classic ways (and one that does
not), one of them also exported to ONNX and recorded as another team would, analyzed into one
report. Built-in synthetic data, no downloads, about a minute on two CPU cores.
"""
from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

STEPS, PROBE_EVERY, BATCH, IN_DIM, CLASSES = 400, 20, 128, 32, 10
EXPORT_EVERY = 100


@dataclass(frozen=True)
class DemoRun:
    name: str
    story: str
    activation: str = "relu"
    depth: int = 4
    width: int = 64
    optimizer: str = "adam"
    lr: float = 1e-3
    bias_init: float | None = None
    lr_from: tuple[int, float] | None = None  # (step, factor): the learning rate is multiplied by factor there
    ramp_from: tuple[int, float] | None = None  # (step, rate): from there, multiplied by rate at every step


BASELINE = "healthy-relu"  # what the report compares every other run with
RUNS = [
    DemoRun("healthy-relu", "a ReLU MLP trained sensibly: nothing should be flagged"),
    DemoRun("dying-relu", "the learning rate raised 30x at step 200: ReLU units die, more and more", lr_from=(200, 30.0)),
    DemoRun("saturated-tanh", "tanh layers initialized with a large bias: pinned at ±1", activation="tanh",
            bias_init=3.0),
    DemoRun("vanishing-sigmoid", "a deep sigmoid stack: gradients vanish towards the input", activation="sigmoid",
            depth=12, width=32, optimizer="sgd", lr=0.1),
    DemoRun("nan-loss", "the learning rate grows 10% a step from step 200: gradients explode, the loss goes NaN",
            activation="gelu", optimizer="sgd", lr=0.05, ramp_from=(200, 1.1)),
    DemoRun("lstm-forget-open", "an LSTM reading each example as 4 steps of 8 features, its forget-gate bias "
            "initialized at +6: the gate is pinned open", activation="lstm", width=32, bias_init=6.0),
]
ONNX_RUN = "dying-relu"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _data(torch):
    """A fixed synthetic task: labels from a random two-layer teacher; a held-out probe batch."""
    g = torch.Generator().manual_seed(1234)
    teacher = (torch.randn(IN_DIM, 64, generator=g), torch.randn(64, CLASSES, generator=g))

    def batch(n):
        x = torch.randn(n, IN_DIM, generator=g)
        return x, (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)

    probe = batch(256)[0]
    return batch, probe


def build_model(run: DemoRun, torch):
    nn = torch.nn
    if run.activation == "lstm":
        return _sequence_model(run, torch)
    act = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[run.activation]
    layers, width = OrderedDict(), IN_DIM
    for i in range(1, run.depth + 1):
        layers[f"fc{i}"] = nn.Linear(width, run.width)
        layers[f"{run.activation}{i}"] = act()
        width = run.width
    layers["head"] = nn.Linear(width, CLASSES)
    model = nn.Sequential(layers)
    if run.bias_init is not None:
        with torch.no_grad():
            for name, m in model.named_children():
                if name.startswith("fc"):
                    m.bias.fill_(run.bias_init)
    return model


def _sequence_model(run: DemoRun, torch):
    """An LSTM over each example cut into steps of 8 features, classified from its last hidden
    state; `bias_init` is the forget gate's bias."""
    nn = torch.nn

    class Sequence(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = nn.LSTM(8, run.width, batch_first=True), nn.Linear(run.width, CLASSES)
            if run.bias_init is not None:
                with torch.no_grad():
                    self.lstm.bias_ih_l0[run.width:2 * run.width] = run.bias_init
                    self.lstm.bias_hh_l0[run.width:2 * run.width] = 0.0

        def forward(self, x):
            return self.head(self.lstm(x.view(len(x), -1, 8))[0][:, -1])
    return Sequence()


def train(run: DemoRun, out: Path, export_dir: Path | None, torch) -> None:
    from actrace.adapters.torch import Monitor

    torch.manual_seed(0)
    batch, probe = _data(torch)
    model = build_model(run, torch)
    opt = (torch.optim.Adam if run.optimizer == "adam" else torch.optim.SGD)(model.parameters(), lr=run.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    with Monitor(model, probe, out, run=run.name, probe_every=PROBE_EVERY, param_every=PROBE_EVERY,
                 config={"story": run.story, "activation": run.activation, "depth": run.depth,
                         "optimizer": run.optimizer, "lr": run.lr}, overwrite=True) as monitor:
        for step in range(STEPS + 1):
            factor = (run.lr_from[1] if run.lr_from and step == run.lr_from[0] else 1.0) * \
                (run.ramp_from[1] if run.ramp_from and step >= run.ramp_from[0] else 1.0)
            for group in opt.param_groups:
                group["lr"] *= factor
            x, y = batch(BATCH)
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            monitor.step(step)
            monitor.log(step, loss=loss, lr=opt.param_groups[0]["lr"])
            if export_dir is not None and step % EXPORT_EVERY == 0:  # the weights the probe reading saw
                export_dir.mkdir(parents=True, exist_ok=True)
                model.eval()
                torch.onnx.export(model, (probe[:2],), export_dir / f"step_{step}.onnx", input_names=["x"],
                                  dynamic_axes={"x": {0: "batch"}}, dynamo=False)
                model.train()
            opt.step()


def run_demo(out_dir) -> int:
    """Train, record, export, analyze, report; prints the findings and where the report is. The
    libraries' warnings about the demo's own small models are silenced here, and only here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        return _run_demo(Path(out_dir))


def _run_demo(out_dir: Path) -> int:
    import numpy as np
    import torch

    from actrace.adapters.onnx import record_onnx
    from actrace.analyzer.analysis import analyze
    from actrace.analyzer.report import build_report
    from actrace.analyzer.summary import format_findings
    from actrace.files.output import write

    torch.set_num_threads(min(2, torch.get_num_threads()))
    runs_dir = out_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    traces = []
    for i, run in enumerate(RUNS, 1):
        say(f"[{i}/{len(RUNS) + 2}] PyTorch: training {run.name} ({run.story}), {STEPS} steps")
        export = out_dir / "onnx" / run.name if run.name == ONNX_RUN else None
        train(run, runs_dir / f"{run.name}.parquet", export, torch)
        traces.append(runs_dir / f"{run.name}.parquet")
    _, probe = _data(torch)
    np.save(out_dir / "probe.npy", probe.numpy())
    say(f"[{len(RUNS) + 1}/{len(RUNS) + 2}] ONNX Runtime: recording the exported checkpoints of {ONNX_RUN} "
        f"as another team would: actrace record {out_dir}/onnx/{ONNX_RUN}/step_*.onnx --probe {out_dir}/probe.npy")
    onnx_trace = runs_dir / f"{ONNX_RUN}-onnx.parquet"
    record_onnx(sorted((out_dir / "onnx" / ONNX_RUN).glob("step_*.onnx")), out_dir / "probe.npy", onnx_trace,
                run=f"{ONNX_RUN}-onnx", config={"team": "B", "exported_from": ONNX_RUN}, overwrite=True,
                op_types=["Relu", "Gemm"])
    traces.append(onnx_trace)
    say(f"[{len(RUNS) + 2}/{len(RUNS) + 2}] analyzing {len(traces)} traces")
    analysis = analyze(traces)
    baseline = analysis.baseline(BASELINE)  # the run meant to be healthy, chosen: never the file that sorts first
    report = write(out_dir / "report.html", build_report(analysis, baseline=baseline,
                                                         progress=lambda msg: say(f"  {msg}…")), "report", traces)
    print(format_findings(analysis.findings))
    print(f"\ntraces:  {runs_dir}/  ({len(traces)} runs: {', '.join(p.stem for p in traces)})")
    print(f"report:  {report}  (open it in a browser; it works offline)")
    print(f"again:   actrace summary {runs_dir} --baseline {BASELINE}   |   actrace report {runs_dir}/*.parquet -o "
          f"report.html --baseline {BASELINE}")
    say(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0
