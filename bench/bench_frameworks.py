"""A probe reading against a plain forward, per framework, CPU: the same MLP (8 × 1024 ReLU, a
256-example probe) in PyTorch (`Monitor.probe_reading`), Flax linen (`Monitor.probe_reading`, the
forward traced once and jitted, against a jitted `apply`) and Keras 3 on the torch and JAX backends
(`TraceCallback.probe_reading`, a functional view of every layer, against `model(x, training=False)`).
Each reference returns its output on the host, as a reading does. For PyTorch and Flax also a
training step (a squared-output loss on the probe, SGD; Flax's jitted) with a gradient reading
(`Monitor.gradient_reading`) against one without. Cases take turns round after
round; a ratio is the median over rounds of the two times in one round (`bench_torch.paired`).
Each framework runs in its own process (Keras's backend is chosen at import).
Run: .venv/bin/python bench/bench_frameworks.py [--repeat N] [--width W] [--frameworks torch flax keras-torch keras-jax]
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import numpy as np

from bench_torch import interleaved, paired

WIDTH, DEPTH, BATCH = 1024, 8, 256


def weights():
    rng = np.random.default_rng(0)
    return [(rng.normal(0, WIDTH ** -0.5, (WIDTH, WIDTH)).astype("float32"), np.zeros(WIDTH, "float32"))
            for _ in range(DEPTH)], rng.normal(size=(BATCH, WIDTH)).astype("float32")


def torch_cases(tmp):
    import torch
    from torch import nn

    from actrace.adapters.torch import Monitor
    torch.set_num_threads(2)
    layers, x = weights()
    model = nn.Sequential(*itertools.chain.from_iterable((nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in layers))
    probe = torch.from_numpy(x)
    mon, steps = Monitor(model, probe, f"{tmp}/torch.parquet"), itertools.count()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def forward():
        with torch.no_grad():
            model(probe).numpy()

    def train(read: bool):
        opt.zero_grad()
        model(probe).pow(2).mean().backward()
        if read:
            mon.gradient_reading(next(steps))
        opt.step()
    return forward, lambda: mon.probe_reading(next(steps)), mon.close, train


def flax_cases(tmp):
    import flax.linen as fnn
    import jax

    from actrace.adapters.flax import Monitor
    layers, x = weights()

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, h):
            for _ in layers:
                h = fnn.relu(fnn.Dense(WIDTH)(h))
            return h

    model = MLP()
    params = {f"Dense_{i}": {"kernel": w, "bias": b} for i, (w, b) in enumerate(layers)}
    apply, mon, steps = jax.jit(model.apply), Monitor(model, x, f"{tmp}/flax.parquet"), itertools.count()
    state = [params]

    @jax.jit
    def sgd(p):
        grads = jax.grad(lambda p: (model.apply({"params": p}, x) ** 2).mean())(p)
        return jax.tree_util.tree_map(lambda w, g: w - 1e-4 * g, p, grads), grads

    def train(read: bool):
        state[0], grads = sgd(state[0])
        jax.block_until_ready(grads)
        if read:
            mon.gradient_reading(next(steps), grads)
    return (lambda: np.asarray(apply({"params": params}, x)), lambda: mon.probe_reading(next(steps), params),
            mon.close, train)


def keras_cases(tmp):
    import keras

    from actrace.adapters.keras import TraceCallback
    layers, x = weights()
    model = keras.Sequential([keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH, activation="relu") for _ in layers])
    for layer, (w, b) in zip(model.layers, layers):
        layer.set_weights([w, b])
    cb, steps = TraceCallback(probe=x, out=f"{tmp}/keras.parquet"), itertools.count()
    cb.set_model(model)
    cb.on_train_begin()
    return (lambda: keras.ops.convert_to_numpy(model(x, training=False)),
            lambda: cb.recorder.probe_reading(next(steps)), cb.recorder.close, None)  # its gradients: inside `fit`


CASES = {"torch": torch_cases, "flax": flax_cases, "keras-torch": keras_cases, "keras-jax": keras_cases}


def measure(framework: str, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        forward, reading, close, train = CASES[framework](tmp)

        def case(fn):
            @contextmanager
            def timed():
                fn()  # warm-up (and, for a reading, the one trace)
                yield fn
            return timed

        cases = {"forward": case(forward), "reading": case(reading)}
        if train is not None:
            cases |= {"step": case(lambda: train(False)), "step+grads": case(lambda: train(True))}
        times = interleaved(cases, repeat, lambda: None, calls=5)
        close()
        grads = f"   training step {np.median(times['step']) * 1e3:7.1f} ms, with a gradient reading " \
            f"{paired(times, 'step+grads', 'step'):.2f}×" if train is not None else ""
        print(f"{framework:<12} forward {np.median(times['forward']) * 1e3:7.1f} ms   "
              f"probe reading {np.median(times['reading']) * 1e3:7.1f} ms   "
              f"{paired(times, 'reading', 'forward'):.2f}×{grads}", flush=True)


def main() -> None:
    global WIDTH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--width", type=int, default=WIDTH, help="of each layer (default %(default)s)")
    ap.add_argument("--frameworks", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--one", choices=list(CASES), help=argparse.SUPPRESS)  # run in this process
    args = ap.parse_args()
    WIDTH = args.width
    if args.one:
        return measure(args.one, args.repeat)
    print(f"probe reading vs plain forward, MLP {DEPTH}×{WIDTH} ReLU, probe {BATCH}, median of {args.repeat} "
          "paired rounds")
    for fw in args.frameworks:
        env = dict(os.environ, KERAS_BACKEND=fw.removeprefix("keras-")) if fw.startswith("keras") else os.environ
        subprocess.run([sys.executable, __file__, "--one", fw, "--repeat", str(args.repeat), "--width", str(WIDTH)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
