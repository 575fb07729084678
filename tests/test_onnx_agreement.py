"""A PyTorch run and its ONNX export agree layer by layer (both exporters): one reading per
framework layer, named as the PyTorch adapter names it, with the same unit axis."""
from __future__ import annotations

import warnings

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actrace
from actrace.format.schema import ATTENTION_KINDS
from actrace.adapters.onnx import record_onnx
from actrace.adapters.torch import Monitor
from actrace.analyzer.compare import align
from actrace.analyzer.metrics import metrics


class Acts(nn.Module):
    """Linears with SiLU, Mish, GELU (tanh) modules and a functional GELU; 4 fc1 units killed."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(8, 16), nn.SiLU()
        self.fc2, self.act2 = nn.Linear(16, 16), nn.Mish()
        self.fc3, self.act3 = nn.Linear(16, 16), nn.GELU(approximate="tanh")
        self.fc4 = nn.Linear(16, 4)
        with torch.no_grad():
            self.fc1.bias[:4] = -12.0  # far negative: SiLU pins these units near 0 (never exactly)

    def forward(self, x):
        return self.fc4(F.gelu(self.fc3(self.act3(self.fc2(self.act2(self.act1(self.fc1(x))))))))


class Res(nn.Module):
    """Conv → BatchNorm → ReLU → Upsample → Conv → ReLU, 3 of 8 channels of the last ReLU dead."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.up = nn.Upsample(scale_factor=2)
        self.conv2, self.relu2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        with torch.no_grad():
            self.bn1.running_mean.uniform_(-0.5, 0.5)
            self.bn1.running_var.uniform_(0.5, 2.0)
            self.conv2.bias[:3] = -50.0

    def forward(self, x):
        return self.relu2(self.conv2(self.up(self.relu(self.bn1(self.conv1(x))))))


class Encoder(nn.Module):
    """A transformer encoder layer (3-D Linears, attention, GELU) and a head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, activation="gelu")
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.layer(x))


class TanhMLP(nn.Module):
    """Linear → ReLU (3 units dead) → Linear → Tanh (2 units saturated)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
        with torch.no_grad():
            self.net[0].bias[:3] = -50.0
            self.net[2].bias[:2] = 4.0

    def forward(self, x):
        return self.net(x)


class Softmaxes(nn.Module):
    """A peaked softmax over features (the last axis) of normalized rows (F.normalize's clamp is a
    guard, read by neither), and a softmax over channels (axis 1)."""

    def __init__(self):
        super().__init__()
        self.fc, self.conv = nn.Linear(8, 8), nn.Conv1d(6, 4, 1)

    def forward(self, x):
        p = torch.softmax(40.0 * F.normalize(self.fc(x), dim=-1), dim=-1)
        return torch.softmax(self.conv(p), dim=1)


class Clamps(nn.Module):
    """Every spelling of a clamp: ReLU6 and Hardtanh modules, and clamp, hardtanh and relu6 calls
    (Clips whose bounds the TorchScript exporter gives as Constant nodes)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU6(), nn.Linear(16, 16), nn.Hardtanh(-2.0, 2.0))
        self.a, self.b, self.c = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        h = self.net(x * 4)
        h = torch.clamp(self.a(h) * 4, 0.0, 6.0) + F.hardtanh(self.b(h) * 2) + F.relu6(self.c(h) * 3)
        return torch.clamp(h, -2.0, 2.0)


MODELS = {"acts": (Acts, (40, 8)), "res": (Res, (6, 3, 8, 8)), "encoder": (Encoder, (6, 5, 16)),
          "tanh-mlp": (TanhMLP, (64, 12)), "softmax": (Softmaxes, (8, 6, 8)), "clamps": (Clamps, (32, 8))}


def record_both(tmp_path, build, shape, dynamo: bool, opset: int | None = None):
    torch.manual_seed(0)
    model = build().eval()
    probe = torch.randn(*shape)
    with Monitor(model, probe, tmp_path / "torch.parquet") as mon:
        mon.probe_reading(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (probe[:2],), tmp_path / "m.onnx", input_names=["x"], dynamo=True,
                              dynamic_shapes=({0: "batch"},), verbose=False, opset_version=opset)
        else:
            torch.onnx.export(model, (probe[:2],), tmp_path / "m.onnx", input_names=["x"], dynamo=False,
                              dynamic_axes={"x": {0: "batch"}})
    np.save(tmp_path / "probe.npy", probe.numpy())
    record_onnx([tmp_path / "m.onnx"], tmp_path / "probe.npy", tmp_path / "onnx.parquet", chunk=4, progress=False)
    return [tmp_path / "torch.parquet", tmp_path / "onnx.parquet"]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("model", MODELS)
def test_every_onnx_layer_is_the_pytorch_layer_it_aligns_with(tmp_path, model, dynamo, cli):
    paths = record_both(tmp_path, *MODELS[model], dynamo)
    a = align(metrics(paths)).filter(pl.col("stream") == "activation")
    keys = {run: dict(zip(g["layer"], g["aligned"])) for (run,), g in a.group_by(["run"])}
    rows = {run: {keys[run][r["layer"]]: r for r in actrace.read_table(p).to_pylist() if r["layer"] in keys[run]}
            for run, p in zip(("torch", "onnx"), paths)}  # derived readings (per head) are the analyzer's signals
    onnx_only = set(rows["onnx"]) - set(rows["torch"])
    assert not onnx_only, f"ONNX readings with no PyTorch layer: {onnx_only}"
    for key, b in rows["onnx"].items():
        t = rows["torch"][key]
        assert (t["kind"], t["units"], t["count"]) == (b["kind"], b["units"], b["count"]), key
        assert t["unit_zero"] == b["unit_zero"], key
        for col in ("unit_sum", "unit_sumsq", "unit_min", "unit_max", "unit_min_dev"):
            np.testing.assert_allclose(b[col], t[col], rtol=1e-4, atol=1e-5, err_msg=f"{key} {col}")
    m = a.sort("aligned")
    per_run = {run: g.filter(pl.col("aligned").is_in(list(rows["onnx"]))).sort("aligned").select(
        "aligned", "dead_fraction", "saturation_value", "saturation_unit").rows() for (run,), g in m.group_by(["run"])}
    assert per_run["torch"] == per_run["onnx"]
    summary = cli("summary", *paths, "--baseline", "torch")
    assert summary.returncode == 0 and "largest differences" not in summary.stdout, summary.stdout


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_every_clamp_has_one_name_kind_and_bounds_in_both(tmp_path, dynamo):
    """One rule (`schema.clamp_kind`) for both adapters: [0, 6] a relu6 (saturating above only),
    other bounds a clip with them, whether a module, a function or an ONNX Clip (whose bounds are
    Constant nodes from TorchScript, initializers from dynamo)."""
    paths = record_both(tmp_path, *MODELS["clamps"], dynamo)
    got = [{r["layer"]: (r["kind"], r["bound_lo"], r["bound_hi"]) for r in actrace.read_table(p).to_pylist()
            if r["kind"] in ("relu6", "clip", "hard_tanh")} for p in paths]
    assert got[0] == {"net.1": ("relu6", 0, 6), "net.3": ("clip", -2, 2), "relu6": ("relu6", 0, 6),
                      "clip": ("clip", -1, 1), "relu6#2": ("relu6", 0, 6), "clip#2": ("clip", -2, 2)}
    assert got[1] == got[0]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_names_are_the_module_paths(tmp_path, dynamo):
    paths = record_both(tmp_path, *MODELS["encoder"], dynamo)
    names = [r["layer"] for r in actrace.read_table(paths[1]).to_pylist()]
    heads = [f"layer.self_attn.{k}" for k in ("attention_logit", "attention_entropy", "attention_sink")]
    assert names == [*heads, "layer.self_attn", "layer.norm1", "layer.linear1", "layer.gelu", "layer.linear2",
                     "layer.norm2", "head"]  # the attention's scores come before its output projection


def test_dead_and_saturated_units_read_the_same_in_both(tmp_path):
    paths = record_both(tmp_path, *MODELS["tanh-mlp"], False)
    by_run = [metrics(p).filter(pl.col("stream") == "activation").select("layer", "dead_fraction", "saturation_value")
              .sort("layer").rows() for p in paths]
    assert by_run[0] == by_run[1]
    assert ("net.1", 3 / 32, None) in by_run[0] and dict((r[0], r[2]) for r in by_run[0])["net.3"] > 0


@pytest.mark.parametrize("opset, shape, axis, unit_axis", [(17, [5, 3, 4], 1, 1), (17, [5, 3, 4], None, 2),
                                                         (11, [5, 3], None, 1), (11, [5, 3, 4], None, None)])
def test_a_softmax_node_has_its_units_on_the_axis_it_normalizes(tmp_path, opset, shape, axis, unit_axis):
    """From opset 13 `axis` (default -1); before, the axes from `axis` (default 1) on, flattened."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Softmax", ["x"], ["y"], name="/sm/Softmax", **({} if axis is None else {"axis": axis}))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape[1:]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", *shape[1:]])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), tmp_path / "m.onnx")
    np.save(tmp_path / "p.npy", np.random.default_rng(0).normal(size=shape).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an axis not followed is said; here it is the point
        record_onnx([tmp_path / "m.onnx"], tmp_path / "p.npy", tmp_path / "t.parquet", progress=False)
    assert actrace.read_table(tmp_path / "t.parquet").to_pylist()[0]["unit_axis"] == unit_axis


@pytest.mark.parametrize("lo, hi, read", [(0.0, None, ("relu", None)), (1e-12, None, None), (-2.0, 2.0, ("clip", 2.0))])
def test_a_one_sided_clip_is_a_relu_at_zero_and_else_a_guard(tmp_path, lo, hi, read):
    import onnx
    from onnx import TensorProto, helper

    bounds = [helper.make_tensor(n, TensorProto.FLOAT, [], [v]) for n, v in (("lo", lo), ("hi", hi)) if v is not None]
    nodes = [helper.make_node("Clip", ["x", "lo", "hi" if hi is not None else ""], ["c"], name="/act/Clip"),
             helper.make_node("Tanh", ["c"], ["y"], name="/t/Tanh")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], initializer=bounds)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    np.save(tmp_path / "p.npy", np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32))
    record_onnx([tmp_path / "m.onnx"], tmp_path / "p.npy", tmp_path / "t.parquet", progress=False)
    got = [(r["kind"], r["bound_hi"]) for r in actrace.read_table(tmp_path / "t.parquet").to_pylist()]
    assert got == ([] if read is None else [read]) + [("tanh", 1.0)]


def test_the_channel_axis_is_followed_through_an_upsample(tmp_path):
    paths = record_both(tmp_path, *MODELS["res"], False)
    relu2 = metrics(paths[1]).filter(pl.col("layer") == "relu2")
    assert relu2["dead_fraction"][0] == 3 / 8


def test_an_axis_that_cannot_be_followed_is_one_unit_and_said_once(tmp_path):
    """A ReLU after a Flatten of NCHW channels with spatial dims: which axis holds the units?"""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="/conv/Conv"),
         helper.make_node("Flatten", ["c"], ["f"], name="/flat/Flatten", axis=1),
         helper.make_node("Relu", ["f"], ["y"], name="/act/Relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 48])],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, [3, 2, 1, 1], [0.5] * 6)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    np.save(tmp_path / "p.npy", np.random.default_rng(0).normal(size=(8, 2, 4, 4)).astype(np.float32))
    with pytest.warns(UserWarning, match=r"cannot be followed through the graph.*: act$"):
        record_onnx([tmp_path / "m.onnx"], tmp_path / "p.npy", tmp_path / "t.parquet", progress=False)
    rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "t.parquet").to_pylist()}
    assert (rows["conv"]["unit_axis"], rows["conv"]["units"]) == (1, 3)
    assert (rows["act"]["unit_axis"], rows["act"]["units"]) == (None, 1)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_hugging_face_bert_and_its_export_agree_by_name(tmp_path, dynamo):
    """Third-party model code: embeddings, HF's GELUActivation, attention Linears, LayerNorms."""
    from transformers import BertConfig, BertModel

    class LastHidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64,
                                             max_position_embeddings=16, add_pooling_layer=False))

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state

    torch.manual_seed(0)
    model, ids = LastHidden().eval(), torch.randint(0, 100, (8, 10))
    with Monitor(model, ids, tmp_path / "torch.parquet") as mon:
        mon.probe_reading(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(dynamo=True, dynamic_shapes=({0: "batch"},), verbose=False) if dynamo else \
            dict(dynamo=False, dynamic_axes={"ids": {0: "batch"}})
        torch.onnx.export(model, (ids[:2],), tmp_path / "m.onnx", input_names=["ids"], **kw)
    np.save(tmp_path / "probe.npy", ids.numpy())
    record_onnx([tmp_path / "m.onnx"], tmp_path / "probe.npy", tmp_path / "onnx.parquet", progress=False)
    torch_rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "torch.parquet").to_pylist()}
    onnx_rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "onnx.parquet").to_pylist()}
    assert set(onnx_rows) <= set(torch_rows), set(onnx_rows) - set(torch_rows)
    assert {"bert.embeddings.word_embeddings", "bert.encoder.layer.1.intermediate.intermediate_act_fn",
            "bert.encoder.layer.1.attention.self.value", "bert.encoder.layer.1.output.LayerNorm"} <= set(onnx_rows)
    for name, b in onnx_rows.items():
        t = torch_rows[name]
        assert (t["kind"], t["units"], t["count"]) == (b["kind"], b["units"], b["count"]), name
        for col in ("unit_sum", "unit_sumsq", "unit_min", "unit_max"):
            np.testing.assert_allclose(b[col], t[col], rtol=1e-4, atol=1e-4, err_msg=f"{name} {col}")


@pytest.mark.parametrize("dynamo,opset", [(False, None), (True, None), (True, 23)],
                         ids=["torchscript", "dynamo", "dynamo-attention-op"])
def test_an_exported_attention_reads_the_same_heads_as_pytorch(tmp_path, dynamo, opset):
    """The encoder's attention: PyTorch recomputes its scores from nn.MultiheadAttention's
    projections, ONNX Runtime gives the export's Softmax input, or at opset 23 its Attention op's
    scores (exposed, then masked as the op says); all read each head's largest logits, entropy and
    first-key mass under the same names, and agree (spec §Derived readings)."""
    import onnx

    paths = record_both(tmp_path, *MODELS["encoder"], dynamo, opset)
    ops = {n.op_type for n in onnx.load(tmp_path / "m.onnx").graph.node}
    assert ("Attention" in ops) == (opset == 23) and ("Softmax" in ops) == (opset != 23)
    derived = {run: {r["layer"]: r for r in actrace.read_table(p).to_pylist() if r["kind"].startswith("attention_")}
               for run, p in zip(("torch", "onnx"), paths)}
    names = {f"layer.self_attn.{k}" for k in ("attention_logit", "attention_entropy", "attention_sink")}
    assert set(derived["torch"]) == set(derived["onnx"]) == names
    for name in names:
        t, o = derived["torch"][name], derived["onnx"][name]
        assert (t["units"], t["count"], t["unit_count"]) == (o["units"], o["count"], o["unit_count"]) == (
            2, t["count"], t["unit_count"]), name
        for col in ("unit_sum", "unit_min", "unit_max"):
            np.testing.assert_allclose(o[col], t[col], rtol=1e-4, atol=1e-5, err_msg=f"{name} {col}")


class SdpaAttention(nn.Module):
    """Queries, keys and values of 4 heads into SDPA: causal, or under a fixed boolean mask (a buffer)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(16, 16) for _ in range(4))
        self.causal = causal
        self.register_buffer("allowed", torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.3)
        self.allowed[:, 0] = True  # every query some key

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (m(x).view(b, n, 4, 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, attn_mask=None if self.causal else self.allowed)
        return self.out(y.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bool-mask"])
def test_an_attention_op_reads_its_mask_and_causal_rule_as_pytorch_reads_sdpa(tmp_path, causal):
    """At opset 23 SDPA exports as one Attention op: its scores, exposed, then masked as the op says
    (causal, or its boolean mask input), read each head as PyTorch reads the SDPA call."""
    paths = record_both(tmp_path, lambda: nn.Sequential(SdpaAttention(causal)), (6, 5, 16), True, 23)
    derived = {run: {r["layer"]: r for r in actrace.read_table(p).to_pylist() if r["kind"].startswith("attention_")}
               for run, p in zip(("torch", "onnx"), paths)}
    assert set(derived["torch"]) == set(derived["onnx"]) == {f"0.{k}" for k in ATTENTION_KINDS}
    for name, t in derived["torch"].items():
        o = derived["onnx"][name]
        assert (t["units"], t["count"]) == (o["units"], o["count"]) == (4, t["count"]), name
        for col in ("unit_sum", "unit_min", "unit_max"):
            np.testing.assert_allclose(o[col], t[col], rtol=1e-4, atol=1e-5, err_msg=f"{name} {col}")
    first = derived["torch"]["0.attention_sink"]
    assert (np.asarray(first["unit_max"]) == 1.0).all() == causal  # the first query attends key 0 alone


def test_an_attention_ops_additive_mask_leaves_keys_out_by_its_own_dtype():
    """A float16 mask of −65504 (its dtype's lowest) leaves the key out, as a float32 one of
    float32's lowest does: the scores are float32, but the mask is judged in its own dtype."""
    from onnx import helper

    from actrace.adapters.onnx.attention_op import AttentionOp
    from actrace.reduce.derived import attention

    op = AttentionOp(helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"]))
    qk = np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)
    for dtype in (np.float16, np.float32):
        mask = np.zeros((3, 4), dtype)
        mask[:, 0] = np.finfo(dtype).min  # key 0 left out for every query
        got = attention(op.scores(qk, mask))
        want = attention(qk[..., 1:])
        for kind in ATTENTION_KINDS:
            np.testing.assert_allclose(got[kind], want[kind], rtol=1e-6, err_msg=f"{dtype} {kind}")
