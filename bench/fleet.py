"""A fleet of runs for the report's test and the analyzer bench (bench/bench_analyzer.py --fleet): one run recorded with the numpy writer,
then copied as many times as asked, each copy another run (its own name, id and config: width and
learning rate) with its own pathology built into the per-unit extremes: a ReLU layer that dies from
some step on, a tanh layer pinned at its bounds, a NaN. Copying the columns keeps a 200-run fleet
seconds to make."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import actrace


def template(path: Path, layers: int, steps: int, units: int = 16) -> pa.Table:
    """One healthy run: alternating ReLU and tanh layers, their gradients, the loss."""
    rng = np.random.default_rng(0)
    with actrace.Writer(path, run="template", overwrite=True, flush_every=100_000) as w:
        for step in range(0, 10 * steps, 10):
            readings = []
            for i in range(layers):
                kind = "relu" if i % 2 == 0 else "tanh"
                h = rng.normal(size=(32, units)).astype(np.float32)
                h = np.maximum(h, 0) if kind == "relu" else np.tanh(0.5 * h)
                readings.append(actrace.reduce_array(h, -1, kind, layer=f"block{i:02d}.{kind}"))
                readings.append(actrace.reduce_array(rng.normal(size=(units, units)) * 0.05, 0, kind,
                                                     layer=f"block{i:02d}.{kind}", stream="param_grad", param="weight",
                                                     per_unit=False, histogram=False))
            w.record_many(step, readings, layer_indexes=[r // 2 for r in range(len(readings))])
            w.log(step, loss=2.0 - step / (20 * steps))
    return pq.read_table(path)


def _lists(t: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    col = t[name].combine_chunks()
    return col.values.to_numpy(zero_copy_only=False).copy(), col.offsets.to_numpy()


def write_fleet(out: Path, runs: int = 200, layers: int = 32, steps: int = 20) -> list[Path]:
    """`runs` traces under `out`, each a copy of one template with its own run and pathology."""
    out.mkdir(parents=True, exist_ok=True)
    t = template(out / "template.parquet.tmp", layers, steps)
    (out / "template.parquet.tmp").unlink()
    meta = dict(t.schema.metadata)
    step = t["step"].to_numpy()
    act = pc.equal(t["stream"], "activation").to_numpy(zero_copy_only=False)
    relu = act & pc.equal(t["kind"], "relu").to_numpy(zero_copy_only=False)
    tanh = act & pc.equal(t["kind"], "tanh").to_numpy(zero_copy_only=False)
    index = t["layer_index"].to_numpy()
    paths = []
    for r in range(runs):
        lo, offsets = _lists(t, "unit_min")
        hi, _ = _lists(t, "unit_max")
        dev, _ = _lists(t, "unit_min_dev")
        start, layer = 10 * steps * (r % 4) // 5, (r * 7) % layers
        for row in np.nonzero((relu if layer % 2 == 0 else tanh) & (index == layer) & (step >= start))[0]:
            a, b = offsets[row], offsets[row + 1]
            if r % 3 == 0 and layer % 2 == 0:  # dying: more units dead at every later reading
                k = min(b - a, 1 + (step[row] - start) // 20)
                lo[a: a + k] = hi[a: a + k] = dev[a: a + k] = 0
            elif r % 3 == 1 and layer % 2 == 1:  # pinned: half the units at +1 for every input
                k = (b - a) // 2
                lo[a: a + k], hi[a: a + k], dev[a: a + k] = 0.995, 0.999, 0.995
        copy = t
        for name, values in (("unit_min", lo), ("unit_max", hi), ("unit_min_dev", dev)):
            lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32()),
                                             mask=t[name].combine_chunks().is_null())
            copy = copy.set_column(copy.column_names.index(name), name, lists)
        name = f"run{r:03d}-lr{0.001 * (1 + r % 5):g}"
        copy = copy.set_column(copy.column_names.index("run"), "run", pa.array([name] * len(copy)))
        config = {"lr": 0.001 * (1 + r % 5), "width": 16 * (1 + r % 4), "seed": r}
        run_meta = {**meta, b"actrace:run_name": name.encode(), b"actrace:run_id": uuid.uuid4().hex.encode(),
                    b"actrace:config": json.dumps(config).encode()}
        path = out / f"{name}.parquet"
        pq.write_table(copy.replace_schema_metadata(run_meta), path, compression="zstd")
        paths.append(path)
    return paths
