"""Where a PyTorch probe reading's time goes, CPU, 2 threads: the bench models of `bench_torch.py`,
each case timed in turn round after round, as a paired median ratio to a plain `no_grad` forward.
  - trace:         the forward under actrace's trace (TorchFunctionMode, module hooks, unit axes),
                   every read tensor handed to a sink that drops it;
  - trace+kernel:  the same, the sink running the fused C kernel on each tensor as a reading does
                   (histogram, per-unit sums, a following ReLU from the same pass), nothing else;
  - trace+copy:    the same, the sink copying each of those tensors once instead: the cheapest
                   pass over them inside the forward, what touching fresh outputs costs there;
  - trace, batch:  the same kernel passes as one batch after the forward (the tensors held until
                   then); a reading holds them in batches of `forward.HOLD` bytes where its trial
                   found that nothing changes them in place;
  - kernel alone:  those kernel calls on the same tensors kept from one forward, with no forward;
  - kernel, batch: the same kernel calls batched as a reading batches them: tensors held until
                   `forward.HOLD` bytes have gathered, one whose pass gives a ReLU's reading too
                   read at once with those held before it: the reductions' own cost;
  - reading:       `Monitor.probe_reading` (the above, plus Python bookkeeping: pending readings,
                   layer-level totals, the writer's buffer), and the same without histograms.
(trace+kernel − trace) − kernel alone is what the reductions cost inside the forward beyond their
own time (trace+copy − trace: what any pass over those tensors costs there); trace+kernel is a
reading's floor, reading − (trace+kernel) the Python around them.
Run: .venv/bin/python bench/bench_probe_parts.py [--repeat N] [--models mlp cnn transformer]
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import tempfile
from contextlib import contextmanager

import numpy as np
import torch

from actrace.reduce import kernel
from actrace.adapters.torch import Monitor
from actrace.adapters.torch.forward import HOLD
from bench_torch import MODELS, interleaved, paired


def kernel_call(out):
    """The kernel pass a reading makes of one traced output (None for a ReLU read from its input's)."""
    if out.relu_of is not None or out.tensor.dtype != torch.float32:
        return None
    x = out.tensor.detach().contiguous()
    axis = out.axis
    view = x.view(math.prod(x.shape[:axis]), x.shape[axis], -1) if axis is not None else x.view(1, 1, -1)
    return view.numpy(), out.feeds_relu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    cols = ["trace", "trace+kernel", "trace+copy", "trace, batch", "kernel alone", "kernel, batch", "reading",
            "no hist"]
    print(f"paired medians of {args.repeat} rounds, ratio to a plain forward\n{'model':<14} {'forward ms':>10} "
          + " ".join(f"{c:>13}" for c in cols))
    for name, build in MODELS.items():
        if name.split()[0] not in args.models:
            continue
        torch.manual_seed(0)
        model, probe, _ = build()
        model.eval()
        with tempfile.TemporaryDirectory() as d:
            mon = Monitor(model, probe, f"{d}/a.parquet", flush_every=10_000_000, grad_every=None)
            quiet = Monitor(model, probe, f"{d}/b.parquet", flush_every=10_000_000, histogram=False, grad_every=None)
            steps, kept = itertools.count(), []

            def traced(sink):
                def run():
                    mon.forward.trace.sink, own = sink, mon.forward.trace.sink
                    try:
                        with torch.no_grad(), mon.forward.trace:
                            model(probe)
                    finally:
                        mon.forward.trace.sink = own
                return run

            def drop(out):
                out.tensor = None

            def reduce(out):
                call = kernel_call(out)
                if call is not None:
                    kernel.reduce_f32(call[0], 0.0, True, call[1])

            def copy(out):
                call = kernel_call(out)
                if call is not None:
                    np.copyto(np.empty_like(call[0]), call[0])

            def keep(out):
                call = kernel_call(out)
                if call is not None:
                    kept.append(call)

            traced(keep)()
            batch = []

            def queue(out):
                call = kernel_call(out)
                if call is not None:
                    batch.append(call)

            def batched():
                batch.clear()
                traced(queue)()
                kernel.reduce_many([(x3, 0.0, True, relu) for x3, relu in batch])

            def alone():
                for x3, relu in kept:
                    kernel.reduce_f32(x3, 0.0, True, relu)

            def kernel_batches():
                batch, size = [], 0
                for x3, relu in kept:
                    batch.append((x3, 0.0, True, relu))
                    size += HOLD if relu else x3.nbytes  # a ReLU's source is never held (`forward.batchable`)
                    if size >= HOLD:
                        kernel.reduce_many(batch)
                        batch, size = [], 0
                kernel.reduce_many(batch)

            def forward():
                with torch.no_grad():
                    model(probe)

            def case(fn):
                @contextmanager
                def warm():
                    fn()
                    yield fn
                return warm

            times = interleaved({"forward": case(forward), "trace": case(traced(drop)),
                                 "trace+kernel": case(traced(reduce)), "trace+copy": case(traced(copy)),
                                 "kernel alone": case(alone), "kernel, batch": case(kernel_batches),
                                 "trace, batch": case(batched),
                                 "reading": case(lambda: mon.probe_reading(next(steps))),
                                 "no hist": case(lambda: quiet.probe_reading(next(steps)))}, args.repeat, lambda: None)
            mon.close()
            quiet.close()
        print(f"{name:<14} {statistics.median(times['forward']) * 1e3:>10.1f} "
              + " ".join(f"{paired(times, c, 'forward'):>12.3f}x" for c in cols), flush=True)


if __name__ == "__main__":
    main()
