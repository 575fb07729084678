"""Kernels one reading launches on a GPU, counted on the CPU: the torch path that CUDA tensors
take (the fused C kernel switched off), each aten op that is neither a view nor an allocation
counted as one launch (a TorchDispatchMode), by torch kernels (`torch ops`) and, where Triton is
installed, with a per-unit reading's statistics by the fused Triton kernel (`fused`: one launch
more, run here by Triton's interpreter), a probe's tensors held for one batch read by one launch
per kind of program. On a GPU a probe reading's reductions are many small
kernels, and each launch costs the host some microseconds whatever the tensor's size, so the
count sets a reading's cost where the model's own kernels are small (an H200 measured it:
`bench_torch.py --device cuda`). Every tensor is read as a device's (`on_device`): the histogram
by `bucketize_histogram`, the statistics moved by one transfer (one per forward, of every reading
at once: here of one). A per-step gradient reading (`layer_readings`) of a layer's weight and bias:
by torch kernels, or one fused kernel for every gradient of a dtype. Last, the host's time around
each tensor of a probe batch on the fused path, its launches left out (what a GPU's host spends
per read tensor whatever the kernels take: an H200 measured it as the rest of a reading's cost).
Run: .venv/bin/python bench/bench_device_ops.py
"""
from __future__ import annotations

import collections
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import: its kernels on CPU tensors
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actrace.reduce import fused, kernel
from actrace.reduce import torch as reductions

aten = torch.ops.aten
FREE = {aten.empty, aten.empty_strided, aten.detach, aten.lift_fresh, aten.alias}  # no kernel of their own


class Launches(TorchDispatchMode):
    """The aten ops run under it that launch a kernel on a GPU, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket not in FREE:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def counted(real):
    """A fused kernel (`fused._kernel`, `fused._scores`, ...) whose every launch counts as one (`triton`),
    what the interpreter does inside it not."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                _get_current_dispatch_mode().ops["triton"] += 1
                with _disable_current_modes():
                    real()[grid](*args, **kwargs)
            return launch
    return Launcher


KERNELS = {name: getattr(fused, name) for name in ("_kernel", "_batch", "_totals", "_scores")}


CASES = {  # name: (tensor, unit axis, kind, options)
    "linear [256, 1024]": (torch.randn(256, 1024), 1, "linear", {}),
    "relu [256, 1024]": (torch.randn(256, 1024).relu(), 1, "relu", {}),
    "tanh [256, 1024] (bounded)": (torch.randn(256, 1024).tanh(), 1, "tanh", {}),
}
GRADIENTS = [torch.randn(1024, 1024), torch.randn(1024)]  # a layer's weight and bias, read every step


def launches(t: torch.Tensor, axis: int, kind: str, options: dict) -> tuple[collections.Counter, int]:
    """The kernels of one reading of `t` on the torch path, as from a device; one reading."""
    with Launches() as mode:
        reductions.to_readings([reductions.reduce_tensor(t, axis, kind, layer="x", **options)])
    return mode.ops, 1


def batch_launches() -> tuple[collections.Counter, int]:
    """The kernels of a batch of a probe's tensors held for one read (`reduce_tensors`): a Llama
    layer's 8×64 tokens, its q, k, v, o projections and norms (64 units) and MLP (256)."""
    tensors = [torch.randn(512, 64) for _ in range(6)] + [torch.randn(512, 256) for _ in range(3)]
    with Launches() as mode:
        reductions.to_readings(reductions.reduce_tensors([(t, 1, "linear", dict(layer=f"t{i}"))
                                                          for i, t in enumerate(tensors)]))
    return mode.ops, len(tensors)


def gradient_launches() -> tuple[collections.Counter, int]:
    """The kernels of a per-step gradient reading of a weight and a bias (`layer_readings`)."""
    with Launches() as mode:
        reductions.layer_readings(GRADIENTS, [dict(layer="fc", kind="linear", stream="param_grad", param=p)
                                              for p in ("weight", "bias")])
    return mode.ops, len(GRADIENTS)


def attention_launches() -> tuple[collections.Counter, int]:
    """The kernels of an SDPA's per-head readings (causal, 8 sequences, 4 heads of 64 queries):
    its scores' numbers, then the reading of each; and how many readings."""
    from actrace.adapters.torch import derived

    q = torch.randn(8, 4, 64, 32)
    with Launches() as mode:
        found = derived.sdpa_attention((q, q, q), {"is_causal": True})
        calls = []
        for kind, t in found.items():
            t, rows = t if isinstance(t, tuple) else (t, None)
            calls.append((t, 1, kind, dict(layer=kind, **({} if rows is None else {"rows": rows}))))
        reductions.to_readings(reductions.reduce_tensors(calls))  # held for one batch, as a probe reading holds them
    return mode.ops, len(calls)


def host_time(n: int = 320, repeat: int = 15) -> tuple[float, float]:
    """The host's µs a tensor in `reduce_tensors` and `to_readings` of a probe batch on the fused path
    (a deep Llama's reading: 3/4 of its `n` tensors of 64 units, 1/4 of 256, a tanh among each
    four), the kernels' launches left out: medians of `repeat`."""
    class Unlaunched:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None
    fused._batch = lambda: (fused._triton(), Unlaunched())[1]  # `tl` set, no launch
    tensors = [torch.randn(512, 64) for _ in range(n * 3 // 4)] + [torch.randn(512, 256) for _ in range(n // 4)]
    calls = [(t, 1, "tanh" if i % 4 == 1 else "linear", dict(layer=f"t{i}")) for i, t in enumerate(tensors)]
    spent = []
    for _ in range(repeat + 3):
        t0 = time.perf_counter()
        pending = reductions.reduce_tensors(calls)
        t1 = time.perf_counter()
        reductions.to_readings(pending)
        spent.append((t1 - t0, time.perf_counter() - t1))
    reduce, finish = (statistics.median(s) / n * 1e6 for s in zip(*spent[3:]))
    return reduce, finish


def main() -> None:
    kernel.available = False  # the path every tensor the C kernel does not take goes
    reductions.on_device = lambda v: isinstance(v, torch.Tensor)  # and its statistics' transfer, as from a device
    print(f"{'reading':<28} {'torch ops':>9} {'fused':>5}   most frequent (fused)")
    for name, count in [*((name, lambda case=case: launches(*case[:3], dict(case[3]))) for name, case in CASES.items()),
                        ("a probe's batch", batch_launches), ("gradients", gradient_launches),
                        ("SDPA heads", attention_launches)]:
        found = []
        for usable in (lambda x, narrow=False: False,
                       lambda x, narrow=False: fused.installed() and x.dtype in (fused._NARROW if narrow else fused._WIDE)):
            fused.usable = usable
            for kernel_name, real in KERNELS.items():
                setattr(fused, kernel_name, counted(real))
            found.append(count())
        (ops, readings), (fused_ops, _) = found
        top = ", ".join(f"{op} {n}" for op, n in fused_ops.most_common(5))
        label = name if readings == 1 else f"{name} ({readings} readings)"
        print(f"{label:<28} {sum(ops.values()):>9} {sum(fused_ops.values()):>5}   {top}")
    print("(fused batches and gradients: also a copy, no kernel, of their table to the device)")
    if fused.installed():
        reduce, finish = host_time()
        print(f"host time a tensor of a probe batch on the fused path, launches left out: reduce_tensors "
              f"{reduce:.1f} us, to_readings {finish:.1f} us")


if __name__ == "__main__":
    main()
