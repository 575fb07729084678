"""Sharded training read as one model: FSDP2 (`fully_shard`) and tensor-parallel runs under
`torchrun` with two CPU ranks (gloo) against one process on the same weights and batch.
Gradients and parameters are read from their local shards, reduced across ranks, never gathered."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import numpy as np
import polars as pl
import pytest

import actrace
from actrace.analyzer.metrics import metrics
from actrace.files.validate import validate

from conftest import HUNG

SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    from actrace.adapters.torch import Monitor

    out, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias[:4] = -100.0  # 4 of 16 units dead for every input
    probe, x, y = torch.randn(9, 8), torch.randn(16, 8), torch.randn(16, 3)  # 5 and 4 probe rows per rank
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]  # FSDP averages the ranks' gradients: the batch's
    if how == "tp":  # every rank the whole batch, each a slice of the linears' units
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(model, probe, out, probe_every=2, param_every=1, probe_chunk=4) as mon:  # 2 chunks each
            for step in range(3):
                ((model(x) - y) ** 2).mean().backward()
                mon.step(step)
                opt.step()
                opt.zero_grad()
    told = [str(w.message) for w in said if "actrace" in str(w.message)]
    assert told == ([] if how != "tp" or dist.get_rank() else [told[0]]) and all("tensor-parallel" in t for t in told), told
    if how != "one":
        dist.destroy_process_group()
""")


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    (d / "run.py").write_text(SCRIPT)
    subprocess.run([sys.executable, d / "run.py", d / "one.parquet", "one"], check=True, timeout=HUNG)
    for how in ("fsdp2", "tp"):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                               "127.0.0.1", "--master_port", _port(), d / "run.py", d / f"{how}.parquet", how],
                              timeout=HUNG, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    return d / "one.parquet", d / "fsdp2.parquet", d / "tp.parquet"


def _rows(path):
    return {(r["step"], r["stream"], r["layer"], r["param"]): r for r in actrace.read_table(path).to_pylist()}


def test_an_fsdp2_run_is_one_trace_that_reads_as_one_process(runs):
    one, sharded = _rows(runs[0]), _rows(runs[1])
    assert validate(runs[1]) == [] and sorted(runs[1].parent.glob("*.parquet*")) == sorted(runs)  # one trace each
    assert sorted(one) == sorted(sharded)
    assert {s for _, s, _, _ in one} == {"activation", "param_grad", "param"}
    for key, a in one.items():
        b = sharded[key]
        assert (a["shape"], a["count"], a["units"], a["nan_count"], a["zero_count"]) == \
               (b["shape"], b["count"], b["units"], b["nan_count"], b["zero_count"]), key
        for name in ("sum", "sumsq", "min", "max", "update_norm"):
            if a[name] is not None:
                np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7, err_msg=f"{key} {name}")
        if a["unit_max"] is not None:  # activations: per unit, in the model's order
            np.testing.assert_allclose(b["unit_max"], a["unit_max"], rtol=1e-5, atol=1e-7, err_msg=str(key))
            assert a["unit_zero"] == b["unit_zero"], key


def test_dead_units_of_an_fsdp2_model_read_as_one_processs(runs):
    dead = [metrics(p).filter((pl.col("layer") == "1") & (pl.col("stream") == "activation"))["dead_fraction"].to_list()
            for p in runs[:2]]
    assert dead[0] == dead[1] and dead[0][0] == 4 / 16


def test_a_tensor_parallel_run_reads_whole_gradients_and_says_once_it_skips_split_activations(runs):
    """Column- and row-parallel linears: gradient and parameter readings equal one process's; the
    activations, split across ranks by unit, are not read (said once, by rank 0: the script checks)."""
    one, tp = _rows(runs[0]), _rows(runs[2])
    assert validate(runs[2]) == [] and {s for _, s, _, _ in tp} == {"param_grad", "param"}
    assert sorted(tp) == sorted(k for k in one if k[1] != "activation")
    for key, b in tp.items():
        a = one[key]
        assert (a["shape"], a["count"], a["units"], a["zero_count"]) == (b["shape"], b["count"], b["units"],
                                                                          b["zero_count"]), key
        for name in ("sum", "sumsq", "min", "max", "update_norm"):
            if a[name] is not None:
                np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7, err_msg=f"{key} {name}")
