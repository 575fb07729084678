"""ONNX adapter bench: a probe reading through ONNX Runtime against a plain ORT run of the
unmodified model on the same probe (ORT_ENABLE_ALL, CPU), two ways:
  - steady state: the prepared session's run + all reductions, vs the plain session's run;
  - per checkpoint: load + graph copy + session + run + reductions, vs session + run.

Models: the torch bench's MLP 8×1024 (256-example probe) and 4-layer CNN (256 × 3×32×32),
exported with torch.onnx.export. Run: .venv/bin/python bench/bench_onnx.py
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_torch import cnn, mlp  # noqa: E402

from actrace.adapters.onnx import Checkpoint  # noqa: E402


def median_time(fn, repeat: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    print(f"onnxruntime {ort.__version__}, CPU, median of 7")
    print(f"{'model':<14} {'tensors':>8} {'plain run ms':>12} {'reading':>8} {'plain ckpt ms':>14} {'reading':>8}")
    with tempfile.TemporaryDirectory() as d:
        for name, build in (("mlp 8x1024", mlp), ("cnn 4-layer", cnn)):
            model, probe, _ = build()
            path = Path(d) / f"{name.split()[0]}.onnx"
            torch.onnx.export(model.eval(), (probe[:2],), path, input_names=["x"], dynamo=False,
                              dynamic_axes={"x": {0: "batch"}})
            x = probe.numpy()

            def plain_session():
                return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

            session, checkpoint = plain_session(), Checkpoint(path)
            plain = median_time(lambda: session.run(None, {"x": x}))
            ours = median_time(lambda: checkpoint.read({"x": x}, chunk=len(x)))
            plain_ckpt = median_time(lambda: plain_session().run(None, {"x": x}))
            ours_ckpt = median_time(lambda: Checkpoint(path).read({"x": x}, chunk=len(x)))
            print(f"{name:<14} {len(checkpoint.tensors):>8} {plain * 1e3:>12.1f} {ours / plain:>7.2f}x "
                  f"{plain_ckpt * 1e3:>14.1f} {ours_ckpt / plain_ckpt:>7.2f}x")


if __name__ == "__main__":
    main()
