"""Trace bytes per probe reading against TensorBoard's, on bench_torch.py's three models.

Each model trains (SGD) between readings, so readings change as in a real run; actrace records its
default probe reading (every layer the default selects, per-unit columns and histograms) and
TensorBoard `add_histogram` of the same layer outputs. Printed: bytes per reading of each and the
ratio, then the same actrace table rewritten with other Parquet settings (what each buys) and as
a 2.0 proposal would store it (`without_min_dev`). Each model is recorded at each `--readings` count:
a trace of few readings compresses worse per reading (zstd finds less that readings share).
Run: .venv/bin/python bench/bench_size.py [--readings N [N ...]]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_torch import MODELS, tensorboard_hooks  # noqa: E402

from actrace.adapters.torch import Monitor  # noqa: E402
from actrace.files.writer import PARQUET_OPTIONS  # noqa: E402

VARIANTS = {  # name: Parquet options over the writer's (zstd 3, floats byte-stream-split, 8 MiB pages)
    "plain floats": dict(use_byte_stream_split=False),
    "1 MiB pages (before)": dict(data_page_size=1 << 20),
    "zstd 9": dict(compression_level=9),
}


def record(build, readings: int, d: Path) -> tuple[int, int]:
    """(actrace bytes, TensorBoard bytes) of `readings` probe readings with training between."""
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model, probe, loss_fn = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tb = SummaryWriter(d / "tb")
    with Monitor(model, probe, d / "t.parquet", overwrite=True, probe_every=10**9, grad_every=10**9) as mon:
        for step in range(readings):
            mon.probe_reading(step)
            model.eval()
            handles = tensorboard_hooks(model, _Step(tb, step))
            with torch.no_grad():
                model(probe)
            for h in handles:
                h.remove()
            model.train()
            for _ in range(2):
                opt.zero_grad()
                loss_fn(model(probe)).backward()
                opt.step()
    tb.close()
    return (d / "t.parquet").stat().st_size, sum(p.stat().st_size for p in (d / "tb").iterdir())


class _Step:
    """A SummaryWriter whose add_histogram records at this step."""

    def __init__(self, tb, step):
        self.tb, self.step = tb, step

    def add_histogram(self, name, values, _):
        self.tb.add_histogram(name, values, self.step)


def without_min_dev(table: pa.Table) -> pa.Table:
    """The table as a 2.0 proposal would store it: `unit_min_dev` only for bounded kinds (for the
    others it is min |h|, which dead and sparsity never need, and a ReLU's is its `unit_min`)."""
    bounded = pc.is_valid(table["bound_lo"])
    dev = pc.if_else(bounded, table["unit_min_dev"], pa.scalar(None, table.schema.field("unit_min_dev").type))
    return table.set_column(table.schema.get_field_index("unit_min_dev"), "unit_min_dev", dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readings", type=int, nargs="+", default=[10, 40])
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"{'model':<18} {'readings':>8} {'actrace KiB':>11} {'TensorBoard KiB':>15} {'ratio':>6}   per reading; other Parquet settings:")
    for name, build in list(MODELS.items())[:3]:
        for readings in args.readings:
            with tempfile.TemporaryDirectory() as d:
                d = Path(d)
                ours, tb = record(build, readings, d)
                table = pq.read_table(d / "t.parquet")
                sizes = []
                for variant, options in VARIANTS.items():
                    pq.write_table(table, d / "v.parquet", **{**PARQUET_OPTIONS, **options})
                    sizes.append(f"{variant} {(d / 'v.parquet').stat().st_size / readings / 1024:.0f}")
                pq.write_table(without_min_dev(table), d / "v.parquet", **PARQUET_OPTIONS)
                sizes.append(f"2.0 proposal {(d / 'v.parquet').stat().st_size / readings / 1024:.0f}")
            print(f"{name:<18} {readings:>8} {ours / readings / 1024:>11.0f} {tb / readings / 1024:>15.0f} "
                  f"{ours / tb:>5.2f}x   {'; '.join(sizes)}")

if __name__ == "__main__":
    main()
