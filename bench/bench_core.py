"""Core bench: reductions of a 256×4096 float32 activation, and the fused kernel per value.

Prints readings per second, the ratio to one plain `np.max` pass over the same array (the
floor), the bytes on disk per unit per reading after compression, and the fused kernel's time
per value on the tensor shapes of bench_torch.py's models (on every thread, as readings run).
Run: .venv/bin/python bench/bench_core.py
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import actrace
from actrace.reduce import kernel
from actrace.reduce import reduce_array, reduce_arrays

KERNEL_CASES = {  # name: (shape as (before, units, after), relu(x) too)
    "transformer linear1 4096x1024, +relu": ((4096, 1024, 1), True),
    "transformer d_model 4096x256": ((4096, 256, 1), False),
    "conv NCHW 256x64x16x16": ((256, 64, 256), False),
    "conv NCHW 256x512x4x4 (small map)": ((256, 512, 16), False),
    "whole gradient 1x1x8M": ((1, 1, 1 << 23), False),
}


def best_of(fn, repeat: int = 15) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    x = np.maximum(rng.normal(size=(256, 4096)), 0).astype(np.float32)
    floor = best_of(lambda: np.max(x))
    full = best_of(lambda: reduce_array(x, 1, "relu"))
    no_hist = best_of(lambda: reduce_array(x, 1, "relu", histogram=False))
    print(f"activation 256x4096 float32 ({x.nbytes / 2**20:.1f} MiB)")
    print(f"  np.max floor            {floor * 1e3:8.3f} ms")
    print(f"  reduce_array            {full * 1e3:8.3f} ms  {1 / full:8.1f} readings/s  {full / floor:6.1f}x floor")
    print(f"  reduce_array, no hist   {no_hist * 1e3:8.3f} ms  {1 / no_hist:8.1f} readings/s  "
          f"{no_hist / floor:6.1f}x floor")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "size.parquet"
        n = 50
        with actrace.Writer(path) as w:
            for step in range(n):
                h = np.maximum(rng.normal(size=(256, 4096)) + rng.normal(size=4096), 0).astype(np.float32)
                w.record_activation(step, "fc", h, kind="relu")
        size = path.stat().st_size
    print(f"  on disk: {size / n / 1024:.1f} KiB per reading, {size / n / 4096:.1f} bytes per unit per reading "
          f"(zstd, {n} readings of 4096 units)")
    tiny = reduce_arrays([(rng.normal(size=(8, 16)).astype(np.float32), 1, "relu", dict(layer=f"l{i}"))
                          for i in range(1000)])
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with actrace.Writer(Path(d) / "tiny.parquet", flush_every=10 ** 6) as w:
            for step in range(20):
                w.record_many(step, tiny, layer_indexes=list(range(1000)))
        spent = time.perf_counter() - t0
    print(f"writer, tiny readings (16 units): {20000 / spent:,.0f} readings/s buffered and written "
          f"(goal >= 20,000/s)")

    if not kernel.available:
        print("fused kernel: not built here")
        return
    print("fused kernel, ns per value (all threads; in cache where it fits)")
    for name, (shape, relu) in KERNEL_CASES.items():
        x3 = rng.normal(size=shape).astype(np.float32)
        row = [best_of(lambda: kernel.reduce_many([(x3, 0.0, hist, relu)])) / x3.size * 1e9 for hist in (True, False)]
        print(f"  {name:<38} {row[0]:6.3f} with histogram, {row[1]:6.3f} without")
    small = [(rng.normal(size=(2, 64)).astype(np.float32), 1, "linear", dict(layer=f"l{i}")) for i in range(13)]
    per_tensor = statistics.median(best_of(lambda: reduce_arrays(small), 50) for _ in range(5)) / len(small)
    print(f"Python around each tensor of a batch (reduce_arrays of 13 tensors of 2x64: a deep model's layer, "
          f"the kernel's own work negligible): {per_tensor * 1e6:.1f} us a tensor")
    print("one tensor on two Python threads (no OpenMP team in this process) against one, us "
          f"(kernel.POOL_SPLIT = {kernel.POOL_SPLIT:,} values: below it, one)")
    for n in (1 << 16, 1 << 18, 1 << 20, 1 << 22):
        x3 = rng.normal(size=(1, 1, n)).astype(np.float32)
        cells = []
        for hist in (True, False):
            for pool_split in (0, 1 << 62):  # always both threads, never
                kernel.POOL_SPLIT, was = pool_split, kernel.POOL_SPLIT
                cells.append(best_of(lambda: kernel.reduce_many([(x3, 0.0, hist, False)])) * 1e6)
                kernel.POOL_SPLIT = was
        print(f"  {n:>9,} values: with histogram {cells[0]:7.0f} against {cells[1]:7.0f}, "
              f"without {cells[2]:7.0f} against {cells[3]:7.0f}")


if __name__ == "__main__":
    main()
