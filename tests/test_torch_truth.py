"""PyTorch adapter on the models people write: functional activations, channels-last tensors,
third-party activation modules, wrapped and compiled models, mixed precision, any probe. Every
expected value is known by construction (units killed by a far-negative bias, outputs pinned)."""
from __future__ import annotations

import warnings
from unittest import mock

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actrace
from actrace.adapters.torch import Monitor
from actrace.analyzer.findings import findings
from actrace.analyzer.metrics import metrics
from actrace.format import bins
from conftest import HUNG


# every case runs on the CPU; the ones marked with DEVICES run on CUDA too where a GPU is present
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def rows(path, stream="activation"):
    return {r["layer"]: r for r in actrace.read_table(path).to_pylist() if r["stream"] == stream}


def dead(path, layer):
    m = metrics(path).filter((pl.col("stream") == "activation") & (pl.col("layer") == layer))
    return m["dead_fraction"].to_list()


def record(model, probe, path, steps=(0,), **kw):
    with Monitor(model, probe, path, **{"grad_every": None, **kw}) as mon:  # probe readings only
        for step in steps:
            mon.probe_reading(step)
    return path


def kill(bias: torch.Tensor, n: int) -> None:
    with torch.no_grad():
        bias[:n] = -1e4


class FunctionalFFN(nn.Module):
    """`F.relu(x @ w1 + b1) @ w2` and `torch.tanh`, `x.relu()`, `relu_`: no activation module at all."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(16, 40) / 4), nn.Parameter(torch.zeros(40))
        self.w2 = nn.Parameter(torch.randn(40, 12) / 6)
        self.b3 = nn.Parameter(torch.full((12,), 8.0))

    def forward(self, x):
        h = F.relu(x @ self.w1 + self.b1)
        g = torch.tanh(h @ self.w2 * 0.1 + self.b3)
        return g.relu() + (x[:, :12] * 1).relu_()


def test_functional_calls_are_read_with_their_truth(tmp_path):
    torch.manual_seed(0)
    model = FunctionalFFN()
    kill(model.b1, 10)
    path = record(nn.Sequential(model), torch.randn(64, 16), tmp_path / "f.parquet")
    got = rows(path)
    assert [n for n in got if n.startswith("0.")] == ["0.relu", "0.tanh", "0.relu#2", "0.relu#3"]
    assert got["0.relu"]["kind"] == "relu" and got["0.relu"]["units"] == 40
    assert dead(path, "0.relu") == [10 / 40]
    m = metrics(path).filter(pl.col("layer") == "0.tanh")
    assert got["0.tanh"]["kind"] == "tanh" and m["saturation_unit"][0] == 1.0  # pinned at +1 by a bias of 8
    assert got["0"]["kind"] == "other"  # the parameterized module itself, read at its output


class SwiGLU(nn.Module):
    """A LLaMA-style MLP: down(F.silu(gate(x)) * up(x))."""

    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("device", DEVICES)
def test_a_swiglu_mlp_reads_its_silu_with_units_on_the_hidden_axis(tmp_path, device):
    torch.manual_seed(0)
    model = nn.Sequential(SwiGLU(), SwiGLU())
    kill(model[1].gate.bias, 8)  # silu(-1e4) is exactly 0 in float32
    path = record(model.to(device), torch.randn(8, 5, 16, device=device), tmp_path / "s.parquet")
    got = rows(path)
    assert got["1.silu"]["kind"] == "silu" and got["1.silu"]["unit_axis"] == 2 and got["1.silu"]["units"] == 32
    assert dead(path, "1.silu") == [8 / 32] and dead(path, "0.silu") == [0.0]


class NewGELUActivation(nn.Module):
    """As Hugging Face writes it: a formula with a tanh inside, which is not a tanh layer."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


class Activation(nn.Module):
    """A wrapper whose name says nothing: it is what it computes."""

    def forward(self, x):
        return F.hardtanh(x, -2.0, 2.0)


def test_activation_modules_of_other_libraries_are_read_once_with_their_kind(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), NewGELUActivation(), nn.Linear(24, 24), Activation())
    kill(model[0].bias, 6)
    with torch.no_grad():
        model[2].bias[:12] = 50.0  # hard-tanh(-2, 2) pinned at 2 for those 12 units
    path = record(model, torch.randn(32, 8), tmp_path / "a.parquet")
    got = rows(path)
    assert list(got) == ["0", "1", "2", "3"]  # no "1.tanh", no "3.hardtanh"
    assert got["1"]["kind"] == "gelu" and dead(path, "1") == [6 / 24]
    assert got["3"]["kind"] == "clip" and (got["3"]["bound_lo"], got["3"]["bound_hi"]) == (-2.0, 2.0)
    assert metrics(path).filter(pl.col("layer") == "3")["saturation_unit"][0] == 0.5


def test_a_two_sided_clamp_is_read_by_its_bounds_and_a_one_sided_guard_is_not_read(tmp_path):
    """clamp(x, 0, 6) is a ReLU6 (as its ONNX export's Clip reads), named by its kind."""
    class Clamped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 10)

        def forward(self, x):
            return torch.clamp(self.fc(x).clamp(min=-1e6), 0.0, 6.0)

    model = Clamped()
    with torch.no_grad():
        model.fc.bias[:5] = 100.0  # pinned at the upper bound 6
    got = rows(record(nn.Sequential(model), torch.randn(16, 4), tmp_path / "c.parquet"))
    assert [n for n in got if n.startswith("0.")] == ["0.fc", "0.relu6"]
    assert got["0.relu6"]["kind"] == "relu6" and (got["0.relu6"]["bound_lo"], got["0.relu6"]["bound_hi"]) == (0, 6)
    assert metrics(tmp_path / "c.parquet").filter(pl.col("layer") == "0.relu6")["saturation_unit"][0] == 0.5


class Written(nn.Module):
    """Activations and projections as people write them: an einsum with a weight, F.softsign,
    torch.special.expit, clamp(min=0) as a ReLU."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12) / 3)
        self.b = nn.Parameter(torch.zeros(12))

    def forward(self, x):
        h = torch.einsum("bti,io->bto", x, self.w) + self.b
        return F.softsign(h) + torch.special.expit(h) + h.clamp(min=0)


def test_activations_as_people_write_them_keep_their_units(tmp_path):
    torch.manual_seed(0)
    model = Written()
    kill(model.b, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no unit axis lost
        got = rows(record(nn.Sequential(model), torch.randn(6, 5, 8), tmp_path / "w.parquet"))
    kinds = {n: (r["kind"], r["unit_axis"], r["units"]) for n, r in got.items() if n != "0"}
    assert kinds == {"0.softsign": ("softsign", 2, 12), "0.sigmoid": ("sigmoid", 2, 12), "0.relu": ("relu", 2, 12)}
    assert dead(tmp_path / "w.parquet", "0.relu") == [3 / 12]


def test_recurrent_outputs_are_named_by_their_module_and_layer_like_their_gradients(tmp_path):
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.head = nn.GRU(4, 6, batch_first=True), nn.Linear(6, 2)

        def forward(self, x):
            return self.head(self.gru(x)[0])

    model = Tagger()
    with Monitor(model, torch.randn(3, 5, 4), tmp_path / "r.parquet") as mon:
        model(torch.randn(3, 5, 4)).sum().backward()
        mon.step(0)
    acts, grads = rows(tmp_path / "r.parquet"), rows(tmp_path / "r.parquet", "param_grad")
    assert {"gru.l0", "gru.l0.h_n", "gru.l0.update_gate", "head"} <= set(acts) and "gru.l0" in grads
    assert (acts["gru.l0"]["unit_axis"], acts["gru.l0"]["units"]) == (2, 6)


def test_a_dict_probe_for_a_model_taking_one_argument_gets_a_hint(tmp_path):
    with pytest.raises(ValueError, match=r"give \(probe,\) to pass it as one argument"):
        Monitor(nn.Sequential(nn.Linear(4, 2)), {"x": torch.randn(3, 4)}, tmp_path / "d.parquet")


class ChannelsLast(nn.Module):
    """conv → ReLU → permute to NHWC → ReLU and Linear over channels: units are last after the permute."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 6)

    def forward(self, x):
        h = F.relu(self.conv(x)).permute(0, 2, 3, 1)
        return self.fc(F.relu(h * 2))


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_tensors_are_read_with_units_where_they_are(tmp_path, device):
    torch.manual_seed(0)
    model = ChannelsLast()
    kill(model.conv.bias, 2)  # a quarter of the channels
    path = record(nn.Sequential(model).to(device), torch.randn(4, 3, 8, 8, device=device), tmp_path / "c.parquet",
                  probe_chunk=3)
    got = rows(path)
    assert (got["0.conv"]["unit_axis"], got["0.conv"]["units"]) == (1, 8)
    assert (got["0.relu"]["unit_axis"], got["0.relu#2"]["unit_axis"], got["0.fc"]["unit_axis"]) == (1, 3, 3)
    assert dead(path, "0.relu") == dead(path, "0.relu#2") == [2 / 8]
    assert got["0.fc"]["units"] == 6


class Conv1dOverTime(nn.Module):
    """A sequence model [B, T, C] that transposes into Conv1d and back, then a Linear."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv1d(12, 12, 3, padding=1), nn.Linear(12, 12)

    def forward(self, x):
        h = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return F.relu(self.fc(h))


def test_a_transposed_conv1d_keeps_its_channels_and_every_chunk_agrees(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Conv1dOverTime(), Conv1dOverTime())
    kill(model[0].conv.bias, 3)
    path = record(model, torch.randn(10, 12, 12), tmp_path / "t.parquet", probe_chunk=4)  # T = C: only construction tells
    got = rows(path)
    assert got["0.conv"]["unit_axis"] == 1 and got["0.relu"]["unit_axis"] == 1 and got["0.fc"]["unit_axis"] == 2
    assert dead(path, "0.relu") == [3 / 12]
    assert got["1.conv"]["unit_axis"] == 1  # no state carried from one layer to the next


def test_a_norm_after_a_scatter_takes_its_units_from_its_gain(tmp_path):
    """An MoE-style block sums its experts' outputs into zeros by index (`index_add_`: the unit axis is
    lost, as in transformers' MixtralExperts), then an RMS norm written as Hugging Face writes it
    scales by its gain, 4 of whose 32 entries are 0 by construction: the norm is read with its 32
    units on the last axis (a per-unit parameter names them) and exactly 4/32 dead."""
    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))
            with torch.no_grad():
                self.weight[:4] = 0

        def forward(self, x):
            h = x.float()
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts, self.norm = nn.Linear(32, 32), RMSNorm()

        def forward(self, x):
            flat = x.reshape(-1, 32)
            out = torch.zeros_like(flat).index_add_(0, torch.arange(len(flat)), self.experts(flat))
            return self.norm(x + out.reshape(x.shape))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = record(Block(), torch.randn(4, 6, 32), tmp_path / "t.parquet")
    norm = rows(path)["norm"]
    assert (norm["kind"], norm["units"], norm["unit_axis"]) == ("norm", 32, 2) and dead(path, "norm") == [4 / 32]


def test_an_axis_that_cannot_be_followed_is_one_unit_and_said_once(tmp_path):
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            q = self.fc(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
            return torch.tanh(q @ q.transpose(-1, -2))  # scores: no unit axis

    with pytest.warns(UserWarning, match=r"cannot be followed.*0\.tanh") as caught:
        path = record(nn.Sequential(Heads()), torch.randn(3, 5, 8), tmp_path / "h.parquet", steps=(0, 1))
    assert sum("cannot be followed" in str(w.message) for w in caught) == 1
    r = rows(path)["0.tanh"]
    assert r["unit_axis"] is None and r["units"] == 1 and r["kind"] == "tanh"
    assert rows(path, "activation")["0.tanh"]["count"] == 3 * 2 * 5 * 5
    assert Monitor(nn.Sequential(Heads()), torch.randn(3, 5, 8), tmp_path / "u.parquet",
                   unit_axes={"*.tanh": 3}).close() is not None


def traced() -> bool:
    """Whether the torch calls made here reach a trace."""
    return bool(torch.overrides._get_current_function_mode_stack())


class MovesUnits(nn.Module):
    """A parameter-free leaf of many ops (no reading of its own) that moves the units to axis 1."""

    def forward(self, x):
        self.seen.append(traced())
        return ((x * 2.0 - x) / 1.0 + 0.0).transpose(1, 2).contiguous()


class Stash(nn.Module):
    """A leaf that keeps a tensor it made besides its output, as a cache does."""

    def forward(self, x):
        self.seen.append(traced())
        self.kept = x.transpose(1, 2) * 1.0
        return x + 0.0


class Leaves(nn.Module):
    def __init__(self, leaf: nn.Module):
        super().__init__()
        self.fc, self.leaf = nn.Linear(6, 6), leaf

    def forward(self, x):
        h = self.leaf(self.fc(x))
        return F.relu(self.leaf.kept if isinstance(self.leaf, Stash) else h)


@pytest.mark.parametrize("leaf", [MovesUnits, Stash])
def test_a_quiet_leaf_runs_untraced_after_the_first_pass_and_reads_as_when_traced(tmp_path, leaf):
    """The trace learns a leaf whose insides take no reading and replays its outputs' axes (its
    ops untraced from the trial's second pass on); a leaf whose made tensor escapes (`Stash`)
    reads otherwise replayed, so the trial drops the plan and everything stays traced."""
    torch.manual_seed(0)
    model = Leaves(leaf())
    model.leaf.seen = []
    kill(model.fc.bias, 2)
    with Monitor(model, torch.randn(4, 5, 6), tmp_path / "q.parquet", grad_every=None) as mon:
        for step in range(3):
            mon.probe_reading(step)
    table = actrace.read_table(tmp_path / "q.parquet").to_pylist()
    relu = [r for r in table if r["layer"] == "relu" and r["stream"] == "activation"]
    assert [(r["unit_axis"], r["units"]) for r in relu] == [(1, 6)] * 3  # T = 5, C = 6: only construction tells
    assert dead(tmp_path / "q.parquet", "relu") == [2 / 6] * 3
    # the trial's two passes (a third, traced, where the second read otherwise), then three readings
    assert model.leaf.seen == ([True, False] + [False] * 3 if leaf is MovesUnits else [True, False, True] + [True] * 3)


class Block(nn.Module):
    """A module of modules and ops that read nothing themselves: units moved to axis 1 by an op
    between two modules (two of six killed), then changed in place; with `attend`, an SDPA of all-zero queries
    whose two heads attend the five positions uniformly (entropy ln 5 over ln 5, sink mass 1/5)."""

    def __init__(self, attend: bool):
        super().__init__()
        self.fc, self.relu, self.out, self.attend = nn.Linear(6, 6), nn.ReLU(), nn.Tanh(), attend
        self.seen = []

    def forward(self, x):
        self.seen.append(traced())
        h = self.relu(self.fc(x).transpose(1, 2)).add_(1.0)  # [B, C = 6, T = 5]; read before the add_
        if self.attend:
            k = x[:, None, :, :4].expand(-1, 2, -1, -1).contiguous()  # CUDA's SDPA kernels want aligned rows
            h = h + 0.0 * F.scaled_dot_product_attention(torch.zeros_like(k), k, k).sum()
        return self.out(h)


class Swap(nn.Module):
    def forward(self, h):
        return h.transpose(1, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (the host syncs are CUDA's)")
@pytest.mark.parametrize("side", [False, True], ids=["model-stream", "side-stream"])
def test_a_probe_reading_on_a_gpu_waits_for_the_device_once(tmp_path, side, monkeypatch):
    """On CUDA the reductions (histograms, attention heads included) run without a host sync, on the
    model's stream or a side stream: a probe reading with a host probe waits for the device once, for
    its readings' transfer; values still the truth."""
    from actrace.reduce import torch as reductions

    monkeypatch.setattr(reductions, "SIDE_STREAM", side)
    torch.manual_seed(0)
    model = nn.Sequential(Block(attend=True), Swap(), Block(attend=True)).cuda()
    kill(model[0].fc.bias, 2)
    def syncs(step: int) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                mon.probe_reading(step)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    with Monitor(model, torch.randn(4, 5, 6), tmp_path / "b.parquet", grad_every=None) as mon:  # a host probe
        syncs(0)  # the first under the debug mode (torch's own once-per-process set-up)
        seen = syncs(1)
    assert len(seen) == 1, seen
    assert dead(tmp_path / "b.parquet", "0.relu") == [2 / 6] * 2
    table = actrace.read_table(tmp_path / "b.parquet").to_pylist()
    assert [r["min"] for r in table if r["layer"] == "2.attention_sink"] == pytest.approx([1 / 5] * 2)
    for r in (r for r in table if r["layer"] == "0.relu"):  # histograms counted on the device, as the columns say
        assert sum(r["hist"]) == r["count"] and r["hist"][bins.ZERO_BIN] == r["zero_count"] >= 2 * 20


@pytest.mark.parametrize("attend", [False, True])
def test_a_module_whose_ops_read_nothing_replays_and_its_modules_read_as_when_traced(tmp_path, attend):
    """After the trial's first pass the model's ops run untraced, with the trace's mode off: its
    modules' hooks still read them on the unit axis the ops moved them to, and the SDPA inside
    still gives its derived readings (seen through `torch.nn.functional`)."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(attend))
    kill(model[0].fc.bias, 2)
    with Monitor(model, torch.randn(4, 5, 6), tmp_path / "b.parquet", grad_every=None) as mon:
        for step in range(3):
            mon.probe_reading(step)
    table = actrace.read_table(tmp_path / "b.parquet").to_pylist()
    for layer in ("0.relu", "0.out"):
        got = [(r["unit_axis"], r["units"]) for r in table if r["layer"] == layer and r["stream"] == "activation"]
        assert got == [(1, 6)] * 3, layer  # T = 5, C = 6: only the transpose tells
    assert dead(tmp_path / "b.parquet", "0.relu") == [2 / 6] * 3
    assert any(isinstance(key, tuple) and key[0] is model for key in mon.forward.trace.plan)  # it replayed
    assert model[0].seen == [True, False] + [False] * 3  # the trial's passes, then three readings
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # put back
    derived = {(r["layer"], r["step"]): r for r in table if r["layer"].startswith("0.attention")}
    assert len(derived) == (9 if attend else 0)
    for (layer, _), r in derived.items():
        want = 1.0 if layer == "0.attention_entropy" else 1 / 5 if layer == "0.attention_sink" else 0.0
        assert r["min"] == pytest.approx(want, abs=1e-6) and r["max"] == pytest.approx(want, abs=1e-6), layer


class Gate(nn.Module):
    """One of two linear layers, chosen by the sign of the input's sum: its calls differ with the data."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = Gate()

    def forward(self, x):
        return self.g(x) + self.g(-x)  # -x: the same call key, the other branch


def test_a_module_whose_calls_differ_with_the_data_is_traced_not_replayed_off_its_plan(tmp_path):
    """The second call of `g` replays the first's plan and meets another module inside: from then
    on `g` is traced, so each linear layer reads its 4 units on the last axis at every reading."""
    path = record(Twice(), torch.randn(3, 4).abs() + 1.0, tmp_path / "g.parquet", steps=range(3))
    got = [(r["layer"], r["unit_axis"], r["units"]) for r in actrace.read_table(path).to_pylist()
           if r["stream"] == "activation"]
    assert got == [("g.a", 1, 4), ("g.b", 1, 4)] * 3


class FastPath(nn.Module):
    """A block that, where no torch-function mode is on, takes a fused path around its modules (as
    `nn.TransformerEncoderLayer` does), and records which path it took."""

    def __init__(self):
        super().__init__()
        self.fc, self.act, self.seen = nn.Linear(6, 6), nn.Tanh(), []

    def forward(self, x):
        self.seen.append(traced())
        return self.act(self.fc(x)) if traced() else torch.tanh(F.linear(x, self.fc.weight, self.fc.bias))


def test_a_module_that_takes_another_path_without_the_mode_replays_with_it_on(tmp_path):
    """Replayed with the mode off, the block takes its fused path and its modules never run: the
    trial sees readings missing, runs once more with the block replayed with the mode on, and
    every reading holds both layers, as traced."""
    torch.manual_seed(0)
    model, probe = nn.Sequential(FastPath()), torch.randn(4, 6)
    with Monitor(model, probe, tmp_path / "p.parquet", grad_every=None) as mon:
        for step in range(3):
            mon.probe_reading(step)
    assert model[0].seen == [True, False, True] + [True] * 3  # the trial's three passes, then three readings
    off = {key[0]: entry[3] for key, entry in mon.forward.trace.plan.items() if isinstance(entry, tuple)}
    assert off[model] is False  # the model (the outermost module replayed) with the mode on from now on
    got = [(r["layer"], r["units"], r["sum"]) for r in actrace.read_table(tmp_path / "p.parquet").to_pylist()
           if r["stream"] == "activation"]
    with torch.no_grad():
        h = model[0].fc(probe)
    want = [("0.fc", 6, pytest.approx(h.sum().item(), abs=1e-5)), ("0.act", 6, pytest.approx(h.tanh().sum().item(), abs=1e-5))]
    assert got == want * 3


def test_a_call_first_met_after_the_trial_replays_with_the_mode_on(tmp_path):
    """Chunks of 4, 4 and 2: the last chunk's call is learned in the first reading, after the trial,
    so nothing checked its replay with the mode off: it replays with the mode on, and the block's
    modules read all 10 examples at every reading."""
    torch.manual_seed(0)
    model = nn.Sequential(FastPath())
    with Monitor(model, torch.randn(10, 6), tmp_path / "c.parquet", grad_every=None, probe_chunk=4) as mon:
        for step in range(3):
            mon.probe_reading(step)
    got = [(r["layer"], r["count"]) for r in actrace.read_table(tmp_path / "c.parquet").to_pylist()
           if r["stream"] == "activation"]
    assert got == [("0.fc", 60), ("0.act", 60)] * 3


class OtherBinding(Block):
    """`Block`, its SDPA called through torch's own binding, not `torch.nn.functional`'s."""

    def forward(self, x):
        with mock.patch.object(F, "scaled_dot_product_attention", torch._C._nn.scaled_dot_product_attention):
            return super().forward(x)


def test_an_sdpa_called_through_another_binding_replays_with_the_mode_on(tmp_path):
    """The SDPA a replay with the mode off would not see: the trial replays the block with the mode
    on, and its attention readings are taken at every reading."""
    torch.manual_seed(0)
    model = nn.Sequential(OtherBinding(attend=True))
    with Monitor(model, torch.randn(4, 5, 6), tmp_path / "o.parquet", grad_every=None) as mon:
        for step in range(3):
            mon.probe_reading(step)
    assert mon.forward.trace.plan  # still replayed
    assert model[0].seen == [True, False, True] + [True] * 3  # the trial's three passes, then three readings
    table = actrace.read_table(tmp_path / "o.parquet").to_pylist()
    assert [r["step"] for r in table if r["layer"] == "0.attention_entropy"] == [0, 1, 2]


def test_two_threads_reading_at_once_leave_sdpa_as_it_was(tmp_path):
    """Two models' probe forwards overlapping in two threads (A on, B on, A off, B off): each
    thread's SDPA calls reach its own trace only, and `F.scaled_dot_product_attention` is torch's
    again once both are off: A's next reading names each attention reading once."""
    import threading

    torch.manual_seed(0)
    a, b = nn.Sequential(Block(attend=True)), nn.Sequential(Block(attend=True))
    first = Monitor(a, torch.randn(4, 5, 6), tmp_path / "a.parquet", grad_every=None)
    second = Monitor(b, torch.randn(4, 5, 6), tmp_path / "b.parquet", grad_every=None)
    names = [r.layer for r in first.forward.read()[0]]
    b_on, a_off = threading.Event(), threading.Event()

    def in_a():
        with first.forward.trace:
            assert b_on.wait(HUNG)
        a_off.set()

    thread = threading.Thread(target=in_a)
    thread.start()
    with second.forward.trace:
        b_on.set()
        assert a_off.wait(HUNG)
    thread.join(HUNG)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert [r.layer for r in first.forward.read()[0]] == names and "0.attention_entropy" in names
    first.close()
    second.close()


@pytest.mark.parametrize("padded", [False, True])
def test_a_torch_transformer_encoder_reads_the_same_replayed_as_traced(tmp_path, padded):
    """An `nn.TransformerEncoder` whose activation is a module (no op reads, so the whole model
    replays) takes the same path replayed as traced: its fast path, which converts padded inputs to
    nested tensors when no mode is on, is not taken in either; readings equal, and the model is in
    evaluation behaviour."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, activation=nn.GELU())
    model = nn.TransformerEncoder(layer, 2).eval()
    mask = torch.zeros(4, 6, dtype=torch.bool)
    if padded:
        mask[:, 4:] = True
    probe = {"src": torch.randn(4, 6, 16), "src_key_padding_mask": mask}
    readings = []
    for replay in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no "two passes differ", no derived reading skipped
            mon = Monitor(model, probe, tmp_path / f"{replay}.parquet", grad_every=None)
        assert mon.mode == "eval"
        if not replay:
            mon.forward.trace.plan = None
        readings.append([(r.layer, r.unit_axis, r.count, r.sum, r.min, r.max) for r in mon.forward.read()[0]])
        mon.close()
    assert readings[0] == readings[1] and len(readings[0]) > 10


class Attention(nn.Module):
    """Scores of normalized queries against themselves, times `sharp`. The queries of the six
    positions are near-orthogonal (one-hot inputs, identity weights), so each query's own key
    wins by about `sharp`: every distribution peaked when it is large, none when it is 0."""

    def __init__(self, sharp: float):
        super().__init__()
        self.q, self.sharp = nn.Linear(8, 8), sharp
        with torch.no_grad():
            self.q.weight.copy_(torch.eye(8))
            self.q.bias.zero_()

    def forward(self, x):
        q = F.normalize(self.q(x), dim=-1)
        return F.softmax(self.sharp * (q @ q.transpose(-1, -2)), dim=-1)


@pytest.mark.parametrize("sharp, peaked", [(50.0, 1.0), (0.0, 0.0)])
def test_a_softmax_is_read_across_the_axis_it_normalizes_and_a_peaked_one_is_saturated(tmp_path, sharp, peaked):
    torch.manual_seed(0)
    x = torch.eye(8)[:6].expand(4, 6, 8) + 0.01 * torch.randn(4, 6, 8)
    path = record(Attention(sharp), x, tmp_path / "a.parquet")
    r = rows(path)["softmax"]
    assert (r["unit_axis"], r["units"], r["shape"]) == (2, 6, [4, 6, 6])  # keys
    m = metrics(path).filter(pl.col("layer") == "softmax")
    assert m["saturation_value"].to_list() == [peaked]  # the share of distributions peaked, not of values
    assert m["saturation_unit"].to_list() == [0.0]  # no key wins for every query
    said = [f for f in findings(metrics(path)) if f.rule == "saturation_high"]
    assert bool(said) == bool(peaked) and all("100% of its distributions peaked" in f.evidence for f in said)


def test_a_softmax_over_channels_has_its_units_on_that_axis_whatever_unit_axes_say(tmp_path):
    path = record(nn.Sequential(nn.Conv1d(3, 4, 1), nn.Softmax(dim=1)), torch.randn(2, 3, 7), tmp_path / "c.parquet",
                  unit_axes={"*": 2})
    assert (rows(path)["1"]["unit_axis"], rows(path)["1"]["units"]) == (1, 4)
    assert (rows(path)["0"]["unit_axis"], rows(path)["0"]["units"]) == (2, 7)  # the override holds elsewhere


class OutputFirst(nn.Module):
    """Blocks defined output-first: definition order is the reverse of the forward."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 1)
        self.middle = nn.Linear(16, 16)
        self.stem = nn.Linear(4, 16)

    def forward(self, x):
        return self.head(torch.relu(self.middle(torch.relu(self.stem(x)))))


def test_depth_is_forward_order_even_when_gradients_come_first(tmp_path):
    torch.manual_seed(0)
    model = OutputFirst()
    with Monitor(model, torch.randn(8, 4), tmp_path / "d.parquet", probe_every=1000) as mon:
        model(torch.randn(8, 4)).sum().backward()
        mon.step(5)  # a gradient reading, no probe reading
    grads = rows(tmp_path / "d.parquet", "param_grad")
    index = {r["layer"]: r["layer_index"] for r in actrace.read_table(tmp_path / "d.parquet").to_pylist()}
    assert set(grads) == {"stem", "middle", "head"}
    assert index["stem"] < index["middle"] < index["head"]


@pytest.mark.parametrize("device", DEVICES + ["as-a-device"])
def test_a_mutated_or_replaced_probe_is_seen_at_the_next_reading(tmp_path, device, monkeypatch):
    """Also a probe on the model's device, whose values are compared there, the answer reaching the
    host with the readings (`as-a-device`: that path taken by a CPU tensor)."""
    from actrace.reduce import torch as reductions

    if device == "as-a-device":
        monkeypatch.setattr(reductions, "on_device", lambda v: isinstance(v, torch.Tensor))
        device = "cpu"
    torch.manual_seed(0)
    model, probe = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).to(device), torch.randn(16, 4, device=device)
    path = tmp_path / "p.parquet"
    with Monitor(model, probe, path) as mon:
        mon.probe_reading(0)
        mon.probe_reading(1)
        probe.normal_()
        mon.probe_reading(2)
        mon.probe = torch.ones(16, 4, device=device)
        mon.probe_reading(3)
    table = actrace.read_table(path).to_pylist()
    fps = {r["step"]: r["probe_fingerprint"] for r in table}
    assert fps[0] == fps[1] and len({fps[1], fps[2], fps[3]}) == 3
    assert fps[2] == actrace.fingerprint(probe.cpu().numpy())
    assert fps[3] == actrace.fingerprint(np.ones((16, 4), np.float32))
    sums = {r["step"]: r["sum"] for r in table if r["layer"] == "0"}  # and each step read the probe it names
    with torch.no_grad():
        assert sums[2] == pytest.approx(float(model[0](probe).double().sum()), rel=1e-5)
        assert sums[3] == pytest.approx(float(model[0](torch.ones(16, 4, device=device)).double().sum()), rel=1e-5)
    assert any(f.rule == "probe_changed" for f in findings(metrics(path)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
def test_any_float_dtype_reads_the_same_truth(tmp_path, dtype, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
    kill(model[0].bias, 8)
    model = model.to(device, dtype)
    path = record(model, torch.randn(64, 8, dtype=dtype, device=device), tmp_path / "b.parquet")
    assert rows(path)["1"]["dtype"] == str(dtype).removeprefix("torch.")
    assert dead(path, "1") == [8 / 32]


class Tagger(nn.Module):
    """Integer ids and a mask as keyword inputs, nested in a dict."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, ids, extra):
        return F.relu(self.fc(self.emb(ids))) * extra["mask"][..., None]


def test_structured_probes_with_integer_ids_are_chunked_and_fingerprinted(tmp_path):
    torch.manual_seed(0)
    probe = {"ids": torch.randint(0, 50, (10, 6)), "extra": {"mask": torch.ones(10, 6)}}
    model = Tagger()
    kill(model.fc.bias, 2)
    whole = rows(record(model, probe, tmp_path / "w.parquet"))
    chunked = rows(record(model, probe, tmp_path / "c.parquet", probe_chunk=3))
    assert whole["relu"]["count"] == chunked["relu"]["count"] == 10 * 6 * 8
    assert whole["relu"]["unit_zero"] == chunked["relu"]["unit_zero"]
    assert dead(tmp_path / "c.parquet", "relu") == [2 / 8]
    assert whole["emb"]["probe_fingerprint"] == chunked["emb"]["probe_fingerprint"]


def test_a_probe_the_model_cannot_take_fails_at_construction_in_one_line(tmp_path):
    with pytest.raises(ValueError) as err:
        Monitor(nn.Sequential(nn.Linear(4, 8)), torch.randn(3, 5), tmp_path / "x.parquet")
    message = str(err.value)
    assert "cannot take the probe" in message and "(3, 5)" in message and "RuntimeError" in message
    assert "\n" not in message and not (tmp_path / "x.parquet").exists()


def test_a_nested_tensor_is_read_over_its_real_values_only():
    from actrace.reduce.torch import reduce_tensor, to_readings
    from actrace.reduce import reduce_array

    a, b = torch.randn(3, 4), torch.randn(5, 4)
    (r,) = to_readings([reduce_tensor(torch.nested.nested_tensor([a, b]), 2, "linear", layer="n")])
    want = reduce_array(torch.cat([a, b]).numpy(), 1, "linear")
    assert r.count == 8 * 4 and r.units == 4
    np.testing.assert_allclose(r.unit_sum, want.unit_sum, rtol=1e-6)
    np.testing.assert_array_equal(r.hist, want.hist)


def test_a_transformer_encoder_with_a_padding_mask_is_read(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2)  # the nested-tensor fast path where hooks allow it
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 4:] = True
    path = record(model, (torch.randn(4, 6, 16), None, mask), tmp_path / "n.parquet")
    got = rows(path)
    assert {"layers.0.relu", "layers.1.relu", "layers.1.linear2"} <= set(got)
    assert got["layers.0.relu"]["units"] == 32


class IgnoresEval(nn.Module):
    """A dropout that stays on in eval mode."""

    def forward(self, x):
        return F.dropout(x, 0.5, training=True)


def test_a_module_that_ignores_eval_is_named_and_readings_are_marked_train(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), IgnoresEval(), nn.Linear(16, 4))
    with pytest.warns(UserWarning, match=r"differ, first at '3'.*ignores eval\(\)"):
        path = record(model, torch.randn(16, 8), tmp_path / "t.parquet")
    assert {r["mode"] for r in rows(path).values()} == {"train"}
    assert any(f.rule == "train_mode" for f in findings(metrics(path)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean = record(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5)), torch.randn(16, 8), tmp_path / "e.parquet")
    assert {r["mode"] for r in rows(clean).values()} == {"eval"}


def test_a_compiled_model_reads_like_the_eager_one(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    kill(model[0].bias, 4)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(compiled, torch.randn(32, 8), tmp_path / "c.parquet", probe_every=2) as mon:
        for step in range(3):
            opt.zero_grad()
            compiled(torch.randn(16, 8)).pow(2).mean().backward()
            mon.step(step)
            opt.step()
    eager = record(model, torch.randn(32, 8), tmp_path / "e.parquet")
    assert set(rows(tmp_path / "c.parquet")) == set(rows(eager)) == {"0", "1", "2"}
    assert set(rows(tmp_path / "c.parquet", "param_grad")) == {"0", "2"}
    assert dead(tmp_path / "c.parquet", "1") == [4 / 16, 4 / 16]


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_under_a_loss_scaler_are_unscaled_and_a_skipped_step_is_no_pathology(tmp_path, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 4, device=device)
    true, tanh_grad = {}, []  # the tanh output's gradient, unscaled, as a hook of the test's own sees it

    def seen(module, inputs, out):
        if out.requires_grad:
            out.register_hook(lambda g: tanh_grad.append(g.double().norm().item() / scaler.get_scale()))
    model[1].register_forward_hook(seen)
    with Monitor(model, x, tmp_path / "a.parquet", probe_every=100, scaler=scaler, activation_grads=True) as mon:
        for step in range(3):
            opt.zero_grad()
            loss = model(x * (float("inf") if step == 2 else 1)).pow(2).mean()  # step 2 overflows
            scaler.scale(loss).backward()
            true[step] = model[0].weight.grad.norm().item() / scaler.get_scale()
            if step == 1:
                scaler.unscale_(opt)  # read after unscale_: no second division
            mon.step(step)
            scaler.step(opt)
            scaler.update()
    g = {(r["step"], r["layer"], r["param"]): r for r in actrace.read_table(tmp_path / "a.parquet").to_pylist()
         if r["stream"] == "param_grad"}
    assert np.sqrt(g[(0, "0", "weight")]["sumsq"]) == pytest.approx(true[0], rel=1e-6)
    assert np.sqrt(g[(1, "0", "weight")]["sumsq"]) == pytest.approx(true[1], rel=1e-6)
    a = {r["step"]: r for r in actrace.read_table(tmp_path / "a.parquet").to_pylist()
         if r["stream"] == "activation_grad" and r["layer"] == "1"}
    assert [np.sqrt(a[s]["sumsq"]) for s in (0, 1)] == pytest.approx(tanh_grad[:2], rel=1e-5)  # read unscaled
    assert true[0] < 10 and {g[(s, "0", "weight")]["mode"] for s in (0, 1)} == {"train"}
    assert g[(2, "0", "weight")]["mode"] == "skipped"
    rules = {f.rule for f in findings(metrics(tmp_path / "a.parquet"))}
    assert "scaler_skipped" in rules and "nan_inf" not in rules and "exploding_gradients" not in rules


class Cleaned(nn.Module):
    """A layer whose output the model then cleans in place (`nan_to_num_`) before a ReLU."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        h.nan_to_num_(0.0)
        return torch.relu(h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("nan", ["from the start", "after construction"])
def test_a_layer_output_cleaned_in_place_afterwards_is_read_as_it_was_made(tmp_path, dtype, device, nan):
    """Read as it was made: unit 2's NaN (a NaN bias) is in the linear's reading although the model
    zeroes it in place right after; the ReLU then reads unit 2 as the zeros it got. Also where the
    NaN arrives only after the monitor's trial (as in training), when the zeroing changed nothing:
    an in-place op on a held tensor spoils its batch, and the forward is read again at once."""
    torch.manual_seed(0)
    model = nn.Sequential(Cleaned()).to(device, dtype)
    probe = torch.randn(8, 4, device=device, dtype=dtype)

    def poison():
        with torch.no_grad():
            model[0].fc.bias[2] = float("nan")
    if nan == "from the start":
        poison()
        got = rows(record(model, probe, tmp_path / "c.parquet"))
    else:
        with Monitor(model, probe, tmp_path / "c.parquet", grad_every=None) as mon:
            poison()
            mon.probe_reading(0)
        got = rows(tmp_path / "c.parquet")
    assert (got["0.fc"]["nan_count"], got["0.fc"]["unit_count"]) == (8, [8, 8, 0, 8, 8, 8])
    assert got["0.fc"]["dtype"] == str(dtype).removeprefix("torch.")
    assert got["0.relu"]["nan_count"] == 0 and got["0.relu"]["unit_zero"][2] == 8


def test_fused_gpu_kernels_that_fail_are_said_once_and_torch_kernels_read_instead(tmp_path, monkeypatch):
    """Triton installed but failing where the model runs (no compiler, a GPU it cannot target): the
    failure is said once, and every reading, probe and per-step gradients, comes from torch kernels
    with the values known by construction (two of eight units killed), the run going on."""
    from actrace.reduce import fused, kernel

    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(kernel, "available", False)  # CPU tensors take the path a GPU's would
    monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.is_floating_point() and fused._failure is None)
    monkeypatch.setattr(fused, "_failure", None)
    monkeypatch.setattr(fused, "_kernel", broken)
    monkeypatch.setattr(fused, "_batch", broken)
    monkeypatch.setattr(fused, "_totals", broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    kill(model[0].bias, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    norms = []  # each step's gradients' sums of squares, as the model holds them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(model, torch.randn(16, 5), tmp_path / "f.parquet", probe_every=1) as mon:
            for step in range(3):
                model(torch.randn(16, 5)).square().mean().backward()
                mon.step(step)
                norms.append({n.rsplit(".", 1)[1] + n[0]: float(p.grad.double().square().sum())
                              for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
    said = [str(w.message) for w in caught if "fused GPU kernels failed" in str(w.message)]
    assert len(said) == 1 and "no compiler here" in said[0]
    assert dead(tmp_path / "f.parquet", "1") == [2 / 8] * 3
    table = actrace.read_table(tmp_path / "f.parquet").to_pylist()
    grads = {(r["step"], r["param"] + r["layer"]): r["sumsq"] for r in table if r["stream"] == "param_grad"}
    assert grads == {(step, name): pytest.approx(v, rel=1e-6) for step, seen in enumerate(norms) for name, v in seen.items()}


def test_an_index_beside_a_module_s_output_is_not_read_nor_warned_of_and_a_lone_integer_output_is(tmp_path):
    """A router returns (logits, top-k values, top-k indices), as Hugging Face's MoE gates do: the
    float parts are read, the int64 indices are no activation (no reading, no warning); a module
    whose outputs are all integer tensors, one or a tuple, is said once as not read."""
    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            logits = x @ self.weight.T
            values, indices = torch.topk(logits.softmax(-1), 2, dim=-1)
            return logits, values, indices

    class Bucket(nn.Module):
        def __init__(self):
            super().__init__()
            self.edges = nn.Parameter(torch.linspace(-1, 1, 5))

        def forward(self, x):
            return torch.bucketize(x, self.edges.detach())

    class Buckets(Bucket):
        def forward(self, x):
            return torch.bucketize(x, self.edges.detach()), x.argmax(-1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.bucket, self.buckets = Router(), Bucket(), Buckets()

        def forward(self, x):
            return self.router(x)[1].sum() + self.bucket(x).sum() + self.buckets(x)[0].sum()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        path = record(Net(), torch.randn(16, 8), tmp_path / "t.parquet")
    assert {"router.0", "router.1"} <= set(rows(path)) and "router.2" not in rows(path)
    skipped = [str(w.message) for w in said if "skipping" in str(w.message)]
    assert skipped == [f"actrace: skipping {name}: non-float output (torch.int64)" for name in
                       ("bucket", "buckets.0", "buckets.1")], skipped
