"""Recurrent layers (spec §Recurrent layers) on models whose truth is known: gates and hidden
states equal an unrolled cell loop for every layout; a forget gate biased +6 reads pinned open and
nothing else does; scaled-up recurrent weights saturate the state, a healthy LSTM does not;
padding is never read; the ONNX export agrees gate by gate."""
from __future__ import annotations

import warnings

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import actrace
from actrace.format import metadata
from actrace.adapters.torch.trace import ForwardTrace
from actrace.adapters.onnx import record_onnx
from actrace.adapters.torch import Monitor
from actrace.analyzer.findings import findings
from actrace.analyzer.metrics import metrics


def _gates(cell, x, h, w_ih, w_hh, b_ih, b_hh):
    """One step's gates by the textbook formulas (PyTorch's docs for LSTM, GRU)."""
    gi, gh = x @ w_ih.T + b_ih, h @ w_hh.T + b_hh
    if cell == "lstm":
        i, f, g, o = (gi + gh).chunk(4, -1)
        return {"input_gate": i.sigmoid(), "forget_gate": f.sigmoid(), "cell_gate": g.tanh(), "output_gate": o.sigmoid()}
    if cell == "gru":
        (ri, zi, ni), (rh, zh, nh) = gi.chunk(3, -1), gh.chunk(3, -1)
        r = (ri + rh).sigmoid()
        return {"reset_gate": r, "update_gate": (zi + zh).sigmoid(), "new_gate": (ni + r * nh).tanh()}
    return {}


def unrolled(module, seqs: list[torch.Tensor], h0: torch.Tensor, c0: torch.Tensor | None) -> dict:
    """Per reading name, per sequence, [steps, units]: a step-by-step loop over each sequence on
    its own, the state carried by nn.LSTMCell / nn.GRUCell / nn.RNNCell (by hand with a projection)."""
    cell = {"LSTM": "lstm", "GRU": "gru"}.get(module.mode, "rnn")
    dirs, out = 1 + module.bidirectional, {}
    inputs = seqs
    for layer in range(module.num_layers):
        outputs = [[] for _ in seqs]
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w = [getattr(module, f"{p}{sfx}") for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            base = f"l{layer}" + ("_reverse" if d else "")
            proj = getattr(module, f"weight_hr{sfx}", None)
            step = None
            if proj is None:
                size = w[1].shape[1]
                step = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}.get(cell, nn.RNNCell)(
                    w[0].shape[1], size, **({"nonlinearity": module.nonlinearity} if cell == "rnn" else {}))
                for p, v in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), w):
                    setattr(step, p, nn.Parameter(v.detach().clone()))
            for b, seq in enumerate(inputs):
                h = h0[layer * dirs + d, b]
                c = c0[layer * dirs + d, b] if c0 is not None else None
                steps = range(len(seq) - 1, -1, -1) if d else range(len(seq))
                per_t = {}
                for t in steps:
                    for g, v in _gates(cell, seq[t], h, *w).items():
                        per_t.setdefault(f"{base}.{g}", {})[t] = v
                    if proj is not None:
                        gates = _gates(cell, seq[t], h, *w)
                        c = gates["forget_gate"] * c + gates["input_gate"] * gates["cell_gate"]
                        h = (gates["output_gate"] * c.tanh()) @ proj.T
                    elif cell == "lstm":
                        h, c = (v[0] for v in step(seq[t][None], (h[None], c[None])))
                    else:
                        h = step(seq[t][None], h[None])[0]
                    per_t.setdefault(base, {})[t] = h
                for name, by_t in per_t.items():
                    out.setdefault(name, []).append(torch.stack([by_t[t] for t in range(len(seq))]))
                out.setdefault(f"{base}.h_n", []).append(h[None])
                if c is not None:
                    out.setdefault(f"{base}.c_n", []).append(c[None])
                outputs[b].append(out[base][-1])
        inputs = [torch.cat(o, -1) for o in outputs]
    return out


def traced(model, *args) -> dict[str, tuple[str, torch.Tensor]]:
    """name → (kind, tensor) of every reading of one probe forward."""
    got = {}

    def sink(o):
        got[o.name] = (o.kind, o.axis, o.tensor.clone())
    with torch.no_grad(), ForwardTrace(model, sink):
        model(*args)
    return got


CASES = {  # module, packed, batch_first input, unbatched, initial state given
    "lstm-2layer-bidirectional-batch-first-hx": (lambda: nn.LSTM(5, 4, 2, batch_first=True, bidirectional=True),
                                                 False, True, False),
    "lstm-projected-packed": (lambda: nn.LSTM(5, 4, 2, proj_size=3), True, False, False),
    "gru-2layer-bidirectional-packed": (lambda: nn.GRU(5, 4, 2, bidirectional=True), True, False, True),
    "rnn-tanh-bidirectional-unbatched": (lambda: nn.RNN(5, 4, bidirectional=True), False, False, False),
    "rnn-relu-2layer": (lambda: nn.RNN(5, 4, 2, nonlinearity="relu"), False, False, True),
}


class Wrap(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, hx=None):
        return self.rnn(x, hx)[0]


@pytest.mark.parametrize("case", CASES)
def test_gates_and_states_equal_an_unrolled_cell_loop(case):
    build, packed, unbatched, with_hx = CASES[case]
    torch.manual_seed(0)
    model = Wrap(build()).eval()
    rnn, lengths = model.rnn, [6, 3, 5, 1]
    dirs, out_size = 1 + rnn.bidirectional, rnn.proj_size or rnn.hidden_size
    batch = 1 if unbatched else len(lengths)
    seqs = [torch.randn(n if packed else 6, 5) for n in lengths[:batch]]
    h0 = torch.randn(rnn.num_layers * dirs, batch, out_size) if with_hx else torch.zeros(
        rnn.num_layers * dirs, batch, out_size)
    c0 = torch.randn(rnn.num_layers * dirs, batch, rnn.hidden_size) if with_hx else torch.zeros(
        rnn.num_layers * dirs, batch, rnn.hidden_size)
    lstm = rnn.mode == "LSTM"
    hx = ((h0, c0) if lstm else h0) if with_hx else None
    if packed:
        padded = nn.utils.rnn.pad_sequence(seqs)
        x = pack_padded_sequence(padded, torch.tensor(lengths), enforce_sorted=False)
        got = traced(model, x, hx)
    elif unbatched:
        got = traced(model, seqs[0], None if hx is None else tuple(t[:, 0] for t in hx) if lstm else hx[:, 0])
    else:
        got = traced(model, torch.stack(seqs) if rnn.batch_first else torch.stack(seqs, 1), hx)
    with torch.no_grad():
        want = unrolled(rnn, seqs, h0, c0 if lstm else None)
    assert set(got) == {f"rnn.{n}" for n in want}
    for name, per_seq in want.items():
        kind, axis, tensor = got[f"rnn.{name}"]
        if packed and "_n" not in name:  # rows in packed order: time-major, longest sequence first
            order = np.argsort(lengths, kind="stable")[::-1]
            ref = torch.stack([per_seq[b][t] for t in range(max(lengths)) for b in order if lengths[b] > t])
        else:
            ref = torch.stack(per_seq) if not name.endswith("_n") else torch.cat(per_seq)
        if unbatched and name.endswith("_n"):
            ref = ref[0]
        assert tensor.shape == ref.shape, name
        torch.testing.assert_close(tensor, ref, atol=2e-6, rtol=1e-5, msg=name)
        assert axis == tensor.ndim - 1, name
        state = "linear" if rnn.proj_size else "relu" if rnn.mode == "RNN_RELU" else "tanh"
        assert kind == ("other" if name.endswith("c_n") else state if "gate" not in name else
                        "tanh" if name.endswith(("cell_gate", "new_gate")) else "sigmoid"), name


class Tagger(nn.Module):
    """Embedding (small init, as language models have it) → LSTM → Linear."""

    def __init__(self, forget_bias: float = 0.0):
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(50, 16), nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 5)
        with torch.no_grad():
            self.emb.weight.normal_(0, 0.1)
            if forget_bias:
                # the forget gate's pre-activation is 6 + W x + U h, with small inputs: sigmoid ≥ 0.99 needs ≥ 4.6
                self.lstm.bias_ih_l0[32:64] = forget_bias
                self.lstm.bias_hh_l0[32:64] = 0.0

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


def train(model, path, steps=3):
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (16, 12))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, ids, path, probe_every=1) as mon:
        for step in range(steps):
            loss = model(ids).square().mean()
            loss.backward()
            mon.step(step)
            opt.step()
            opt.zero_grad()
    return path


def test_a_forget_gate_biased_six_reads_pinned_open_and_nothing_else_does(tmp_path, cli):
    torch.manual_seed(0)
    path = train(Tagger(forget_bias=6.0), tmp_path / "forget.parquet")
    assert cli("validate", path).returncode == 0
    m = metrics(path).filter(pl.col("stream") == "activation")
    last = {r["layer"]: r for r in m.filter(pl.col("step") == 2).to_dicts()}
    assert last["lstm.l0.forget_gate"]["saturation_value"] >= 0.99
    assert last["lstm.l0.forget_gate"]["saturation_unit"] >= 0.99
    for other in ("lstm.l0.input_gate", "lstm.l0.cell_gate", "lstm.l0.output_gate", "lstm.l0"):
        assert last[other]["saturation_value"] < 0.05 and last[other]["saturation_unit"] == 0, other
    found = [f for f in findings(m) if f.layer.startswith("lstm")]
    assert [(f.rule, f.layer) for f in found] == [("saturation_high", "lstm.l0.forget_gate"),
                                                  ("units_pinned", "lstm.l0.forget_gate")]
    assert found[1].evidence.startswith("forget gate of layer 0 pinned open (the cell never forgets): 100% of "
                                        "units ≥ 0.99")
    assert "forget gate's at 1" in found[1].advice
    grads = actrace.read_table(path).to_pylist()
    assert {(r["layer"], r["param"]) for r in grads if r["stream"] == "param_grad" and r["layer"].startswith("lstm")} \
        == {("lstm.l0", p) for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}  # beside the layer's readings


def test_a_healthy_lstm_has_no_recurrent_finding(tmp_path):
    torch.manual_seed(0)
    path = train(Tagger(), tmp_path / "healthy.parquet")
    m = metrics(path)
    assert not [f for f in findings(m) if f.layer.startswith("lstm")]
    kinds = dict(m.filter(pl.col("stream") == "activation").select("layer", "kind").unique().rows())
    assert kinds == {"emb": "embedding", "head": "linear", "lstm.l0": "tanh", "lstm.l0.h_n": "tanh",
                     "lstm.l0.c_n": "other", "lstm.l0.input_gate": "sigmoid", "lstm.l0.forget_gate": "sigmoid",
                     "lstm.l0.cell_gate": "tanh", "lstm.l0.output_gate": "sigmoid"}


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_scaled_up_recurrent_weights_saturate_the_hidden_state(tmp_path, scale):
    torch.manual_seed(0)
    model = Wrap(nn.RNN(16, 32, batch_first=True))
    with torch.no_grad():
        model.rnn.weight_hh_l0.mul_(scale)
    with Monitor(model, torch.randn(32, 20, 16), tmp_path / "r.parquet") as mon:
        mon.probe_reading(0)
    m = metrics(tmp_path / "r.parquet")
    sat = m.filter(pl.col("layer") == "rnn.l0")["saturation_value"][0]
    found = [f for f in findings(m) if f.rule == "saturation_high"]
    if scale > 1:
        # the final state, the sequence's last step, is judged with its sequence: one finding
        assert sat > 0.3 and [f.layer for f in found] == ["rnn.l0"]
        assert found[0].evidence.startswith("hidden state of layer 0 at its bounds: ")
    else:
        assert sat < 0.01 and not found


def test_padding_is_never_read(tmp_path):
    torch.manual_seed(0)
    model = Wrap(nn.GRU(3, 4))
    padded = torch.randn(6, 3, 3)
    padded[4:, 1], padded[2:, 2] = 1e6, 1e6  # padding: huge, so any value read from it would show
    x = pack_padded_sequence(padded, torch.tensor([6, 4, 2]), enforce_sorted=False)
    with Monitor(model, (x,), tmp_path / "p.parquet") as mon:
        mon.probe_reading(0)
    rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "p.parquet").to_pylist()}
    for name in ("rnn.l0", "rnn.l0.update_gate", "rnn.l0.reset_gate", "rnn.l0.new_gate"):
        assert rows[name]["count"] == 12 * 4, name
    assert max(rows["rnn.l0.new_gate"]["unit_max"]) < 1  # tanh of a padded 1e6 would be exactly 1


def test_selection_computes_only_what_is_chosen(tmp_path):
    model = Tagger(forget_bias=6.0)
    ids = torch.randint(0, 50, (4, 6))
    with Monitor(model, ids, tmp_path / "s.parquet", include="lstm.*forget*") as mon:
        mon.probe_reading(0)
    assert [r["layer"] for r in actrace.read_table(tmp_path / "s.parquet").to_pylist()] == ["lstm.l0.forget_gate"]


def test_activation_gradients_read_the_module_outputs(tmp_path):
    model = Tagger()
    ids = torch.randint(0, 50, (4, 6))
    with Monitor(model, ids, tmp_path / "g.parquet", activation_grads=True) as mon:
        model(ids).sum().backward()
        mon.step(0)
    grads = {r["layer"] for r in actrace.read_table(tmp_path / "g.parquet").to_pylist()
             if r["stream"] == "activation_grad"}
    assert "lstm" in grads and "head" in grads


class Stack(nn.Module):
    """A 2-layer bidirectional batch-first LSTM (forget gate of layer 0 biased +6) → GRU → tanh RNN."""

    def __init__(self, rnn: bool):
        super().__init__()
        self.lstm = nn.LSTM(8, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(12, 5)
        self.rnn = nn.RNN(5, 4) if rnn else None
        with torch.no_grad():
            self.lstm.bias_ih_l0[6:12] = 6.0

    def forward(self, x):
        y = self.gru(self.lstm(x)[0].transpose(0, 1))[0]
        return self.rnn(y)[0] if self.rnn is not None else y


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_pytorch_and_onnx_agree_gate_by_gate(tmp_path, dynamo):
    torch.manual_seed(0)
    model = Stack(rnn=not dynamo).eval()  # the dynamo exporter unrolls nn.RNN into per-step ops
    probe = torch.randn(6, 7, 8)
    with Monitor(model, probe, tmp_path / "torch.parquet") as mon:
        mon.probe_reading(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(dynamic_shapes=({0: "batch"},), verbose=False) if dynamo else dict(dynamic_axes={"x": {0: "batch"}})
        torch.onnx.export(model, (probe[:2],), tmp_path / "m.onnx", input_names=["x"], dynamo=dynamo, **kw)
    np.save(tmp_path / "probe.npy", probe.numpy())
    record_onnx([tmp_path / "m.onnx"], tmp_path / "probe.npy", tmp_path / "onnx.parquet", chunk=4, progress=False)
    t = {r["layer"]: r for r in actrace.read_table(tmp_path / "torch.parquet").to_pylist()}
    o = {r["layer"]: r for r in actrace.read_table(tmp_path / "onnx.parquet").to_pylist()}
    assert set(o) == set(t)
    gates = [n for n in o if n.endswith("_gate")]
    assert len(gates) == 4 * 4 + 3 and "lstm.l1_reverse.output_gate" in gates
    for name, b in o.items():
        a = t[name]
        assert (a["kind"], a["units"], a["count"], a["shape"]) == (b["kind"], b["units"], b["count"], b["shape"]), name
        for col in ("unit_sum", "unit_min", "unit_max", "unit_min_dev"):
            np.testing.assert_allclose(np.array(b[col]) / np.array(b["unit_count"]) if col == "unit_sum" else b[col],
                                       np.array(a[col]) / np.array(a["unit_count"]) if col == "unit_sum" else a[col],
                                       atol=1e-4, err_msg=f"{name} {col}")
        if a["sat_counts"] is not None:  # values within 1e-4 may fall either side of a threshold: one count at most
            assert np.abs(np.subtract(a["sat_counts"], b["sat_counts"])).max() <= 1, name
    judged = [metrics(p).filter(pl.col("layer").str.contains("_gate")).sort("layer").select(
        "layer", "saturation_value", "saturation_unit").rows() for p in (tmp_path / "torch.parquet",
                                                                          tmp_path / "onnx.parquet")]
    assert judged[0] == judged[1]
    assert dict((r[0], r[2]) for r in judged[0])["lstm.l0.forget_gate"] > 0.3


def test_the_report_groups_a_recurrent_layers_readings_and_opens_on_the_pinned_gate(tmp_path, cli):
    from conftest import rendered

    torch.manual_seed(0)
    train(Tagger(), tmp_path / "healthy.parquet")
    torch.manual_seed(0)
    train(Tagger(forget_bias=6.0), tmp_path / "forget-open.parquet")
    res = cli("report", tmp_path / "healthy.parquet", tmp_path / "forget-open.parquet", "-o", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr
    with rendered(tmp_path / "r.html", "recurrent") as (page, errors):
        chosen = page.eval_on_selector("#recurrent select", "s => s.value")
        rows = page.inner_text("#recurrent")
    assert errors == [] and chosen == "forget-open"
    names = ["lstm.l0.input_gate", "lstm.l0.forget_gate", "lstm.l0.cell_gate", "lstm.l0.output_gate", "lstm.l0",
             "lstm.l0.h_n"]  # the cell state is unbounded: no saturation to draw
    assert [n for n in rows.split() if n in names + ["lstm.l0.c_n"]] == names * 2  # forward order, in both panels
    assert "emb" not in rows.split() and "head" not in rows.split()


def test_onnx_recurrent_nodes_chosen_by_op_type_and_an_unusual_node_said_once(tmp_path):
    import onnx
    from onnx import helper

    torch.manual_seed(0)
    model = Stack(rnn=True).eval()
    probe = torch.randn(4, 7, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (probe[:2],), tmp_path / "m.onnx", input_names=["x"], dynamo=False,
                          dynamic_axes={"x": {0: "batch"}})
    np.save(tmp_path / "probe.npy", probe.numpy())
    record_onnx([tmp_path / "m.onnx"], tmp_path / "probe.npy", tmp_path / "lstm.parquet", op_types="LSTM",
                progress=False)
    names = [r["layer"] for r in actrace.read_table(tmp_path / "lstm.parquet").to_pylist()]
    assert len(names) == 2 * 2 * 7 and all(n.startswith("lstm.l") for n in names)
    graph = onnx.load(tmp_path / "m.onnx")
    gru = next(n for n in graph.graph.node if n.op_type == "GRU")
    gru.attribute.append(helper.make_attribute("clip", 50.0))  # clipped pre-activations: not the standard gates
    onnx.save(graph, tmp_path / "clipped.onnx")
    with pytest.warns(UserWarning, match=r"gates of these recurrent nodes are not read.*: gru\.l0 \(clip\)$"):
        record_onnx([tmp_path / "clipped.onnx"], tmp_path / "probe.npy", tmp_path / "c.parquet", progress=False)
    rows = {r["layer"]: r["kind"] for r in actrace.read_table(tmp_path / "c.parquet").to_pylist()}
    assert not [n for n in rows if n.startswith("gru.l0.") and n.endswith("_gate")]
    assert rows["gru.l0"] == rows["gru.l0.h_n"] == "other" and rows["lstm.l0.forget_gate"] == "sigmoid"


def test_the_spec_names_the_gates_as_the_code_does():
    from conftest import SPEC

    from actrace.format.recurrent import GATES

    row = next(line for line in (SPEC / "trace-v1.md").read_text().splitlines() if line.startswith("| each gate"))
    assert all(f"`{gate}`" in row for gates in GATES.values() for gate, _ in gates)


@pytest.mark.parametrize("bias, said", [(8.0, "update gate of layer 0 pinned at 1 (the state is copied, never updated)"),
                                        (-8.0, "update gate of layer 0 pinned at 0 (the state is overwritten every step)")])
def test_a_gru_gate_is_said_as_what_it_does(tmp_path, bias, said):
    torch.manual_seed(0)
    model = Wrap(nn.GRU(4, 8))
    with torch.no_grad():
        model.rnn.bias_ih_l0[8:16] = bias
    with Monitor(model, torch.randn(10, 6, 4) * 0.1, tmp_path / "g.parquet") as mon:
        mon.probe_reading(0)
    (f,) = [f for f in findings(metrics(tmp_path / "g.parquet")) if f.rule == "units_pinned"]
    assert f.layer == "rnn.l0.update_gate" and f.evidence.startswith(said + ": 100% of units")


def test_a_plain_layer_called_l0_is_no_recurrent_state_and_a_second_call_is_named(tmp_path):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.l0 = nn.LSTM(4, 6), nn.Sigmoid()
            with torch.no_grad():
                self.enc.bias_ih_l0[6:12] = 9.0

        def forward(self, x):
            y, state = self.enc(x)
            return self.l0(self.enc(y[..., :4] * 0, state)[0] * 50)

    torch.manual_seed(0)
    with Monitor(Twice(), torch.randn(5, 3, 4) * 0.1, tmp_path / "t.parquet") as mon:
        mon.probe_reading(0)
    said = {(f.rule, f.layer): f.evidence for f in findings(metrics(tmp_path / "t.parquet"))}
    assert said[("saturation_high", "l0")].startswith("9")  # plain wording: no "hidden state of layer 0"
    assert said[("units_pinned", "enc.l0.forget_gate#2")].startswith("forget gate of layer 0, call 2 pinned open")


def test_a_probe_reading_after_the_last_step_closes_cleanly_and_a_bare_layer_is_read(tmp_path):
    model = nn.Linear(3, 2)
    with Monitor(model, torch.randn(4, 3), tmp_path / "c.parquet", probe_every=5) as mon:
        for step in range(6):
            model(torch.randn(4, 3)).sum().backward()
            mon.step(step)
        mon.probe_reading(6)
    rows = actrace.read_table(tmp_path / "c.parquet").to_pylist()
    assert metadata.read(tmp_path / "c.parquet")["status"] == "complete"
    assert {(r["layer"], r["stream"]) for r in rows} == {("linear", "activation"), ("linear", "param_grad"),
                                                         ("linear", "param")}
    assert sorted({r["step"] for r in rows if r["stream"] == "activation"}) == [0, 5, 6]


def _onnx_gru(tmp_path, outputs, reset_after, weights_computed=False):
    """A hand-built ONNX GRU node (bidirectional, sequence_lens) on the transposed input [batch,
    steps, features], and its probe; its weights W, R, B."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    hidden, feats, steps, batch = 5, 3, 6, 4
    w, r, b = (rng.normal(size=s).astype(np.float32) * 0.6 for s in
               ((2, 3 * hidden, feats), (2, 3 * hidden, hidden), (2, 6 * hidden)))
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "W0" if weights_computed else "W"), (r, "R"), (b, "B"))]
    nodes = [helper.make_node("Identity", ["W0"], ["W"])] if weights_computed else []
    nodes += [helper.make_node("Transpose", ["xb"], ["x"], perm=[1, 0, 2]),
              helper.make_node("GRU", ["x", "W", "R", "B", "lens"], outputs, name="/enc/GRU", hidden_size=hidden,
                               direction="bidirectional", linear_before_reset=int(reset_after)),
              helper.make_node("Relu", [next(o for o in outputs if o)], ["out"], name="/post/Relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xb", TensorProto.FLOAT, [None, steps, feats]),
                                          helper.make_tensor_value_info("lens", TensorProto.INT32, [None])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    x = rng.normal(size=(batch, steps, feats)).astype(np.float32)
    lens = np.array([6, 2, 4, 5], np.int32)
    np.savez(tmp_path / "probe.npz", xb=x, lens=lens)
    return w, r, b, x.transpose(1, 0, 2), lens


def test_onnx_gru_gates_follow_linear_before_reset_and_a_node_without_y_is_read(tmp_path):
    """linear_before_reset=0 (ONNX's default): n = tanh(W x + b + R (r ⊙ h) + b'), checked by a step
    loop over each sequence; a node whose Y is not used still gives every reading."""
    w, r, b, x, lens = _onnx_gru(tmp_path, ["", "Yh"], reset_after=False)
    record_onnx([tmp_path / "m.onnx"], tmp_path / "probe.npz", tmp_path / "g.parquet", progress=False)
    rows = {row["layer"]: row for row in actrace.read_table(tmp_path / "g.parquet").to_pylist()}
    assert {"enc.l0.new_gate", "enc.l0_reverse.update_gate", "enc.l0", "enc.l0.h_n", "post"} <= set(rows)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    for d, name in ((0, "enc.l0"), (1, "enc.l0_reverse")):
        (wz, wr, wh), (rz, rr, rh) = np.split(w[d], 3), np.split(r[d], 3)
        (bz, br, bh, cz, cr, ch) = np.split(b[d], 6)
        new = []
        for seq in range(x.shape[1]):
            h = np.zeros(5, np.float32)
            order = range(lens[seq]) if d == 0 else range(lens[seq] - 1, -1, -1)
            for t in order:
                z, rg = sig(wz @ x[t, seq] + bz + rz @ h + cz), sig(wr @ x[t, seq] + br + rr @ h + cr)
                n = np.tanh(wh @ x[t, seq] + bh + rh @ (rg * h) + ch)
                new.append(n)
                h = (1 - z) * n + z * h
        new = np.array(new)
        got = rows[f"{name}.new_gate"]
        assert got["count"] == lens.sum() * 5  # padding never read
        np.testing.assert_allclose(got["unit_max"], new.max(0), atol=1e-5)
        np.testing.assert_allclose(np.array(got["unit_sum"]), new.sum(0), atol=1e-4)


def test_onnx_recurrent_weights_computed_in_the_graph_are_fetched(tmp_path):
    _onnx_gru(tmp_path, ["Y", "Yh"], reset_after=True, weights_computed=True)
    record_onnx([tmp_path / "m.onnx"], tmp_path / "probe.npz", tmp_path / "c.parquet", progress=False)
    names = {row["layer"] for row in actrace.read_table(tmp_path / "c.parquet").to_pylist()}
    assert {"enc.l0.reset_gate", "enc.l0_reverse.new_gate"} <= names


def test_a_one_step_sequence_keeps_its_shapes():
    got = traced(Wrap(nn.LSTM(3, 4, batch_first=True)).eval(), torch.randn(5, 1, 3))
    assert tuple(got["rnn.l0"][2].shape) == (5, 1, 4) and tuple(got["rnn.l0.forget_gate"][2].shape) == (5, 1, 4)
    assert tuple(got["rnn.l0.h_n"][2].shape) == (5, 4) and tuple(got["rnn.l0.c_n"][2].shape) == (5, 4)
