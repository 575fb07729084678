"""PyTorch adapter: ground truth by construction, agreement with numpy, hooks, DDP, `record`."""
from __future__ import annotations

import os
import sys
import textwrap
import warnings

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

import actrace
from actrace.format import bins, metadata
from actrace.reduce import kernel
from actrace.reduce import torch as _torch_reduce
from actrace.adapters.torch import Monitor
from actrace.adapters.torch import forward
from actrace.analyzer.metrics import metrics
from actrace.reduce import reduce_array
from conftest import HUNG, LEAVE


def act(path, layer, column="dead_fraction"):
    m = metrics(path)
    return m.filter((pl.col("stream") == "activation") & (pl.col("layer") == layer))[column].to_list()


def record_once(model, probe, path, **kw):
    with Monitor(model, probe, path, **kw) as mon:
        mon.probe_reading(0)
    return path


def test_killed_units_give_exactly_that_dead_fraction(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
    with torch.no_grad():
        model[0].bias[:24] = -100.0
    record_once(model, torch.randn(256, 16), tmp_path / "t.parquet")
    assert act(tmp_path / "t.parquet", "1") == [24 / 64]


def test_healthy_relu_is_half_zeros_and_not_dead(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU())
    record_once(model, torch.randn(512, 64), tmp_path / "t.parquet")
    assert act(tmp_path / "t.parquet", "1") == [0.0]
    assert 0.4 < act(tmp_path / "t.parquet", "1", "sparsity")[0] < 0.6


def test_tanh_with_bias_five_is_saturated_per_value_and_per_unit(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
    with torch.no_grad():
        model[0].weight.mul_(0.1)
        model[0].bias.fill_(5.0)
    record_once(model, torch.randn(128, 8), tmp_path / "t.parquet")
    assert act(tmp_path / "t.parquet", "1", "saturation_value")[0] > 0.95
    assert act(tmp_path / "t.parquet", "1", "saturation_unit")[0] > 0.95


def test_dropout_in_train_mode_is_not_read_as_death_and_modes_are_restored(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
    model.train()
    probe = torch.randn(8, 16)  # small probe: a 0.5 mask would zero whole units often
    record_once(model, probe, tmp_path / "train.parquet", include=["2", "1"])
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    record_once(model, probe, tmp_path / "eval.parquet", include=["2", "1"])
    assert act(tmp_path / "train.parquet", "1") == act(tmp_path / "eval.parquet", "1")
    with torch.no_grad():
        masked = nn.functional.dropout(model[1](model[0](probe)), 0.5, training=True)
    assert (masked.abs().amax(0) == 0).float().mean() > act(tmp_path / "eval.parquet", "1")[0]


def test_a_probe_reading_holds_off_the_garbage_collector_and_gives_back_its_state(tmp_path):
    """The cyclic collector is off while the probe forward runs (its collections scanned the whole
    framework's objects: 6-7 % of a deep model's reading) and as it was afterwards: on again, or
    still off where the training script turned it off, also when the forward raises."""
    import gc

    seen = []
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    model[1].register_forward_hook(lambda *_: seen.append(gc.isenabled()))
    with Monitor(model, torch.randn(16, 4), tmp_path / "t.parquet") as mon:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            try:
                mon.probe_reading(len(seen))
            finally:
                after = gc.isenabled()
                gc.enable()
            assert seen[-1] is False and after is enabled
        model[0].register_forward_hook(lambda *_: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            mon.probe_reading(9)
        assert gc.isenabled()


SHAPES = {"dense": ((32, 48), 1), "nchw": ((8, 6, 5, 7), 1), "nhwc": ((8, 5, 7, 6), 3),
          "sequence": ((4, 9, 24), 2), "whole": ((16, 12), None)}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_accelerator_histogram_path_equals_the_definition(dtype, device):
    """One binary search over signed edges places every value as the definition does: at, just
    below and just above each edge of either sign, zero of either sign, the tiniest and largest
    values, ±inf; NaN left out."""
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    info, edges = np.finfo(np_dtype), bins.MAGNITUDE_EDGES.astype(np_dtype)
    near = np.concatenate([edges, np.nextafter(edges, np_dtype(0)), np.nextafter(edges, np_dtype(np.inf))])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, info.smallest_subnormal, -info.smallest_subnormal,
                        info.max, -info.max, info.tiny, -info.tiny], np_dtype)
    x = torch.cat([torch.randn(5000, dtype=dtype) * 10 ** torch.randint(-9, 9, (5000,)).to(dtype),
                   torch.from_numpy(np.concatenate([near, -near, special]))])
    got = _torch_reduce.bucketize_histogram(x.to(device)).cpu().numpy()
    np.testing.assert_array_equal(got, bins.histogram_exact(x.numpy()))


@pytest.mark.parametrize("reader", ["kernel", "torch ops", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is here: its tests read the fused kernels"))])
@pytest.mark.parametrize("where", ["host", "device"])
def test_rows_left_out_read_as_the_rows_kept_alone(where, reader, monkeypatch):
    """`rows` keeps some rows of a tensor (a derived reading's queries): on the host by indexing,
    on a device as NaN taken out on the host (no sync to select them); either way the reading of
    the rows kept, NaN and Inf among them and in the rows left out. Read by the C kernel, torch
    kernels, or (`triton`) a GPU's fused kernels, both tensors in one batch, run by Triton's interpreter."""
    from actrace.reduce import fused

    monkeypatch.setattr(_torch_reduce.kernel, "available", reader == "kernel" and _torch_reduce.kernel.available)
    if reader == "triton":
        monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.dtype in (torch.float32, torch.float64))
    if where == "device":  # the device's path, taken here by a CPU tensor
        monkeypatch.setattr(_torch_reduce, "on_device", lambda v: isinstance(v, torch.Tensor))
    x = torch.randn(12, 5)
    x[1, 2], x[3, 0], x[4, 4], x[7, 1] = float("nan"), float("inf"), float("nan"), -float("inf")
    rows = torch.tensor([True, False, True, True, False, True, False, True, True, True, False, True])
    got, want = _torch_reduce.to_readings(_torch_reduce.reduce_tensors([(x, 1, "tanh", dict(layer="h", rows=rows)),
                                                                        (x[rows], 1, "tanh", dict(layer="h"))]))
    assert got.shape == want.shape == (8, 5)
    assert (got.nan_count, got.inf_count) == (want.nan_count, want.inf_count) == (0, 2)
    for field in ("count", "zero_count", "min", "max", "hist", "sat_counts", "unit_count", "unit_min", "unit_max",
                  "unit_min_dev"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    for field in ("sum", "sumsq", "unit_sum", "unit_sumsq"):  # added in another order (the kernel: float32 lanes)
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-5, err_msg=field)
    if where == "device":  # no row kept: no reading (the host knows only once the transfer came)
        none = torch.zeros(12, dtype=torch.bool)
        assert _torch_reduce.to_readings([_torch_reduce.reduce_tensor(x, 1, "tanh", layer="h", rows=none)]) == [None]


def test_chunked_probe_equals_the_whole_probe(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10), nn.Sigmoid())
    probe = torch.randn(50, 3, 8, 8)
    whole = actrace.read_table(record_once(model, probe, tmp_path / "w.parquet")).to_pylist()
    chunked = actrace.read_table(record_once(model, probe, tmp_path / "c.parquet", probe_chunk=7)).to_pylist()
    assert [r["layer"] for r in whole] == [r["layer"] for r in chunked] == ["0", "1", "3", "4"]
    for a, b in zip(whole, chunked):
        # the forward itself rounds differently per batch size (float32), so compare to that tolerance
        assert a["shape"] == b["shape"] and a["hist"] == b["hist"] and a["unit_zero"] == b["unit_zero"]
        for name in ("unit_sum", "unit_sumsq", "unit_min", "unit_max"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)
    conv = whole[1]
    assert conv["unit_axis"] == 1 and conv["units"] == 8  # NCHW: channels are the units


def assert_reads(row: dict, t: torch.Tensor, kind: str) -> None:
    """A trace row holds exactly the numpy reference's reading of tensor `t` (units on the last axis)."""
    want = reduce_array(t.detach().numpy(), t.ndim - 1, kind, layer=row["layer"])
    assert (row["nan_count"], row["inf_count"], row["zero_count"]) == (want.nan_count, want.inf_count, want.zero_count)
    assert row["hist"] == want.hist.tolist() and row["unit_zero"] == want.unit_zero.tolist()
    for name in ("unit_sum", "unit_sumsq", "unit_min", "unit_max", "unit_min_dev"):
        np.testing.assert_allclose(row[name], getattr(want, name), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_a_relu_read_from_its_inputs_pass_and_in_place_relus_read_what_they_overwrite(tmp_path, inplace, nonfinite,
                                                                                     monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=inplace), nn.Linear(32, 24), nn.ReLU(inplace=inplace))
    probe = torch.randn(64, 16)
    if nonfinite:  # ±inf and NaN before the ReLU; relu(-inf) is 0: these ReLUs take their own pass
        probe[0, 0], probe[1, :] = float("inf"), float("nan")
    passes = []
    real = kernel.reduce_many
    monkeypatch.setattr(kernel, "reduce_many", lambda tasks: passes.extend(tasks) or real(tasks))
    rows = actrace.read_table(record_once(model, probe, tmp_path / "t.parquet")).to_pylist()
    assert len(passes) == (4 if nonfinite else 2) or not kernel.available  # a ReLU's reading from its input's pass
    with torch.no_grad():
        h0 = model[0](probe)
        h1 = torch.relu(h0)
        h2 = model[2](h1)
    assert [r["layer"] for r in rows] == ["0", "1", "2", "3"]
    for row, t, kind in zip(rows, (h0, h1, h2, torch.relu(h2)), ("linear", "relu", "linear", "relu")):
        assert_reads(row, t, kind)
    assert (rows[0]["inf_count"] > 0) == nonfinite and rows[1]["min"] == 0


class Residual(nn.Module):
    """`out += x` changes the recorded output of `fc` after its hook ran (as in ResNet blocks)."""

    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        out = self.fc(x)
        out += x
        return self.act(out)


def test_an_output_changed_in_place_after_its_hook_is_read_as_the_layer_gave_it(tmp_path):
    torch.manual_seed(0)
    model, probe = Residual(), torch.randn(32, 8)
    path = tmp_path / "t.parquet"
    with Monitor(model, probe, path) as mon:
        mon.probe_reading(0)
        mon.probe_reading(1)
    rows = actrace.read_table(path).to_pylist()
    with torch.no_grad():
        fc = model.fc(probe)
    for step in (0, 1):
        by_layer = {r["layer"]: r for r in rows if r["step"] == step}
        assert_reads(by_layer["fc"], fc, "linear")
        assert_reads(by_layer["act"], torch.relu(fc + probe), "relu")


class Scaled(nn.Module):
    """`out.data.mul_(2)` changes the recorded output of `fc` after its hook ran, through `.data`,
    which no version counter sees."""

    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.Tanh()

    def forward(self, x):
        out = self.fc(x)
        out.data.mul_(2)
        return self.act(out)


@pytest.mark.parametrize("changes", ["none", "in place", "through .data"])
def test_readings_wait_for_one_kernel_batch_only_where_nothing_changes_them_in_place(tmp_path, changes, monkeypatch):
    """The trial holds copies of what it read and compares them at the forward's end: where every
    one is as it was, a reading holds its tensors and reads them in one kernel batch; where a
    tensor changed in place after its hook (`out += x`, or through `.data`), each is read at once.
    Either way every reading is of the tensor as its layer gave it."""
    torch.manual_seed(0)
    model = {"none": lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()),
             "in place": Residual, "through .data": Scaled}[changes]()
    probe = torch.randn(32, 8)
    batches = []
    real = kernel.reduce_many
    monkeypatch.setattr(kernel, "reduce_many", lambda tasks: batches.append(len(tasks)) or real(tasks))
    path = tmp_path / "t.parquet"
    with Monitor(model, probe, path, grad_every=None) as mon:
        assert mon.forward.batches == (changes == "none")
        batches.clear()
        mon.probe_reading(0)
        assert batches == ([4] if changes == "none" else [1, 1]) or not kernel.available
        monkeypatch.setattr(forward, "HOLD", 2 * probe.nbytes)  # a batch is read once it holds that much
        batches.clear()
        mon.probe_reading(1)
        assert batches == ([2, 2] if changes == "none" else [1, 1]) or not kernel.available
    rows = {r["layer"]: r for r in actrace.read_table(path).to_pylist() if r["step"] == 1}
    with torch.no_grad():
        if changes == "none":
            h = [model[0](probe)]
            h += [torch.tanh(h[0]), model[2](torch.tanh(h[0]))]
            h.append(torch.tanh(h[2]))
            for (name, row), t, kind in zip(rows.items(), h, ("linear", "tanh", "linear", "tanh")):
                assert_reads(row, t, kind)
        else:
            fc = model.fc(probe)
            assert_reads(rows["fc"], fc, "linear")
            assert_reads(rows["act"], torch.relu(fc + probe) if changes == "in place" else torch.tanh(2 * fc),
                         "relu" if changes == "in place" else "tanh")


class Head(nn.Module):
    """A parameterized module whose output is a dict with a float and an integer field."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        logits = x @ self.w
        return {"logits": logits, "ids": torch.argmax(logits, dim=1)}


class TwiceReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.head = nn.Linear(4, 4), nn.ReLU(), Head()

    def forward(self, x):
        return self.head(self.act(self.fc(self.act(x))))


def test_repeated_calls_get_distinct_names_and_dict_fields_are_recorded(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(TwiceReLU(), torch.randn(6, 4), tmp_path / "t.parquet") as mon:
            mon.probe_reading(0)
            mon.probe_reading(1)
    layers = actrace.read_table(tmp_path / "t.parquet")["layer"].to_pylist()
    assert layers[:4] == ["act", "fc", "act#2", "head.logits"] and len(layers) == 8
    assert "head.ids" not in layers  # an index beside the output: no activation, read nor warned of
    assert not [w for w in caught if "non-float" in str(w.message)]


def test_functional_activations_in_transformer_layers_are_read(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model, probe = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), torch.randn(4, 10, 32)
    record_once(model, probe, tmp_path / "t.parquet")
    t = actrace.read_table(tmp_path / "t.parquet").to_pylist()
    acts = {r["layer"]: r for r in t}
    assert {"layers.0.relu", "layers.1.relu"} <= set(acts)  # F.relu inside the layer's forward
    a = acts["layers.0.relu"]
    assert a["kind"] == "relu" and a["units"] == 64 and a["unit_axis"] == 2 and a["min"] == 0.0
    assert 0.3 < a["zero_count"] / a["count"] < 0.7
    assert acts["layers.0.linear1"]["units"] == 64  # sequence [B, T, D]: the last axis
    seen = []  # what linear2 really reads, captured apart
    handle = model.layers[1].linear2.register_forward_pre_hook(lambda m, i: seen.append(i[0].clone()))
    with torch.no_grad():
        model.eval()(probe)
    handle.remove()
    assert_reads(acts["layers.1.relu"], seen[0], "relu")


def test_gradient_readings_record_norms_update_ratio_and_nan_without_raising(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {}
    with Monitor(model, torch.randn(8, 4), tmp_path / "g.parquet", probe_every=100, param_every=1) as mon:
        for step in range(3):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == 2:
                model[2].weight.grad[0, 0] = float("nan")
            grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
            before[step] = ({n: p.detach().clone() for n, p in model.named_parameters()}, grads)
            mon.step(step)
            opt.step()
    rows = actrace.read_table(tmp_path / "g.parquet").to_pylist()
    g = {(r["step"], r["layer"], r["param"]): r for r in rows if r["stream"] == "param_grad"}
    assert np.sqrt(g[(0, "0", "weight")]["sumsq"]) == pytest.approx(before[0][1]["0.weight"], rel=1e-6)
    assert g[(2, "2", "weight")]["nan_count"] == 1
    p = {(r["step"], r["layer"], r["param"]): r for r in rows if r["stream"] == "param"}
    delta = (before[1][0]["0.weight"] - before[0][0]["0.weight"]).norm().item()
    assert p[(0, "0", "weight")]["update_norm"] is None
    assert p[(1, "0", "weight")]["update_norm"] == pytest.approx(delta, rel=1e-6)
    m = metrics(tmp_path / "g.parquet")
    assert m.filter(pl.col("stream") == "param")["update_ratio"].drop_nulls().len() > 0


def test_a_sparse_gradient_is_read_as_the_dense_gradient_it_stands_for(tmp_path):
    """`nn.Embedding(sparse=True)` gives a sparse gradient: it is read (not raised into training) as
    its dense twin's, every row no token of the batch chose counted as zeros."""
    got = {}
    for sparse in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.tensor([[1, 2, 3], [3, 2, 1]])  # rows 1-3 of 10: 7 rows of 4 zeros
        path = tmp_path / f"{sparse}.parquet"
        with Monitor(model, tokens, path, probe_every=100) as mon:
            for step in range(2):
                model(tokens).pow(2).mean().backward()
                mon.step(step)
                opt.step()
                opt.zero_grad()
        got[sparse] = {(r["step"], r["layer"]): r for r in actrace.read_table(path).to_pylist()
                       if r["stream"] == "param_grad"}
    for key, dense in got[False].items():
        row = got[True][key]
        assert (row["count"], row["zero_count"], row["nan_count"]) == (dense["count"], dense["zero_count"], 0)
        assert [row[k] for k in ("sum", "sumsq", "min", "max")] == pytest.approx(
            [dense[k] for k in ("sum", "sumsq", "min", "max")], rel=1e-6)
    assert got[True][(1, "0")]["count"] == 40 and got[True][(1, "0")]["zero_count"] >= 28


def test_activation_gradients_when_asked(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    with Monitor(model, torch.randn(8, 4), tmp_path / "a.parquet", probe_every=100, activation_grads=True) as mon:
        loss = model(torch.randn(16, 4)).sum()
        loss.backward()
        mon.step(0)
    rows = [r for r in actrace.read_table(tmp_path / "a.parquet").to_pylist() if r["stream"] == "activation_grad"]
    assert {r["layer"] for r in rows} == {"0", "1"} and all(r["units"] == 8 and r["unit_sum"] for r in rows)


def test_hooks_are_removed_on_close(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    Monitor(model, torch.randn(8, 4), tmp_path / "h.parquet").close()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


DDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.nn as nn
    from actrace.adapters.torch import Monitor
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5), nn.Tanh())
    probe = torch.randn(13, 3, 8, 8)
    with Monitor(model, probe, sys.argv[3], probe_chunk=4) as mon:
        mon.probe_reading(0)
    if world > 1:
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
""")


def test_two_gloo_ranks_record_what_one_process_records(tmp_path):
    import socket
    import subprocess

    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT + LEAVE)
    def free_port() -> str:  # one per run: the single run's port may still be held (TIME_WAIT) after it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return str(s.getsockname()[1])

    subprocess.run([sys.executable, script, "0", "1", tmp_path / "single.parquet", free_port()], check=True)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, script, str(r), "2", tmp_path / "ddp.parquet", port],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    said = [p.communicate(timeout=HUNG)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(s[-2000:] for s in said)
    single = actrace.read_table(tmp_path / "single.parquet").to_pylist()
    ddp = actrace.read_table(tmp_path / "ddp.parquet").to_pylist()
    assert len(single) == len(ddp) == 4
    for a, b in zip(single, ddp):
        assert (a["layer"], a["shape"], a["count"], a["hist"], a["unit_zero"]) == \
               (b["layer"], b["shape"], b["count"], b["hist"], b["unit_zero"])
        for name in ("unit_sum", "unit_sumsq", "unit_min", "unit_max"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)


TRAIN_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    from actrace.adapters.torch import Monitor
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, probe=torch.randn(32, 8), probe_every=2, flush_every=1)
    for step in range(5):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad(); loss.backward(); mon.step(step); opt.step()
    if sys.argv[1] == "crash":
        raise SystemExit(7)   # dies without closing the monitor
    mon.close()
""")


def test_record_runs_a_script_hands_over_the_output_and_passes_the_exit_code(cli, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    res = cli("record", "-o", tmp_path / "runs" / "a.parquet", "--run", "baseline", "--config", "lr=0.1",
              "--", "python", script, "ok")
    assert res.returncode == 0, res.stderr
    assert "runs/a.parquet: " in res.stderr and "steps" in res.stderr and "KiB" in res.stderr
    d = actrace.read_table(tmp_path / "runs" / "a.parquet")
    from actrace.files.reader import read_source
    meta = read_source(tmp_path / "runs" / "a.parquet")[1]
    assert meta["run_name"] == "baseline" and meta["config"] == '{"lr": 0.1}' and len(d) > 0
    crash = cli("record", "-o", tmp_path / "runs" / "b.parquet", "--", "python", script, "crash")
    assert crash.returncode == 7 and "runs/b.parquet: " in crash.stderr  # closed at exit: nothing lost
    assert len(actrace.read_table(tmp_path / "runs" / "b.parquet")) == len(d)
    assert read_source(tmp_path / "runs" / "b.parquet")[1]["status"] == "closed at exit"


PATHS = ["native", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is here: the cuda case reads the fused kernel")),
         pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"))]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, "mixed"])
def test_gradient_readings_of_many_tensors_at_once_equal_the_reference(dtype, path, monkeypatch):
    """`layer_readings` (one kernel batch for CPU float32, torch kernels otherwise; on a GPU, `cuda`,
    or by Triton's interpreter, `triton`: the fused kernel, one launch per dtype) against the numpy reference, on
    hard values: NaN, ±inf, zeros, a tensor cut among threads (and chunks), a 0-d one, one of NaN
    only; scaled. Where one batch reads them all, `layer_totals` gives the same readings."""
    from actrace.reduce import fused, reference
    from actrace.reduce.torch import layer_readings, layer_totals

    if path == "triton":
        monkeypatch.setattr(fused, "usable", lambda t, narrow=False: narrow and t.is_floating_point())
        monkeypatch.setattr(kernel, "available", False)
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16] if dtype == "mixed" else [dtype]
    tensors = [torch.randn(shape, generator=g).to(dtypes[i % len(dtypes)])
               for i, shape in enumerate(((7, 3), (300, 400), (5,), (), (3,)))]
    tensors[0][1, 1], tensors[0][2, 2], tensors[0][3] = float("nan"), float("-inf"), 0.0
    tensors[-1][:] = float("nan")
    device = [t.cuda() for t in tensors] if path == "cuda" else tensors
    metas = [dict(layer=f"l{i}", kind="linear", stream="param_grad", param="weight") for i in range(len(tensors))]
    for scale in (1.0, 256.0):
        got = layer_readings(device, [dict(m) for m in metas], scale)
        batch = layer_totals(device, metas, scale)
        assert (batch is not None) == (path != "native" or dtype is torch.float32)
        if batch is not None:
            assert [repr(vars(r)) for r in batch.readings()] == [repr(vars(r)) for r in got]  # NaN as NaN
        for t, r in zip(tensors, got):
            x = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy().astype(np.float64)
            x = x.reshape(1, 1, -1) / scale
            ref = reference(x, 1, histogram=False)
            assert (r.shape, r.unit_axis, r.units, r.count) == (tuple(t.shape), 0 if t.ndim else None,
                                                                 t.shape[0] if t.ndim else 1, t.numel())
            assert (r.nan_count, r.inf_count, r.zero_count) == tuple(
                int(np.sum(ref[k])) for k in ("nan_count", "inf_count", "unit_zero"))
            for name, col in (("sum", "unit_sum"), ("sumsq", "unit_sumsq"), ("min", "unit_min"), ("max", "unit_max")):
                assert getattr(r, name) == pytest.approx(float(np.asarray(ref[col]).ravel()[0]), rel=1e-5, abs=1e-9,
                                                         nan_ok=True)
            assert r.unit_sum is None and r.hist is None


@pytest.mark.parametrize("path", PATHS[1:])
def test_a_gpu_s_per_unit_readings_of_many_tensors_are_one_batch_that_reads_each_as_alone(path, monkeypatch):
    """`reduce_tensors` of a probe's tensors on one GPU (or, `triton`, CPU tensors standing in for a
    GPU's, the fused kernels run by Triton's interpreter): one launch per kind of program (dtype,
    units a program, histogram, saturation counts) for those one program per block of units reads
    whole, the one cut among programs read alone; every reading equals the one `reduce_tensor` gives
    that tensor alone, field by field, and holds the values planted in it (a NaN, an inf, a dead
    unit, a unit pinned at tanh's bound)."""
    from actrace.reduce import fused

    if path == "triton":
        monkeypatch.setattr(kernel, "available", False)
        monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.dtype in (torch.float32, torch.float64))
        monkeypatch.setattr(_torch_reduce, "on_device", lambda v: isinstance(v, torch.Tensor))
    real, launches = fused._batch(), []

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(fused, "_batch", Counted)
    g = torch.Generator().manual_seed(0)
    shapes = [((6, 5), -1, "linear", True, torch.float32), ((4, 3, 7), 1, "tanh", True, torch.float32),
              ((2, 3, 7), 1, "tanh", True, torch.float32), ((9, 40), -1, "sigmoid", False, torch.float32),
              ((5, 70), -1, "relu", True, torch.float64), ((40_000, 1), -1, "linear", True, torch.float32)]
    tensors = [torch.randn(shape, generator=g, dtype=dtype) for shape, *_, dtype in shapes]
    x = tensors[0]
    x[:, 0], x[1, 1], x[2, 3] = 0.0, float("nan"), float("inf")
    tensors[1][:, 2] = 1.0  # tanh's bound, at every entry of unit 2
    if path == "cuda":
        tensors = [t.cuda() for t in tensors]
    calls = [(t, axis, kind, dict(layer=f"l{i}", histogram=histogram))
             for i, (t, (_, axis, kind, histogram, _)) in enumerate(zip(tensors, shapes))]
    batched = _torch_reduce.to_readings(_torch_reduce.reduce_tensors(calls))
    assert len(launches) == 4  # float32 of 5, 3 (two tanh, one launch) and 40 units, float64 of 70
    alone = [_torch_reduce.to_readings([_torch_reduce.reduce_tensor(t, axis, kind, **options)])[0]
             for t, axis, kind, options in calls]
    for a, b in zip(batched, alone):
        for name, v in vars(a).items():
            w = getattr(b, name)
            assert np.array_equal(v, w, equal_nan=True) if isinstance(v, np.ndarray) else v == w or v != v and w != w, \
                (a.layer, name)
    first = batched[0]
    assert (first.nan_count, first.inf_count, first.unit_zero[0], first.unit_max[0], first.unit_count[1]) == \
        (1, 1, 6, 0.0, 5)
    assert first.hist.sum() == 29 and first.hist[-1] == 1 and batched[3].hist is None  # all but the NaN; inf last
    assert batched[1].sat_counts.sum() > 0 and (batched[1].unit_min[2], batched[1].unit_max[2]) == (1.0, 1.0)
    assert batched[-1].count == 40_000 and batched[-1].hist.sum() == 40_000


class _Transposed(nn.Module):
    """tanh of its input with its last two axes swapped: an output whose last axis is not contiguous."""

    def forward(self, x):
        return torch.tanh(x.transpose(1, 2))


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_gpu_s_float64_and_bfloat16_outputs_are_held_for_a_batch_and_read_as_built(path, dtype, tmp_path,
                                                                                       monkeypatch):
    """A GPU's float64 and bfloat16 outputs, a transposed one among them, are held and read in one batch
    of the fused kernels (the trial compares each bit for bit at its own width), and read as built:
    two units of the linear pinned at tanh's bound by a bias of +1e4, every value of theirs saturated."""
    from actrace.reduce import fused

    if path == "triton":
        monkeypatch.setattr(kernel, "available", False)
        monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.dtype in (torch.float32, torch.float64)
                            or narrow and t.is_floating_point())
        monkeypatch.setattr(_torch_reduce, "on_device", lambda v: isinstance(v, torch.Tensor))
    batched, real = [], fused.batch
    monkeypatch.setattr(fused, "batch", lambda items: batched.append(len(items)) or real(items))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), _Transposed()).to(dtype)
    with torch.no_grad():
        model[0].bias[:2] = 1e4
    device = "cuda" if path == "cuda" else "cpu"
    with Monitor(model.to(device), torch.randn(3, 5, 4, dtype=dtype, device=device), tmp_path / "t.parquet",
                 grad_every=None) as mon:
        mon.probe_reading(0)
    assert batched == [2]  # the linear's output and the tanh's, in one batch
    (tanh,) = [r for r in actrace.read_table(tmp_path / "t.parquet").to_pylist() if r["kind"] == "tanh"]
    assert (tanh["dtype"], tanh["shape"], tanh["unit_axis"], tanh["units"]) == \
        (str(dtype).removeprefix("torch."), [3, 6, 5], 1, 6)
    assert tanh["unit_min"][:2] == [1.0, 1.0] and max(tanh["unit_max"][2:]) < 1.0
    assert tanh["sat_counts"][-1] >= 2 * 3 * 5  # at +1: every value of the two pinned units


@pytest.mark.parametrize("path", PATHS[1:])
def test_a_gpu_s_in_place_relu_leaves_its_model_s_batches_on(path, tmp_path, monkeypatch):
    """The output an in-place ReLU overwrites next is read at once, not held: the trial finds nothing
    changed in place, so a GPU's readings stay batched; the ReLU reads its killed units dead."""
    from actrace.reduce import fused

    if path == "triton":
        monkeypatch.setattr(kernel, "available", False)
        monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.is_floating_point())
        monkeypatch.setattr(_torch_reduce, "on_device", lambda v: isinstance(v, torch.Tensor))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3), nn.Tanh())
    with torch.no_grad():
        model[0].bias[:2], model[0].bias[2:] = -1e4, 1e4  # two units dead, the others alive for any input
    device = "cuda" if path == "cuda" else "cpu"
    with Monitor(model.to(device), torch.randn(16, 4, device=device), tmp_path / "t.parquet", grad_every=None) as mon:
        mon.probe_reading(0)
        assert mon.forward.batches
    m = metrics(tmp_path / "t.parquet").filter(pl.col("stream") == "activation")
    assert dict(zip(m["layer"], m["dead_fraction"]))["1"] == 2 / 8


def test_the_trace_s_map_of_tensors_holds_none_alive_and_tells_a_new_tensor_at_a_reused_address_apart():
    """The axes' map keys tensors by identity without keeping them: a tensor's entry goes with it,
    and a tensor made later (CPython may give it the same id) is not taken for the one that went."""
    import gc
    import weakref

    import torch

    from actrace.adapters.torch.axes import TensorMap

    seen, kept = TensorMap(), torch.ones(2)
    seen[kept] = 1
    gone = torch.zeros(3)
    seen[gone], seen[gone] = 2, 3  # set again: one entry, the last value
    alive = weakref.ref(gone)
    assert (seen[kept], seen.get(gone), len(seen._entries)) == (1, 3, 2)
    del gone
    gc.collect()
    assert alive() is None and len(seen._entries) == 1 and kept in seen
    for _ in range(50):  # new tensors, some at the address the dead one had
        t = torch.zeros(3)
        assert t not in seen and seen.get(t, "none") == "none"
        with pytest.raises(KeyError):
            seen[t]


class BreaksInEvaluation(nn.Module):
    """A layer whose evaluation path raises from its `fails`-th call in eval mode on (a shape check
    the probe trips, say); training never takes that path."""

    def __init__(self, fails: int):
        super().__init__()
        self.fc, self.calls, self.fails = nn.Linear(8, 8), 0, fails

    def forward(self, x):
        if not self.training:
            self.calls += 1
            if self.calls >= self.fails:
                raise RuntimeError("planted: the evaluation path broke")
        return torch.relu(self.fc(x))


def test_a_probe_reading_that_raises_is_skipped_and_said_and_training_goes_on(tmp_path):
    """The model's own evaluation path raises at the second probe reading (the construction's trial
    ran it twice): that reading and each later one is skipped, the first failure said with its
    error and their count at close; the model is back in training mode after each, gradients are
    read every step, and the trace closes complete with the readings that could be taken. (The
    first reading of a kind raises: tests/test_flax.py's model that needs train=False.)"""
    torch.manual_seed(0)
    model = nn.Sequential(BreaksInEvaluation(fails=4), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(model, torch.randn(8, 8), tmp_path / "t.parquet", probe_every=3) as mon:
            for step in range(10):
                loss = model(torch.randn(4, 8)).pow(2).mean()  # raises if the monitor left eval mode on
                opt.zero_grad()
                loss.backward()
                mon.step(step)
                opt.step()
                assert model.training
    said = [str(w.message) for w in said if "actrace" in str(w.message)]
    assert [m for m in said if "reading failed" in m] == [
        "actrace: step 3: the probe reading failed (RuntimeError: planted: the evaluation path broke); it is skipped "
        "and training goes on (each later probe reading that fails is skipped too, counted at close)"]
    assert f"actrace: {tmp_path / 't.parquet'}: 3 probe reading(s) failed and were skipped, the first at step 3 " \
        "(RuntimeError: planted: the evaluation path broke)" in said  # at steps 3, 6, 9
    t = pl.from_arrow(actrace.read_table(tmp_path / "t.parquet"))
    steps = {stream: sorted(set(g["step"])) for (stream,), g in t.group_by(["stream"])}
    assert steps["activation"] == [0] and steps["param_grad"] == list(range(10))
    assert metadata.read(tmp_path / "t.parquet")["status"] == "complete"
