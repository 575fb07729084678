"""Flax linen and nnx models trained a few steps in a hand-written JAX loop: every module of a known
kind and every activation, however called, read with its kind on the last axis; channels killed
by construction read as dead; a NaN planted at a known layer and step read there; gradients per leaf."""
from __future__ import annotations

import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import polars as pl
import pytest
from flax import nnx

import actrace
from actrace.format import metadata
from actrace.adapters.flax import Monitor, leaf_names
from actrace.analyzer.metrics import metrics
from actrace.files.validate import validate


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(nn.gelu(nn.Dense(8, name="fc")(x)))


class CNN(nn.Module):
    """Conv(8) → relu, a tanh and a softmax taken as values (`act=`), a Sequential holding relu6."""
    act: callable = jnp.tanh

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv")(x))
        x = nn.LayerNorm(name="norm")(x)
        x = nn.Sequential([nn.Dense(6, name="proj"), nn.relu6])(x.reshape(x.shape[0], -1))
        return nn.softmax(Head(name="head")(self.act(x)))


def _sgd(loss, params, x, y, lr=0.05):
    grads = jax.grad(loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), grads


def test_a_linen_cnn_trained_in_a_jax_loop_is_read_whole(tmp_path):
    model = CNN()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6, 6, 3)).astype("float32"), rng.integers(0, 4, 32)
    params = model.init(jax.random.key(0), x)["params"]
    params["conv"]["bias"] = jnp.array([-50.0] * 3 + [0.0] * 5)  # 3 of 8 channels below zero for every input

    def loss(p, x, y):
        return -jnp.mean(jnp.log(model.apply({"params": p}, x)[jnp.arange(len(y)), y] + 1e-9))

    with Monitor(model, x[:16], tmp_path / "flax.parquet", probe_every=2, run="flax") as mon:
        for step in range(5):
            params, grads = _sgd(loss, params, x, y)
            mon.step(step, params=params, grads=grads)
    out = tmp_path / "flax.parquet"
    assert validate(out) == [] and metadata.read(out)["framework"] == "jax"
    rows = actrace.read_table(out).to_pylist()
    acts = {r["layer"]: (r["kind"], r["unit_axis"], r["units"]) for r in rows if r["stream"] == "activation"}
    assert acts == {"conv": ("conv", 3, 8), "relu": ("relu", 3, 8), "norm": ("norm", 3, 8),
                    "proj": ("linear", 1, 6), "Sequential_0.relu6": ("relu6", 1, 6),
                    "tanh": ("tanh", 1, 6), "head.fc": ("linear", 1, 8), "head.gelu": ("gelu", 1, 8),
                    "head.out": ("linear", 1, 4), "softmax": ("softmax", 1, 4)}
    order = sorted({(r["layer_index"], r["layer"]) for r in rows if r["stream"] == "activation"})
    assert [name for _, name in order] == ["conv", "relu", "norm", "proj", "Sequential_0.relu6",
                                           "tanh", "head.fc", "head.gelu", "head.out", "softmax"]
    m = metrics(out)
    relu = m.filter((pl.col("layer") == "relu") & (pl.col("stream") == "activation"))
    assert relu["step"].to_list() == [0, 2, 4] and set(relu["dead_fraction"]) == {3 / 8}
    grads = {(r["layer"], r["param"], r["kind"]) for r in rows if r["stream"] == "param_grad"}
    assert ("conv", "kernel", "conv") in grads and ("head.out", "bias", "linear") in grads
    assert {r["step"] for r in rows if r["stream"] == "param_grad"} == set(range(5))


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(16, 4, rngs=rngs)])

    def __call__(self, x):
        return self.layers[0](self.bn(self.drop(nnx.relu(self.fc1(x)))))


def test_an_nnx_model_is_read_in_eval_behaviour_and_a_planted_nan_shows_at_its_layer_and_step(tmp_path):
    model = NNXNet(nnx.Rngs(0))
    model.fc1.bias[...] = jnp.array([-40.0] * 5 + [0.0] * 11)  # 5 of 16 units dead
    x = np.random.default_rng(1).normal(size=(32, 8)).astype("float32")
    model.train()
    with Monitor(model, x, tmp_path / "nnx.parquet", probe_every=1) as mon:
        for step in range(4):
            if step == 2:
                model.layers[0].bias[...] = model.layers[0].bias[...].at[1].set(jnp.nan)  # from step 2 on
            grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
            mon.step(step, grads=grads)
    rows = actrace.read_table(tmp_path / "nnx.parquet").to_pylist()
    acts = {r["layer"]: (r["kind"], r["unit_axis"]) for r in rows if r["stream"] == "activation"}
    assert acts == {"fc1": ("linear", 1), "relu": ("relu", 1), "bn": ("norm", 1), "layers.0": ("linear", 1)}
    nan = {(r["layer"], r["step"]) for r in rows if r["stream"] == "activation" and r["nan_count"]}
    assert nan == {("layers.0", 2), ("layers.0", 3)}
    m = metrics(tmp_path / "nnx.parquet").filter((pl.col("layer") == "relu") & (pl.col("stream") == "activation"))
    assert set(m["dead_fraction"]) == {5 / 16}  # dropout off in the reading: no unit of the 11 reads dead
    grads = {(r["layer"], r["param"]) for r in rows if r["stream"] == "param_grad"}
    assert grads == {(layer, p) for layer in ("fc1", "bn", "layers.0") for p in ("kernel" if layer != "bn" else "scale",
                                                                                 "bias")}


def test_a_probe_reading_twice_gives_the_same_values_and_model_mode_is_kept(tmp_path):
    model = NNXNet(nnx.Rngs(0))
    model.train()
    x = np.random.default_rng(1).normal(size=(16, 8)).astype("float32")
    with Monitor(model, x, tmp_path / "a.parquet") as mon:
        mon.probe_reading(0)
        mon.probe_reading(1)
    by_step = {}
    for r in actrace.read_table(tmp_path / "a.parquet").to_pylist():
        by_step.setdefault(r["step"], {})[r["layer"]] = r["unit_sum"]
    assert by_step[0] == by_step[1]
    assert model.drop.deterministic is False  # the reading used an eval copy; the user's model is still training


def test_activations_inside_a_nested_computation_are_said_to_be_unread(tmp_path):
    class Remat(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(Head)(name="head")(nn.relu(nn.Dense(8, name="fc")(x)))

    model, x = Remat(), np.ones((4, 5), "float32")
    params = model.init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"1 activation\(s\) and the outputs of 2 module\(s\) \['head.fc', 'head.out'\]"):
        with Monitor(model, x, tmp_path / "r.parquet") as mon:
            mon.step(0, params=params)
    layers = {r["layer"] for r in actrace.read_table(tmp_path / "r.parquet").to_pylist()}
    assert layers == {"fc", "relu"}


def test_a_linen_model_that_needs_train_false_is_told_so(tmp_path):
    class BN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            return nn.BatchNorm(use_running_average=not train)(x)

    model, x = BN(), np.ones((4, 3), "float32")
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(RuntimeError, match=r"BN does not run on the probe \(give params= every .* apply_kwargs="):
        Monitor(model, x, tmp_path / "bad.parquet").step(0, params=variables)
    with Monitor(model, x, tmp_path / "ok.parquet", apply_kwargs={"train": False}) as mon:
        mon.step(0, params=variables)
    assert {r["layer"] for r in actrace.read_table(tmp_path / "ok.parquet").to_pylist()} == {"BatchNorm_0"}


def test_a_bfloat16_model_is_read_as_float32_values(tmp_path):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.relu(nn.Dense(8, dtype=jnp.bfloat16, name="fc")(x))

    model, x = MLP(), np.random.default_rng(2).normal(size=(16, 4)).astype("float32")
    params = model.init(jax.random.key(0), x)["params"]
    params["fc"]["bias"] = jnp.array([-30.0] * 2 + [0.0] * 6)
    with Monitor(model, x, tmp_path / "bf16.parquet") as mon:
        mon.step(0, params=params)
    assert validate(tmp_path / "bf16.parquet") == []
    relu = next(r for r in actrace.read_table(tmp_path / "bf16.parquet").to_pylist() if r["layer"] == "relu")
    expect = np.asarray(model.apply({"params": params}, x), np.float32)
    np.testing.assert_allclose(relu["unit_sum"], expect.sum(0), rtol=1e-6)
    assert relu["unit_zero"][:2] == [16, 16] and relu["dtype"] == "bfloat16"  # the framework's name (spec)


def test_flax_library_attention_and_lists_are_read_once_under_their_paths_with_heads_as_units(tmp_path):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.SelfAttention(num_heads=4, qkv_features=32, name="sa")(x)
            h = nn.relu(nn.DenseGeneral((2, 4), name="heads")(x)).reshape(x.shape)  # 2 × 4 units
            return nn.gelu(nn.gelu(nn.Dense(8, name="fc")(h)))  # two calls on one line: two readings

    model, x = Block(), np.random.default_rng(3).normal(size=(6, 5, 8)).astype("float32")
    params = model.init(jax.random.key(0), x)["params"]
    params["heads"]["bias"] = params["heads"]["bias"].at[1, 2].set(-100.0)  # one of 8 units dead
    with Monitor(model, x, tmp_path / "att.parquet") as mon:
        mon.step(0, params=params)
    rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "att.parquet").to_pylist()}
    assert list(rows) == ["sa.query", "sa.key", "sa.value", "sa.softmax", "sa.out", "sa", "heads", "relu", "fc",
                          "gelu", "gelu#2"]
    assert (rows["sa.query"]["units"], rows["sa.query"]["shape"]) == (32, [6, 5, 32])  # 4 heads × 8
    assert (rows["sa.softmax"]["kind"], rows["sa.softmax"]["shape"]) == ("softmax", [6, 4, 5, 5])
    assert rows["heads"]["units"] == rows["relu"]["units"] == 8
    m = metrics(tmp_path / "att.parquet")
    assert m.filter(pl.col("layer") == "relu")["dead_fraction"].to_list() == [1 / 8]
    _, seen = model.apply({"params": params}, x, capture_intermediates=True, mutable=["intermediates"])
    h = np.asarray(seen["intermediates"]["fc"]["__call__"][0])  # Flax's own capture
    np.testing.assert_allclose(rows["gelu"]["unit_sum"], np.asarray(jax.nn.gelu(h)).sum((0, 1)), rtol=1e-4)
    np.testing.assert_allclose(rows["gelu#2"]["unit_sum"], np.asarray(jax.nn.gelu(jax.nn.gelu(h))).sum((0, 1)),
                               rtol=1e-4)


def test_a_softmax_is_read_across_the_axis_it_normalizes(tmp_path):
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):  # [B, C, T]
            return nn.softmax(x, axis=1), nn.softmax(50.0 * x)

    x = np.random.default_rng(4).normal(size=(5, 3, 7)).astype("float32")
    x[:, :, 0] += 10.0  # every distribution over T peaked at t = 0
    with Monitor(Two(), x, tmp_path / "s.parquet") as mon:
        mon.step(0, params={})
    rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "s.parquet").to_pylist()}
    assert (rows["softmax"]["unit_axis"], rows["softmax"]["units"]) == (1, 3)
    assert (rows["softmax#2"]["unit_axis"], rows["softmax#2"]["units"]) == (2, 7)
    m = metrics(tmp_path / "s.parquet").filter(pl.col("layer") == "softmax#2")
    assert m["saturation_value"].to_list() == [1.0] and m["saturation_unit"].to_list() == [1 / 7]


def test_activations_called_in_a_loop_or_after_head_split_features_are_each_read(tmp_path):
    class Loop(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.DenseGeneral((2, 4), name="heads")(x)
            h = nn.gelu(h, approximate=False)  # its first equation reads a literal before h
            for _ in range(3):
                h = nn.gelu(h)  # one call site, three calls
            return nn.glu(h.reshape(h.shape[0], -1))  # not a kind: not read, and not "unread" either

    model, x = Loop(), np.random.default_rng(5).normal(size=(6, 3)).astype("float32")
    params = model.init(jax.random.key(0), x)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of unread activations
        with Monitor(model, x, tmp_path / "l.parquet") as mon:
            mon.step(0, params=params)
    rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "l.parquet").to_pylist()}
    assert list(rows) == ["heads", "gelu", "gelu#2", "gelu#3", "gelu#4"]
    assert all(r["units"] == 8 for r in rows.values())
    h = np.asarray(nn.DenseGeneral((2, 4)).apply({"params": params["heads"]}, x))
    h = jax.nn.gelu(h, approximate=False)
    for name in ("gelu#2", "gelu#3", "gelu#4"):
        h = jax.nn.gelu(h)
        np.testing.assert_allclose(rows[name]["unit_sum"], np.asarray(h).reshape(6, 8).sum(0), rtol=1e-5)


def test_a_bfloat16_probe_has_the_fingerprint_the_pytorch_adapter_gives_it(tmp_path):
    import torch

    from actrace.adapters.torch import Monitor as TorchMonitor

    x = np.random.default_rng(6).normal(size=(4, 3)).astype("float32")
    model = nn.Dense(2)
    with Monitor(model, jnp.asarray(x, jnp.bfloat16), tmp_path / "f.parquet") as mon:
        mon.step(0, params=model.init(jax.random.key(0), x))
    with TorchMonitor(torch.nn.Linear(3, 2).to(torch.bfloat16), torch.from_numpy(x).to(torch.bfloat16),
                      tmp_path / "t.parquet") as mon:
        mon.probe_reading(0)
    prints = {metadata.read(tmp_path / f"{n}.parquet")["probe_fingerprint"] for n in ("f", "t")}
    assert len(prints) == 1


def test_nnx_blocks_in_lists_are_named_by_their_whole_path(tmp_path):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return nnx.gelu(self.fc(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.List([MLP(rngs), MLP(rngs)])
            self.dec = nnx.List([MLP(rngs)])

        def __call__(self, x):
            for block in [*self.enc, *self.dec]:
                x = block(x)
            return x

    with Monitor(Net(nnx.Rngs(0)), np.ones((2, 4), "float32"), tmp_path / "l.parquet") as mon:
        mon.probe_reading(0)
    assert [r["layer"] for r in actrace.read_table(tmp_path / "l.parquet").to_pylist()] == [
        "enc.0.fc", "enc.0.gelu", "enc.1.fc", "enc.1.gelu", "dec.0.fc", "dec.0.gelu"]


def test_a_scanned_module_is_said_to_be_unread_not_a_crash(tmp_path):
    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            h = nn.gelu(nn.Dense(4, name="fc")(x))
            return c + h, h

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, xs):
            scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1)
            return scan(name="cell")(jnp.zeros((xs.shape[0], 4)), xs)[1]

    model, x = Scanned(), np.ones((2, 3, 4), "float32")
    params = model.init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"1 activation\(s\) and the outputs of 1 module\(s\) \['cell.fc'\]"):
        with Monitor(model, x, tmp_path / "s.parquet") as mon:
            mon.step(0, params=params)


@pytest.mark.parametrize("path, named", [
    (("params", "blk", "fc", "kernel"), ("blk.fc", "kernel")),
    (("layers", 0, "bias", "value"), ("layers.0", "bias")),
    (("scale",), ("scale", "scale")),
])
def test_leaf_names(path, named):
    keys = [jax.tree_util.SequenceKey(k) if isinstance(k, int) else
            jax.tree_util.GetAttrKey(k) if k == "value" else jax.tree_util.DictKey(k) for k in path]
    assert leaf_names(keys) == named


SCRIPT = """
import flax.linen as nn, jax, numpy as np
from actrace.adapters.flax import Monitor
model, x = nn.Dense(4), np.ones((8, 3), "float32")
params = model.init(jax.random.key(0), x)
with Monitor(model, x) as mon:   # no out=: actrace record says where
    mon.step(0, params=params)
"""


def test_a_flax_script_under_actrace_record_writes_where_it_is_told(tmp_path, cli):
    (tmp_path / "train.py").write_text(SCRIPT)
    out = tmp_path / "runs" / "f.parquet"
    res = cli("record", "-o", out, "--run", "flax-rec", "--config", "lr=0.1", "--", sys.executable, "train.py",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    meta = metadata.read(out)
    assert meta["run_name"] == "flax-rec" and '"lr": 0.1' in meta["config"] and meta["framework"] == "jax"
    assert [(r["layer"], r["kind"]) for r in actrace.read_table(out).to_pylist()] == [("linear", "linear")]


def test_gradient_leaves_are_read_as_each_step_gives_them_whatever_tree_comes(tmp_path):
    """Gradients made by construction, not by a backward: each step's leaves read as they hold then
    (a NaN planted at step 1), a tree of other leaves (step 2: one layer's) read as that tree, a
    non-floating leaf skipped, and the layer kinds of the probe's trace given to every step's rows."""
    params = Head().init(jax.random.PRNGKey(0), jnp.ones((2, 3)))["params"]
    x = np.ones((4, 3), np.float32)

    def made(step):
        return jax.tree_util.tree_map(lambda p: jnp.full(p.shape, step + 1.0, jnp.float32), params)

    with Monitor(Head(), x, tmp_path / "g.parquet", probe_every=100) as mon:
        mon.step(0, params=params, grads=made(0))
        planted = made(1)
        planted["fc"]["kernel"] = planted["fc"]["kernel"].at[0, 0].set(jnp.nan)
        mon.step(1, grads=planted)
        mon.step(2, grads={"out": made(2)["out"], "count": jnp.arange(3)})
    rows = [r for r in actrace.read_table(tmp_path / "g.parquet").to_pylist() if r["stream"] == "param_grad"]
    got = {(r["step"], r["layer"], r["param"]): (r["kind"], r["nan_count"], r["sum"], r["count"]) for r in rows}
    size = {(layer, p): int(np.size(v)) for layer, leaves in params.items() for p, v in leaves.items()}
    want = {(s, layer, p): ("linear", int(s == 1 and (layer, p) == ("fc", "kernel")),
                            (s + 1.0) * (size[layer, p] - int(s == 1 and (layer, p) == ("fc", "kernel"))), size[layer, p])
            for s in range(3) for layer, p in size if s < 2 or layer == "out"}
    assert got == want
