"""The gradient reading's cost per step under FSDP2 (`fully_shard`), against the same step without
a monitor: two CPU ranks (gloo) under torchrun, paired medians of interleaved rounds.

    .venv/bin/python bench/bench_sharded.py [--steps 30] [--width 1024] [--depth 8]

Goal (issue 29): ≤ 1.03× a plain step with gradient readings every step.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def rank_main(steps: int, width: int, depth: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from actrace.adapters.torch import Monitor

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, 10)

    def step(mon, i):
        ((model(x) - y) ** 2).mean().backward()
        if mon is not None:
            mon.step(i)
        opt.step()
        opt.zero_grad()

    mon = Monitor(model, x[:16], os.path.join(out, "bench.parquet"), probe_every=10 ** 9, param_every=10 ** 9,
                  overwrite=True)
    for i in range(3):  # warm-up, the first probe reading included
        step(None, i)
        step(mon, i)
    plain, read = [], []
    for i in range(steps):
        for mon_or_none, times in ((None, plain), (mon, read)):
            dist.barrier()
            t = time.perf_counter()
            step(mon_or_none, 3 + i)
            times.append(time.perf_counter() - t)
    mon.close()
    if dist.get_rank() == 0:
        p, r = statistics.median(plain), statistics.median(read)
        print(f"FSDP2, 2 ranks, {depth}x{width} MLP: plain step {p * 1e3:.2f} ms, with gradient readings "
              f"{r * 1e3:.2f} ms: {r / p:.3f}x (goal <= 1.03x)")
    dist.barrier()  # every rank's last collective done before the group goes
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        return rank_main(a.steps, a.width, a.depth, a.out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                        "127.0.0.1", "--master_port", port, __file__, "--rank", "--out", out, "--steps", str(a.steps),
                        "--width", str(a.width), "--depth", str(a.depth)], check=True)


if __name__ == "__main__":
    main()
