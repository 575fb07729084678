"""PyTorch adapter bench, CPU, 2 threads: probe-reading and gradient-reading overhead.

For seven models (MLP 8×1024 ReLU on a 256-example probe; a 4-layer CNN on 32×32×3; a 4-layer
transformer encoder, d=256, on 32×128 tokens; six conv-BatchNorm blocks on a batch of 16 16×16
images; a 2-layer LSTM, 256 wide, on 64 sequences of 50 steps, whose gates actrace recomputes and
the hooks do not see; Hugging Face Llamas of 32 layers × 64 and 8 × 512 on 8×64 tokens), side by
side in one run:
  - a plain `no_grad` eval forward of the probe (the reference, 1.00×);
  - an actrace probe reading (forward + all reductions + histograms + hand-off to the writer),
    the same without histograms (`Monitor(histogram=False)`), and without derived readings (per
    head of an attention, per position of an LM head: `exclude=` their names), whose scores a
    fused attention never shows, so they are computed again;
  - forward hooks calling `.mean().item()`, `.std().item()`, `.min().item()`, `.max().item()` and
    the zero share per layer (what people hand-roll today);
  - TensorBoard's `add_histogram` per layer;
  - `+grads`: a training step with an actrace gradient reading vs one without, taking turns step
    by step under one monitor (the median of each pair's ratio): the reading's cost where it runs,
    after a backward that left the interpreter's and the kernel's data cold in cache (a run of
    readings alone costs a fifth as much: bench/bench_grad_step.py splits it);
  - `grad ms`: one gradient reading alone, over a run of them, with its share of the writer's
    flushes and of Python's full collections (which the 0.2 s rounds may all miss);
  - on CUDA also: the probe reading with its reductions on a side stream (`side stream`, not the
    model's own), by torch kernels instead of the fused Triton kernel (`torch ops`), by the fused
    kernel launched per tensor instead of in batches (`per tensor`), and the host syncs one probe
    reading makes (`syncs`, counted by CUDA's sync debug mode; where they happen is printed below
    the row when there is more than one).
The cases take turns, round after round, each timed over enough calls for about 0.2 s; a ratio is
the median over rounds of the two cases' times in the same round (`paired`). Models run in the
order `--models` names them.
Run: .venv/bin/python bench/bench_torch.py [--device cuda] [--repeat N] [--models mlp cnn transformer cnn-bn lstm llama-deep llama-wide]
"""
from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from actrace.adapters.torch import Monitor, module_kind as layer_kind
from actrace.reduce import fused, torch as reductions
from actrace.format.schema import DERIVED_KINDS

NOT_DERIVED = [p for kind in DERIVED_KINDS for p in (kind, f"*.{kind}")]  # exclude= every derived reading


def mlp():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(256, 1024), lambda out: out.pow(2).mean()


def cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    return model, torch.randn(256, 3, 32, 32), lambda out: out.pow(2).mean()


def transformer():
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, batch_first=True, dropout=0.1)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), torch.randn(32, 128, 256), \
        lambda out: out.pow(2).mean()


def cnn_bn():
    """Six conv → BatchNorm → ReLU blocks on 16×16 images, batch 16: many small parameter tensors,
    where per-parameter work shows in a training step."""
    blocks, width = [], 3
    for out in (16, 16, 32, 32, 64, 64):
        blocks += [nn.Conv2d(width, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU()]
        width = out
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)), \
        torch.randn(16, 3, 16, 16), lambda out: out.pow(2).mean()


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(128, 256, num_layers=2, batch_first=True), nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def lstm():
    return Recurrent(), torch.randn(64, 50, 128), lambda out: out.pow(2).mean()


def llama(layers: int, width: int):
    """Hugging Face's Llama (SDPA attention, heads of 32) on 8 sequences of 64 tokens: 32 layers of
    64 is the regime where per-op overhead dominates (as a GPU puts a large model in), 8 of 512
    the compute-bound one."""
    import transformers

    heads = max(1, width // 32)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=4 * width,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                   attn_implementation="sdpa")
    return transformers.LlamaModel(cfg), torch.randint(0, 256, (8, 64)), \
        lambda out: out.last_hidden_state.pow(2).mean()


MODELS = {"mlp 8x1024": mlp, "cnn 4-layer": cnn, "transformer 4x256": transformer, "cnn-bn 6-block": cnn_bn,
          "lstm 2x256": lstm, "llama-deep 32x64": lambda: llama(32, 64), "llama-wide 8x512": lambda: llama(8, 512)}


def interleaved(cases: dict, repeat: int, sync, calls: int | None = 1, seconds: float = 0.2) -> dict[str, list[float]]:
    """Per case, its time per call in each round (the mean of `calls` calls, or with None of
    enough for about `seconds`, as its first call took), the cases taking turns round after round:
    this VM's speed drifts by 10-20 % over a minute, and a ratio taken within a round (`paired`)
    sees the same drift on both sides. A case is a context manager factory that sets up (and warms
    up) outside the timer and yields the function to time."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    counts: dict[str, int] = {name: calls for name in cases if calls}
    for _ in range(repeat):
        for name, case in cases.items():
            with case() as fn:
                if name not in counts:
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    counts[name] = max(1, round(seconds / max(time.perf_counter() - t0, 1e-6)))
                sync()
                t0 = time.perf_counter()
                for _ in range(counts[name]):
                    fn()
                sync()
                times[name].append((time.perf_counter() - t0) / counts[name])
    return times


def paired(times: dict[str, list[float]], case: str, reference: str) -> float:
    """The median over rounds of case / reference, each round's pair timed side by side."""
    return statistics.median(a / b for a, b in zip(times[case], times[reference]))


@contextmanager
def hooked(fn, attach):
    """`fn` timed with hooks attached (and removed afterwards)."""
    handles = attach()
    try:
        yield fn
    finally:
        for h in handles:
            h.remove()


def hooks_per_statistic(model):
    sink = []

    def hook(module, inputs, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            sink.extend([output.mean().item(), output.std().item(), output.min().item(), output.max().item(),
                         (output == 0).float().mean().item()])
    return [m.register_forward_hook(hook) for n, m in model.named_modules() if n and layer_kind(m)]


def tensorboard_hooks(model, writer):
    def make(name):
        def hook(module, inputs, output):
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                writer.add_histogram(name, output, 0)
        return hook
    return [m.register_forward_hook(make(n)) for n, m in model.named_modules() if n and layer_kind(m)]


def host_syncs(read) -> list[str]:
    """Where each host sync of one call of `read` happened (CUDA's sync debug mode warns at each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            read()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def gradient_cost(model, probe, path: str, steps, seconds: float = 1.5) -> float:
    """ms one per-step gradient reading costs in a run of them (at the gradients the model holds), with
    its share of the writer's flushes (at its default, 4096 rows) and of Python's full collections,
    which the rounds of `interleaved` (0.2 s each) may all miss."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no gradient arrives between these readings: said, not news
        with Monitor(model, probe, path, overwrite=True, probe_every=10**9, param_every=10**9) as mon:
            mon.gradient_reading(next(steps))
            n, start = 0, time.perf_counter()
            while n < 20 or time.perf_counter() - start < seconds:
                mon.gradient_reading(next(steps))
                n += 1
            return (time.perf_counter() - start) / n * 1e3


def training_step(model, probe, loss_fn, opt):
    """A training step of `model` on `probe` that calls its argument, if any, between the backward
    and the optimizer's step (where `mon.step` runs), the model left in evaluation mode."""
    def step(between=None):
        model.train()
        loss = loss_fn(model(probe))
        opt.zero_grad()
        loss.backward()
        if between is not None:
            between()
        opt.step()
        model.eval()
    return step


def gradient_overhead(model, probe, path: str, train_step, sync, seconds: float = 3.0) -> float:
    """A training step with a gradient reading over one without: the two take turns, which goes first
    alternating, under one monitor (its hooks on both), for `seconds`; the median of the pairs' ratios."""
    with Monitor(model, probe, path, overwrite=True, probe_every=10**9, param_every=10**9) as mon:
        ratios, start = [], time.perf_counter()
        while len(ratios) < 50 or time.perf_counter() - start < seconds:
            times = {}
            for read in ((False, True) if len(ratios) % 2 else (True, False)):
                sync()
                t0 = time.perf_counter()
                train_step(mon if read else None)
                sync()
                times[read] = time.perf_counter() - t0
            ratios.append(times[True] / times[False])
        return statistics.median(ratios)


@contextmanager
def setting(owner, name: str, value):
    """`owner.name` set to `value` for the block: the reductions on a side stream (`SIDE_STREAM`),
    by torch kernels (the fused kernel's `usable` saying no), or per tensor (no `_fused_batches`)."""
    was = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, was)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=[m.split()[0] for m in MODELS], help="default: all")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    print(f"device {dev}, {torch.get_num_threads()} threads, torch {torch.__version__}, paired medians of {args.repeat} rounds")
    cuda = dev.type == "cuda"
    header = f"{'model':<18} {'forward ms':>10} {'actrace':>8} {'no hist':>8} {'no derived':>10} {'per-stat':>9} " \
             f"{'tensorboard':>11} {'train ms':>9} {'+grads':>7} {'grad ms':>7}" + \
        (f" {'side stream':>11} {'torch ops':>9} {'per tensor':>10} {'syncs':>5}" if cuda else "")
    print(header)
    from torch.utils.tensorboard import SummaryWriter

    for name in [n for m in args.models for n in MODELS if n.split()[0] == m] if args.models else MODELS:
        model, probe, loss_fn = MODELS[name]()
        model, probe = model.to(dev), probe.to(dev)
        model.eval()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def forward():
            with torch.no_grad():
                model(probe)

        steps = itertools.count()  # a trace holds one reading per step: each reading takes the next

        step = training_step(model, probe, loss_fn, opt)

        def train_step(mon=None):
            step(None if mon is None else lambda: mon.gradient_reading(next(steps)))

        with tempfile.TemporaryDirectory() as d:
            @contextmanager
            def monitored(**kw):
                with Monitor(model, probe, f"{d}/t.parquet", overwrite=True, flush_every=10_000_000,
                             grad_every=None, **kw) as mon:
                    mon.probe_reading(next(steps))  # the first reading warms the threads
                    yield lambda: mon.probe_reading(next(steps))

            @contextmanager
            def monitored_with(owner, name, value):
                with setting(owner, name, value), monitored() as read:
                    yield read

            tb = SummaryWriter(d)
            t = interleaved({
                "forward": lambda: nullcontext(forward),
                "actrace": monitored,
                "no hist": lambda: monitored(histogram=False),
                "no derived": lambda: monitored(exclude=NOT_DERIVED),
                "per-stat": lambda: hooked(forward, lambda: hooks_per_statistic(model)),
                "train": lambda: nullcontext(train_step),
                **({"side stream": lambda: monitored_with(reductions, "SIDE_STREAM", True),
                    "torch ops": lambda: monitored_with(fused, "usable", lambda x, narrow=False: False),
                    "per tensor": lambda: monitored_with(reductions, "_fused_batches", lambda *_: set())}
                   if cuda else {}),
            }, args.repeat, sync, calls=None)
            grad_ms = gradient_cost(model, probe, f"{d}/c.parquet", steps)
            grads = gradient_overhead(model, probe, f"{d}/g.parquet", train_step, sync)
            if cuda:
                with monitored() as read:
                    syncs = host_syncs(read)
            slow = interleaved({"forward": lambda: nullcontext(forward),
                                "tensorboard": lambda: hooked(forward, lambda: tensorboard_hooks(model, tb))},
                               max(2, args.repeat // 3), sync, calls=None)
            tb.close()
        print(f"{name:<18} {statistics.median(t['forward']) * 1e3:>10.1f} {paired(t, 'actrace', 'forward'):>7.2f}x "
              f"{paired(t, 'no hist', 'forward'):>7.2f}x {paired(t, 'no derived', 'forward'):>9.2f}x "
              f"{paired(t, 'per-stat', 'forward'):>8.2f}x "
              f"{paired(slow, 'tensorboard', 'forward'):>10.2f}x {statistics.median(t['train']) * 1e3:>9.1f} "
              f"{grads:>6.2f}x {grad_ms:>7.2f}" +
              (f" {paired(t, 'side stream', 'forward'):>10.2f}x {paired(t, 'torch ops', 'forward'):>8.2f}x "
               f"{paired(t, 'per tensor', 'forward'):>9.2f}x {len(syncs):>5}"
               if cuda else ""))
        if cuda and len(syncs) > 1:
            where = collections.Counter(syncs).most_common(6)
            print("    syncs at " + ", ".join(f"{place} ×{n}" for place, n in where))


if __name__ == "__main__":
    main()
