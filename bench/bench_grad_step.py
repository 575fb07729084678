"""Where a per-step gradient reading's time goes inside training (PyTorch, CPU, 2 threads).

Under one monitor, training steps take turns, step by step: a plain one, one with a gradient
reading (`Monitor.gradient_reading`, as `mon.step` makes it), and one with only the reading's
kernel batch (`kernel.reduce_totals` of the same gradients: the floor of any reading that reduces
them on the host). Printed per model:
  - `plain ms`: a plain training step;
  - `+reading`, `+kernel`: a step with the reading, with the kernel batch alone, over a plain one
    (the median of each turn's ratio; `+reading` is bench_torch's `+grads`);
  - `reading us`, `kernel us`: the reading, and the kernel batch within it, timed where they run,
    right after a backward;
  - `alone us`: the same two in a run of readings with no training between (warm in cache).
After a backward, every first touch of Python's, numpy's and the kernel's code and data costs
several times what it does warm: `reading us` against `alone us`.
Run: .venv/bin/python bench/bench_grad_step.py [--models cnn-bn llama-deep] [--seconds 6]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
import warnings

import torch

from actrace.adapters.torch import Monitor
from actrace.reduce import kernel
from bench_torch import MODELS, training_step


def timer(owner, name: str, into: list):
    """`owner.name` wrapped to append each call's seconds to `into`."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    setattr(owner, name, timed)
    return fn


def measure(make, seconds: float) -> dict[str, float]:
    model, probe, loss_fn = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    steps = itertools.count()
    with tempfile.TemporaryDirectory() as d, \
            Monitor(model, probe, f"{d}/g.parquet", probe_every=10 ** 9, param_every=10 ** 9) as mon:
        params = [p for *_, p in mon.grads.params]
        reduce_totals = kernel.reduce_totals

        def kernel_only():  # untimed: the timer wraps the reading's calls only
            grads = [p.grad for p in params]
            reduce_totals([g.data_ptr() for g in grads], [g.numel() for g in grads])

        train_step = training_step(model, probe, loss_fn, opt)
        kinds = {"plain": None, "reading": lambda: mon.gradient_reading(next(steps)), "kernel": kernel_only}
        for extra in kinds.values():
            train_step(extra)
        reading, batch = [], []
        timer(mon, "gradient_reading", reading)
        timer(kernel, "reduce_totals", batch)
        try:
            times = {k: [] for k in kinds}
            start = time.perf_counter()
            for turn in itertools.count():
                if turn >= 30 and time.perf_counter() - start > seconds:
                    break
                for kind in list(kinds)[turn % 3:] + list(kinds)[: turn % 3]:  # which goes first turns too
                    t0 = time.perf_counter()
                    train_step(kinds[kind])
                    times[kind].append(time.perf_counter() - t0)
            got = {"reading us": statistics.median(reading) * 1e6, "kernel us": statistics.median(batch) * 1e6}
            reading.clear(), batch.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no gradient arrives between these readings: said, not news
                for _ in range(300):
                    mon.gradient_reading(next(steps))
        finally:
            kernel.reduce_totals = reduce_totals
    ratio = {k: statistics.median(a / b for a, b in zip(times[k], times["plain"])) for k in ("reading", "kernel")}
    return {"plain ms": statistics.median(times["plain"]) * 1e3, "+reading": ratio["reading"],
            "+kernel": ratio["kernel"], **got, "alone us": statistics.median(reading) * 1e6,
            "kernel alone us": statistics.median(batch) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cnn-bn", "llama-deep"],
                        choices=[m.split()[0] for m in MODELS])
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    columns = ("plain ms", "+reading", "+kernel", "reading us", "kernel us", "alone us", "kernel alone us")
    print(f"{'model':18s}" + "".join(f"{c:>16s}" for c in columns))
    for name, make in MODELS.items():
        if name.split()[0] in args.models:
            got = measure(make, args.seconds)
            print(f"{name:18s}" + "".join(f"{got[c]:15.3f}x" if c.startswith("+") else f"{got[c]:16.1f}"
                                          for c in columns))


if __name__ == "__main__":
    main()
