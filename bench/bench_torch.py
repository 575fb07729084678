"""PyTorch adapter bench, CPU, 2 threads: probe-reading and gradient-reading overhead.

For three models (MLP 8×1024 ReLU on a 256-example probe; a 4-layer CNN on 32×32×3; a 4-layer
transformer encoder, d=256, on 32×128 tokens), side by side in one run:
  - a plain `no_grad` eval forward of the probe (the reference, 1.00×);
  - an actrace probe reading (forward + all reductions + histograms + hand-off to the writer),
    and the same without histograms (`Monitor(histogram=False)`);
  - forward hooks calling `.mean().item()`, `.std().item()`, `.min().item()`, `.max().item()` and
    the zero share per layer (what people hand-roll today);
  - TensorBoard's `add_histogram` per layer;
  - a training step with actrace gradient readings at every step vs a plain training step.
Run: .venv/bin/python bench/bench_torch.py [--device cuda] [--repeat N] [--models mlp cnn transformer]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch import nn

from actrace.adapters.torch import Monitor, layer_kind


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


MODELS = {"mlp 8x1024": mlp, "cnn 4-layer": cnn, "transformer 4x256": transformer}


def timeit(fn, repeat: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)  # best of: the least disturbed run on a shared machine


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=[m.split()[0] for m in MODELS], help="default: all three")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    print(f"device {dev}, {torch.get_num_threads()} threads, torch {torch.__version__}, best of {args.repeat}")
    header = f"{'model':<18} {'forward ms':>10} {'actrace':>8} {'no hist':>8} {'per-stat':>9} {'tensorboard':>11} " \
             f"{'train ms':>9} {'+grads':>7}"
    print(header)
    from torch.utils.tensorboard import SummaryWriter

    for name, build in MODELS.items():
        if args.models and name.split()[0] not in args.models:
            continue
        model, probe, loss_fn = build()
        model, probe = model.to(dev), probe.to(dev)
        model.eval()

        def forward():
            with torch.no_grad():
                model(probe)

        base = timeit(forward, args.repeat, sync)
        with tempfile.TemporaryDirectory() as d:
            mon = Monitor(model, probe, f"{d}/t.parquet", flush_every=10_000_000)
            ours = timeit(lambda: mon.probe_reading(0), args.repeat, sync)
            mon.close()
            mon = Monitor(model, probe, f"{d}/n.parquet", flush_every=10_000_000, histogram=False)
            no_hist = timeit(lambda: mon.probe_reading(0), args.repeat, sync)
            mon.close()
            handles = hooks_per_statistic(model)
            per_stat = timeit(forward, args.repeat, sync)
            for h in handles:
                h.remove()
            tb = SummaryWriter(d)
            handles = tensorboard_hooks(model, tb)
            tensorboard = timeit(forward, max(2, args.repeat // 2), sync)
            for h in handles:
                h.remove()
            tb.close()

            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            x = probe

            def train_step():
                loss = loss_fn(model(x))
                opt.zero_grad()
                loss.backward()
                opt.step()

            plain = timeit(train_step, args.repeat, sync)
            mon = Monitor(model, probe, f"{d}/g.parquet", probe_every=10**9, grad_every=1, param_every=10**9,
                          flush_every=10_000_000)

            def watched_step():
                loss = loss_fn(model(x))
                opt.zero_grad()
                loss.backward()
                mon.gradient_reading(0)
                opt.step()

            watched = timeit(watched_step, args.repeat, sync)
            mon.close()
        print(f"{name:<18} {base * 1e3:>10.1f} {ours / base:>7.2f}x {no_hist / base:>7.2f}x {per_stat / base:>8.2f}x "
              f"{tensorboard / base:>10.2f}x "
              f"{plain * 1e3:>9.1f} {watched / plain:>6.2f}x")


if __name__ == "__main__":
    main()
