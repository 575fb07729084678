"""Derived readings (spec §Derived readings) by construction: attention per head from each attention
implementation, the LM head's log Z per position, a router's tokens per expert, against values the
models themselves compute or that are known by how the weights were set."""
from __future__ import annotations

import math
import warnings

import numpy as np
import polars as pl
import pytest
import torch
import transformers
from torch import nn

import actrace
from actrace.adapters.torch import Monitor
from actrace.adapters.torch import derived
from actrace.files.reader import read_table
from actrace.format.schema import ATTENTION_KINDS, DERIVED_KINDS

def record(model, probe, out, steps=1, **kw) -> pl.DataFrame:
    """The derived readings of `steps` probe readings of `model`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unit axes the trace cannot follow: said, not the point here
        with Monitor(model, probe, out, grad_every=None, **kw) as mon:
            for step in range(steps):
                mon.probe_reading(step)
    return pl.from_arrow(read_table(out)).filter(pl.col("kind").is_in(DERIVED_KINDS))


def per_unit(rows: pl.DataFrame, layer: str, column: str = "mean", step: int = 0) -> np.ndarray:
    """Per unit (head, expert) of one reading: the mean (unit_sum / unit_count), min or max."""
    r = rows.filter((pl.col("layer") == layer) & (pl.col("step") == step)).row(0, named=True)
    if column == "mean":
        return np.asarray(r["unit_sum"]) / np.asarray(r["unit_count"])
    return np.asarray(r[f"unit_{column}"], dtype=np.float64)


def attention(logits: torch.Tensor, causal: bool = False) -> dict[str, torch.Tensor]:
    """The adapter's per-head numbers of the queries its readings keep (`rows`)."""
    return {kind: t if rows is None else t[rows] for kind, (t, rows) in derived.attention(logits, causal).items()}


# How `derived.attention` computes: by the C kernel (a CPU's), by torch ops (a GPU's without Triton), by
# the fused Triton kernel (a GPU's: Triton's interpreter runs it on CPU tensors where no GPU is), on a GPU
SCORED_BY = ["c-kernel", "torch-ops"] + (["cuda"] if torch.cuda.is_available() else ["triton"])


def scored_by(where: str, monkeypatch) -> str:
    """The device of the scores `where` (of SCORED_BY) reads, the other paths turned off."""
    from actrace.reduce import fused, kernel

    if where in ("torch-ops", "triton"):
        monkeypatch.setattr(kernel, "available", False)
    if where == "triton":
        monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.dtype == torch.float32)
    return "cuda" if where == "cuda" else "cpu"


def test_the_per_head_numbers_of_known_scores():
    """Head 0 one-hot on key 1 (entropy 0, no mass on the first key), head 1 uniform over 4 keys
    (entropy 1, mass 1/4 on the first), a masked key left out of every number; a NaN score is read
    as NaN in every number of its query."""
    logits = torch.zeros(1, 2, 1, 5)
    logits[0, 0, 0, 1] = 1000.0
    logits[..., 4] = -math.inf
    got = attention(logits)
    assert got["attention_logit"].tolist() == [[1000.0, 0.0]]  # each query's largest logit, per head
    assert got["attention_entropy"][0].tolist() == pytest.approx([0.0, 1.0], abs=1e-6)
    assert got["attention_sink"][0].tolist() == pytest.approx([0.0, 0.25])
    additive = torch.zeros(1, 1, 2, 3)
    additive[0, 0, 0, 1:] = torch.finfo(torch.float32).min  # query 0 sees key 0 only: no entropy, all mass on it
    got = attention(additive)
    assert got["attention_entropy"].shape == (1, 1) and got["attention_sink"][:, 0].tolist() == pytest.approx([1.0, 1 / 3])
    logits[0, 1, 0, 2] = math.nan
    got = attention(logits)
    assert [math.isnan(got[k][0, 1]) for k in ("attention_logit", "attention_entropy", "attention_sink")] == [True] * 3


def llama(impl):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation=impl))


def gpt2(impl):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                attn_implementation=impl))


def bert(impl):
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        attn_implementation=impl))


def mixtral(impl):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attn_implementation=impl))


def sharpen(model):
    """Scale the query and key weights of the second layer ×100: its heads' scores grow ×10⁴, so each
    query puts nearly all its mass on one key (entropy ≈ 0); the first layer stays as it was."""
    for name, p in model.named_parameters():
        if ".1." in name and name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
            p.data *= 100
        elif ".1." in name and name.endswith("c_attn.weight"):  # GPT-2's fused q, k, v columns
            p.data[:, : 2 * p.shape[0]] *= 100


BUILDERS = {"llama": llama, "gpt2": gpt2, "bert": bert, "mixtral": mixtral}


def attention_layers(rows: pl.DataFrame, kind: str) -> list[str]:
    return sorted(rows.filter(pl.col("kind") == kind)["layer"].unique())


def handmade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention implementation of the kind a user registers with Hugging Face (as flash is):
    no torch call of it shows the scores (no softmax, no SDPA); flash's masks (`[B, K]` padding)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", query, key) * scaling
    lq, lk = scores.shape[-2:]
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if module.is_causal else torch.ones(lq, lk).bool()
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    w = (scores - scores.amax(-1, keepdim=True)).exp() * allowed
    w = w / w.sum(-1, keepdim=True)
    return torch.einsum("bhqk,bhkd->bhqd", w, value).transpose(1, 2).contiguous(), None


@pytest.fixture
def handmade():
    """`handmade_attention` registered as Hugging Face's "handmade" implementation, with flash's masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("handmade", handmade_attention)
    AttentionMaskInterface.register("handmade", flash_attention_mask)
    yield "handmade"
    del AttentionInterface._global_mapping["handmade"], AttentionMaskInterface._global_mapping["handmade"]


@pytest.mark.parametrize("family", BUILDERS, ids=BUILDERS)
def test_every_attention_implementation_reads_the_same_heads_and_a_sharpened_layer_reads_one_hot(tmp_path, family,
                                                                                                 handmade):
    """The same weights under eager attention, SDPA and a registered implementation that shows no
    scores (read from its call, as flash's would be, with flash's padding mask), a padded probe:
    every per-head number agrees; the layer whose q/k were scaled reads entropy ≈ 0 in every head,
    the other ≈ 1 (random init)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, 7:] = 0
    probe = {"input_ids": ids, "attention_mask": mask}
    got = {}
    for impl in ("eager", "sdpa", handmade):
        torch.manual_seed(1)
        model = BUILDERS[family](impl)
        sharpen(model)
        got[impl] = record(model, probe, tmp_path / f"{impl}.parquet")
    eager = got["eager"]
    layers = attention_layers(eager, "attention_entropy")
    assert len(layers) == 2
    for other in (got["sdpa"], got[handmade]):
        assert attention_layers(other, "attention_entropy") == layers
        for kind in ("attention_logit", "attention_entropy", "attention_sink"):
            for layer in attention_layers(eager, kind):
                for column in ("mean", "min", "max"):
                    np.testing.assert_allclose(per_unit(eager, layer, column), per_unit(other, layer, column),
                                               rtol=1e-4, atol=1e-5)
    first, second = (per_unit(eager, layer) for layer in layers)
    assert first.min() > 0.95 and second.max() < 0.1 and len(second) == 4
    logit = attention_layers(eager, "attention_logit")
    assert per_unit(eager, logit[1], "max").min() > 10 * per_unit(eager, logit[0], "max").max()


@pytest.mark.parametrize("where", ["c-kernel", "torch-ops"])
def test_a_unit_axis_given_for_every_reading_puts_the_heads_of_an_attention_on_axis_1(tmp_path, where, monkeypatch):
    """`unit_axes={"*": 1}` matches the derived readings too: axis 1 of their `[queries, heads]`,
    the heads, whichever path took the numbers."""
    from actrace.reduce import kernel

    if where == "torch-ops":
        monkeypatch.setattr(kernel, "available", False)
    torch.manual_seed(0)
    got = record(llama("sdpa"), torch.randint(0, 64, (2, 6)), tmp_path / "u.parquet", unit_axes={"*": 1})
    heads = got.filter(pl.col("kind").is_in(ATTENTION_KINDS))
    assert heads.height == 6 and set(heads["units"]) == {4} and set(heads["unit_axis"]) == {1}
    entropy = heads.filter(pl.col("kind") == "attention_entropy")
    assert entropy["shape"].to_list() == [[2 * 5, 4]] * 2  # each sequence's first query attends one key only


def test_the_lm_head_reads_log_z_and_max_logit_per_position_as_the_model_computes_them(tmp_path):
    torch.manual_seed(0)
    model = gpt2("sdpa").eval()
    ids = torch.randint(0, 64, (3, 10))
    rows = record(model, ids, tmp_path / "g.parquet")
    with torch.no_grad():
        logits = model(ids).logits.double()
    log_z, peak = torch.logsumexp(logits, -1).reshape(-1), logits.amax(-1).reshape(-1)
    for kind, truth in (("log_z", log_z), ("max_logit", peak)):
        r = rows.filter(pl.col("kind") == kind).row(0, named=True)
        assert r["layer"] == f"lm_head.{kind}" and r["count"] == 30 and r["units"] == 1
        assert r["sum"] == pytest.approx(float(truth.sum()), rel=1e-5)
        assert (r["min"], r["max"]) == pytest.approx((float(truth.min()), float(truth.max())), rel=1e-5)


def test_multihead_attention_reads_its_heads_as_its_own_weights_say_masks_honoured(tmp_path):
    """nn.MultiheadAttention on its fast path (eval, no_grad): per-head entropy and first-key mass
    equal those of the weights the module itself returns, under a causal and a padding mask."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x, padding):
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
            return self.attn(x, x, x, attn_mask=causal, key_padding_mask=padding, need_weights=False)[0]

    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(2, 6, 16)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    rows = record(block, (x, padding), tmp_path / "m.parquet")
    with torch.no_grad():
        causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
        w = block.attn(x, x, x, attn_mask=causal, key_padding_mask=padding, average_attn_weights=False)[1]
    keys = (~causal)[None] & ~padding[:, None, :]  # [B, Q, K]
    n = keys.sum(-1)
    entropy = torch.special.entr(w.double()).sum(-1) / n.clamp(min=2).log()[:, None]  # [B, H, Q]
    wide = (n >= 2)[:, None].expand_as(entropy)
    want = [float(entropy[:, h][wide[:, h]].mean()) for h in range(4)]
    np.testing.assert_allclose(per_unit(rows, "attn.attention_entropy"), want, rtol=1e-5)
    np.testing.assert_allclose(per_unit(rows, "attn.attention_sink"), w[..., 0].double().mean((0, 2)), rtol=1e-5)


class Router(nn.Module):
    """A hand-written top-2 router over 4 experts; expert 3's bias far negative: it never wins."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        with torch.no_grad():
            self.gate.bias[3] = -1e4

    def forward(self, x):
        weights, chosen = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).any(-1)
            out[rows] += expert(x[rows]) * weights[rows][chosen[rows] == e][:, None]
        return out


def test_a_router_counts_the_tokens_each_expert_got_and_an_expert_never_chosen_reads_zero(tmp_path):
    torch.manual_seed(0)
    model = Router().eval()
    x = torch.randn(50, 8)
    rows = record(model, x, tmp_path / "r.parquet")
    with torch.no_grad():
        chosen = torch.topk(model.gate(x).softmax(-1), 2, dim=-1).indices
    tokens = np.bincount(chosen.reshape(-1).numpy(), minlength=4)
    assert tokens[3] == 0
    load = rows.filter(pl.col("kind") == "expert_load").row(0, named=True)
    assert load["layer"] == "expert_load"  # the model is the router: no scope
    assert load["units"] == 4 and load["unit_sum"] == tokens.tolist()
    prob = per_unit(rows, rows.filter(pl.col("kind") == "router_prob")["layer"][0])
    with torch.no_grad():
        np.testing.assert_allclose(prob, model.gate(x).softmax(-1).mean(0).numpy(), rtol=1e-5)


def test_mixtral_counts_the_tokens_its_own_router_sends_each_expert(tmp_path):
    torch.manual_seed(0)
    model = mixtral("sdpa").eval()
    ids = torch.randint(0, 64, (3, 10))
    chosen = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, name=name: chosen.__setitem__(name, o[2]))
             for name, m in model.named_modules() if type(m).__name__ == "MixtralTopKRouter"]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    assert len(chosen) == 2  # one router a layer
    rows = record(model, ids, tmp_path / "x.parquet")
    for name, indices in chosen.items():
        load = rows.filter(pl.col("layer") == f"{name}.expert_load").row(0, named=True)
        assert load["unit_sum"] == np.bincount(indices.reshape(-1).numpy(), minlength=4).tolist()
        entropy = rows.filter(pl.col("layer") == f"{name}.router_entropy").row(0, named=True)
        assert entropy["count"] == 30 and 0 < entropy["min"] <= entropy["max"] <= 1


SIGNAL_RULES = ("attention_entropy_collapse", "attention_logit_growth", "logit_divergence", "dead_expert")


def signal_findings(model, probe, out, grow=lambda step: None, steps=5) -> dict[str, list]:
    """The derived-reading findings of `steps` probe readings, `grow(step)` changing the weights before each."""
    from actrace.analyzer import analyze

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Monitor(model, probe, out, grad_every=None) as mon:
            for step in range(steps):
                with torch.no_grad():
                    grow(step)
                mon.probe_reading(step * 10)
    found = analyze([out]).findings
    return {rule: [f for f in found if f.rule == rule] for rule in SIGNAL_RULES}


def scale(model, layer: str, suffixes, factor: float) -> None:
    for name, p in model.named_parameters():
        if f".{layer}." in name and name.endswith(suffixes):
            p.mul_(factor)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "mixtral"])
def test_healthy_transformers_raise_no_derived_reading_finding(tmp_path, family):
    torch.manual_seed(0)
    found = signal_findings(BUILDERS[family]("sdpa"), torch.randint(0, 64, (4, 12)), tmp_path / "h.parquet")
    assert found == {rule: [] for rule in SIGNAL_RULES}


def test_growing_query_key_weights_raise_logit_growth_then_entropy_collapse_in_that_layer_only(tmp_path):
    """Layer 1's q/k weights ×20, then ×1.6 at every reading (its logits ×2.56 a reading): the
    logit growth names that layer from the reading above 50 and 5× the first; entropy collapse
    once its heads are one-hot; layer 0 is never named."""
    torch.manual_seed(0)
    model = llama("eager")
    qk = ("q_proj.weight", "k_proj.weight")
    found = signal_findings(model, torch.randint(0, 64, (4, 12)), tmp_path / "g.parquet", steps=6,
                            grow=lambda step: scale(model, "1", qk, 20.0 if step == 0 else 1.6))
    growth, collapse = found["attention_logit_growth"], found["attention_entropy_collapse"]
    assert [f.layer for f in growth] == ["model.layers.1.self_attn.attention_logit"]
    assert growth[0].value > 50 and growth[0].step > 0
    assert [f.layer for f in collapse] == ["model.layers.1.self_attn.attention_entropy"]
    assert "4 of 4 heads" in collapse[0].evidence and collapse[0].step >= growth[0].step
    assert found["logit_divergence"] == [] and found["dead_expert"] == []


def test_a_growing_lm_head_raises_logit_divergence_and_a_router_that_never_picks_an_expert_dead_expert(tmp_path):
    torch.manual_seed(0)
    model = llama("sdpa")
    found = signal_findings(model, torch.randint(0, 64, (4, 12)), tmp_path / "z.parquet",
                            grow=lambda step: step and model.lm_head.weight.mul_(5.0))
    assert [f.layer for f in found["logit_divergence"]] == ["lm_head.log_z"]
    assert found["logit_divergence"][0].value >= 20
    router = Router()
    found = signal_findings(router, torch.randn(50, 8), tmp_path / "r.parquet", steps=3)
    dead = found["dead_expert"]
    assert len(dead) == 1 and "expert 3 got no probe token" in dead[0].evidence and dead[0].step == 0


def test_the_report_draws_every_head_over_steps_and_names_the_collapsed_layer(tmp_path):
    """A Llama whose layer 1 q/k grow: the report's heads section draws one row per head (8) in
    Chromium without a script error, and its findings name that layer's collapse."""
    from conftest import rendered, run_cli

    torch.manual_seed(0)
    model = llama("sdpa")
    signal_findings(model, torch.randint(0, 64, (4, 12)), tmp_path / "qk.parquet", steps=4,
                    grow=lambda step: scale(model, "1", ("q_proj.weight", "k_proj.weight"), 20.0 if step == 0 else 1.6))
    res = run_cli("report", tmp_path / "qk.parquet", "-o", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr
    with rendered(tmp_path / "r.html", "heads") as (page, errors):
        labels = page.eval_on_selector_all("#heads svg .role-axis-label text", "els => els.map(e => e.textContent)")
        text = page.inner_text("body")
    assert errors == []
    assert {f"model.layers.{i}.self_attn · head {h}" for i in (0, 1) for h in range(4)} <= set(labels)
    assert "attention_entropy_collapse" in text and "Attention heads × steps" in text


@pytest.mark.parametrize("where", ["c-kernel", "torch-ops"])
def test_kurtosis_is_torchs_own_and_a_massive_unit_makes_the_tails_heavy(tmp_path, where, monkeypatch):
    """The kurtosis of each of a Llama's layer outputs from the trace's power sums equals the one
    torch computes from the tensor (float64, central); one unit of a layer made ×1000 lifts that
    layer's far above a normal's 3. On the fused kernel and on torch's own ops."""
    from actrace.analyzer.metrics import metrics
    from actrace.reduce import kernel

    if where == "torch-ops":
        monkeypatch.setattr(kernel, "available", False)
    torch.manual_seed(0)
    model = llama("sdpa").eval()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[7] *= 1000.0
    ids = torch.randint(0, 64, (4, 12))
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, name=name: seen.__setitem__(name, o.detach().double()))
             for name, m in model.named_modules() if name.endswith(("down_proj", "gate_proj"))]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    record(model, ids, tmp_path / "k.parquet")
    m = metrics(tmp_path / "k.parquet")
    for name, x in seen.items():
        truth = float(((x - x.mean()) ** 4).mean() / x.var(unbiased=False) ** 2)
        got = m.filter(pl.col("layer") == name)["kurtosis"].item()
        assert got == pytest.approx(truth, rel=1e-4), name
    assert m.filter(pl.col("layer") == "model.layers.1.mlp.down_proj")["kurtosis"].item() > 10
    assert m.filter(pl.col("layer") == "model.layers.0.mlp.down_proj")["kurtosis"].item() < 10


def test_units_made_to_barely_fire_are_dormant_not_dead_and_a_healthy_layer_has_none(tmp_path):
    """A ReLU layer whose first 24 of 64 units had their incoming weights and biases ×0.01: those
    units still fire (not dead) but at ~1 % of the others' RMS: dormant fraction 24/64, named by
    `dormant_units`; the untouched layer reads none dormant."""
    from actrace.analyzer import analyze

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    with torch.no_grad():
        model[2].weight[:24] *= 0.01
        model[2].bias[:24] = model[2].bias[:24].abs() * 0.01
    out = tmp_path / "d.parquet"
    with Monitor(model, torch.randn(256, 16), out, grad_every=None) as mon:
        for step in range(3):
            mon.probe_reading(step)
    a = analyze([out])
    m = a.metrics.filter(pl.col("step") == 2)
    relu = dict(zip(m["layer"], zip(m["dormant_fraction"], m["dead_fraction"])))
    assert relu["3"][0] == pytest.approx(24 / 64) and relu["3"][1] < 24 / 64
    assert relu["1"][0] == 0
    found = [f for f in a.findings if f.rule == "dormant_units"]
    assert {f.layer for f in found} == {"3"} and all(f.step == 0 for f in found)  # the ReLU's, not its Linear's


def test_units_killed_by_their_bias_are_dead_after_the_relu_and_leave_no_dormant_unit_before_it(tmp_path):
    """24 of 64 units of a Linear held at −100 by their bias: the ReLU after it reads them dead; the
    Linear's own output holds them at RMS 100 against ~1 for the rest, more outliers than the tenth
    the reference leaves out, so its 40 healthy units would read 'dormant' there: the metric is null for
    it (analyzer.meaning: dormancy is an activation's, ReDo's neurons), no finding says so, and the dead
    units are said where they are."""
    from actrace.analyzer import analyze

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    with torch.no_grad():
        model[0].bias[:24], model[0].bias[24:] = -100.0, 1.0  # the rest fire for every input: alive
    out = tmp_path / "k.parquet"
    with Monitor(model, torch.randn(256, 16), out, grad_every=None) as mon:
        for step in range(3):
            mon.probe_reading(step)
    a = analyze([out])
    m = {r["layer"]: r for r in a.metrics.filter(pl.col("step") == 2).iter_rows(named=True)}
    assert m["1"]["dead_fraction"] == 24 / 64 and m["0"]["dormant_fraction"] is None  # means nothing there
    assert [f.layer for f in a.findings if f.rule == "dormant_units"] == []
    assert {(f.rule, f.layer) for f in a.findings if f.rule.startswith("dead")} == {("dead_high", "1")}


def _tricky_scores(case: str) -> torch.Tensor:
    """Scores `[2, 3, 5, 6]` as attentions make them: plain, causal by the dtype's lowest (HF eager),
    by −inf, left-padded (key 0 and 1 of the second sequence masked), one query fully masked, a NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 6, generator=g) * 4
    if case == "causal-min":
        x = x + torch.full((5, 6), torch.finfo(torch.float32).min).triu(2)
    elif case == "causal-inf":
        x = x.masked_fill(torch.ones(5, 6, dtype=torch.bool).triu(2), -math.inf)
    elif case == "left-padded":
        x[1, :, :, :2] = torch.finfo(torch.float32).min
    elif case == "query-masked":
        x[0, :, 2, :] = -math.inf
    elif case == "nan":
        x[1, 2, 3, 4] = math.nan
    elif case == "peaked":
        x[:, :, :, 3] += 2000.0  # one key far above: exponents that underflow
    elif case == "nan-masked-elsewhere":  # a NaN at a key another head masks: left out with the key
        x[0, 0, :, 2] = torch.finfo(torch.float32).min
        x[0, 1, 1, 2] = math.nan
    elif case == "large":  # logits far from 0, where a float32 sum of p·x would cancel
        x = x + 1000.0
    elif case == "long":  # 300 keys: whole vectors of the kernel's lanes and a tail, a key masked in one head
        x = torch.randn(2, 3, 5, 300, generator=g) * 6
        x[0, 1, :, 17] = torch.finfo(torch.float32).min
    elif case == "threads":  # enough scores to be shared among threads, 111 queries: runs of them and a rest
        x = torch.randn(3, 4, 37, 160, generator=g) * 6
        x[2, 3, :, 5] = torch.finfo(torch.float32).min
        x[1, 0, 36, 7] = math.nan
    return x


@pytest.mark.parametrize("where", SCORED_BY)
@pytest.mark.parametrize("case", ["plain", "causal-min", "causal-inf", "left-padded", "query-masked", "nan", "peaked",
                                  "nan-masked-elsewhere", "large", "long", "threads"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_fast_per_head_numbers_are_the_numpy_definitions(case, where, causal, monkeypatch):
    """The PyTorch adapter's fast paths (on a CPU the fused kernel's one read of the scores, on a GPU
    its Triton twin's; elsewhere a softmax in a reused buffer, entropy as log Z minus the expected
    logit) give the core's numpy definition (spec §Derived readings); SDPA's causal mask given as a
    flag (applied by the kernels as they read) leaves out what the same mask filled in does. On CUDA
    where a GPU is present."""
    from actrace.reduce import derived as definition

    device = scored_by(where, monkeypatch)
    x = _tricky_scores(case)
    later = ~torch.ones(x.shape[-2:], dtype=torch.bool).tril()  # SDPA's is_causal: key j > query i left out
    fast = attention(x.to(device), causal=causal)
    want = definition.attention((x.masked_fill(later, -math.inf) if causal else x).numpy())
    for kind in ATTENTION_KINDS:
        assert fast[kind].shape == want[kind].shape, kind
        np.testing.assert_allclose(fast[kind].cpu().numpy(), want[kind], rtol=1e-5, atol=1e-5, err_msg=kind)


def test_a_probe_read_in_chunks_gives_the_derived_readings_of_the_whole(tmp_path):
    """Queries and tokens come first in every derived tensor, so the chunks of a probe merge into
    what the whole probe gives (spec §Columns, merge): a Mixtral on 5 sequences, in chunks of 2."""
    torch.manual_seed(0)
    model = mixtral("eager")
    ids = torch.randint(0, 64, (5, 10))
    whole = record(model, ids, tmp_path / "whole.parquet")
    chunked = record(model, ids, tmp_path / "chunks.parquet", probe_chunk=2)
    assert whole.height == chunked.height > 0
    for a, b in zip(whole.sort("layer").iter_rows(named=True), chunked.sort("layer").iter_rows(named=True)):
        assert (a["layer"], a["shape"], a["count"], a["unit_count"]) == (b["layer"], b["shape"], b["count"],
                                                                          b["unit_count"])
        for col in ("unit_sum", "unit_min", "unit_max"):
            np.testing.assert_allclose(a[col], b[col], rtol=1e-5, atol=1e-6, err_msg=f"{a['layer']} {col}")


@pytest.mark.parametrize("where", SCORED_BY)
def test_a_key_one_head_masks_is_left_out_of_every_heads_numbers(where, monkeypatch):
    """Head 0 masks key 2, where head 1 scores far above its other keys: key 2 is left out for both
    (spec §Derived readings), so head 1's largest logit, entropy and first-key mass are those of
    keys 0, 1 and 3 alone, in the fast path as in the definition."""
    from actrace.reduce import derived as definition

    device = scored_by(where, monkeypatch)
    x = torch.tensor([[[[1.0, 2.0, 0.0, 0.5]], [[0.3, 0.1, 200.0, 0.2]]]])
    x[0, 0, 0, 2] = torch.finfo(torch.float32).min
    live = torch.tensor([0.3, 0.1, 0.2])
    p = torch.softmax(live, 0)
    fast = {k: v.cpu() for k, v in attention(x.to(device)).items()}
    for got in (fast, {k: torch.as_tensor(v) for k, v in definition.attention(x.numpy()).items()}):
        assert float(got["attention_logit"][0, 1]) == pytest.approx(0.3)
        assert float(got["attention_entropy"][0, 1]) == pytest.approx(float(-(p * p.log()).sum() / math.log(3)), rel=1e-5)
        assert float(got["attention_sink"][0, 1]) == pytest.approx(float(p[0]), rel=1e-5)


@pytest.mark.parametrize("offset, known", [(3.0, True), (100.0, False)])
def test_a_kurtosis_the_power_sums_cannot_give_is_unknown_not_wrong(tmp_path, offset, known):
    """Values of a normal distribution moved off 0 (the fused kernel's float32 lanes): 3 std off, the
    kurtosis is the normal's 3; 100 std off, the raw sums cancel below their rounding, and the
    kurtosis is null rather than a wrong number (spec §Metrics)."""
    import actrace
    from actrace.analyzer.metrics import metrics

    x = np.random.default_rng(0).standard_normal((4096, 16)).astype(np.float32) + offset
    with actrace.Writer(tmp_path / "k.parquet", run="k") as w:
        w.record_activation(0, "h", x, kind="linear")
    got = metrics(tmp_path / "k.parquet")["kurtosis"].item()
    assert (got == pytest.approx(3.0, abs=0.15)) if known else got is None


def test_only_attentions_and_routers_give_derived_readings_and_a_keyword_softmax_is_read(tmp_path):
    """A segmentation head's softmax over classes (4-D, last axis) is no attention, a retrieval's
    top-k of neighbours no router: neither gives a derived reading; an attention calling
    `torch.softmax(input=..., dim=-1)` by keyword is read."""

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = nn.Linear(8, 16)

        def forward(self, x):
            q, k = self.qk(x).view(x.shape[0], x.shape[1], 2, 8).unbind(2)
            scores = (q @ k.transpose(-2, -1))[:, None] / 8 ** 0.5
            return torch.softmax(input=scores, dim=-1).squeeze(1) @ x

    class Segmenter(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.top_k = nn.Conv2d(3, 5, 1), 3

        def forward(self, x):
            classes = torch.softmax(self.conv(x).permute(0, 2, 3, 1), -1)
            return classes.flatten(1, 2).topk(self.top_k, dim=-1).values.sum() + classes.sum()

    torch.manual_seed(0)
    rows = record(Segmenter(), torch.randn(2, 3, 6, 6), tmp_path / "s.parquet")
    assert rows.height == 0
    rows = record(SelfAttention(), torch.randn(2, 5, 8), tmp_path / "a.parquet")
    assert sorted(rows["layer"]) == ["attention_entropy", "attention_logit", "attention_sink"]


@pytest.mark.parametrize("case", ["causal-window", "softcap-padding", "bidirectional-window", "full-mask"])
def test_an_implementations_call_gives_the_scores_its_mask_and_options_say(case):
    """The scores read from an attention implementation's call (flash's arguments) are those its
    mask and options define: causal aligned to the last key with a sliding window of 3 (Hugging
    Face's: a key at most 2 positions back); Gemma's soft cap with a `[B, K]` padding mask; a
    non-causal window (ModernBERT's local layers: at most 2 positions either way, as flash's); a
    4-D mask given to a causal module (a bidirectional prefix), which alone decides, as in SDPA."""
    from actrace.adapters.torch.derived import interface_logits
    from actrace.reduce import derived as definition

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)  # 5 queries, 7 keys, GQA
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.5
    low = torch.finfo(torch.float32).min
    gap = torch.arange(5)[:, None] + 2 - torch.arange(7)  # query − key, the last query on the last key
    if case == "causal-window":
        got = interface_logits(None, q, k, None, scaling=0.5, sliding_window=3, is_causal=True)
        want = scores.masked_fill((gap < 0) | (gap >= 3), low)
    elif case == "softcap-padding":
        padding = torch.ones(2, 7, dtype=torch.long)
        padding[1, :2] = 0
        got = interface_logits(None, q, k, padding, scaling=0.5, softcap=2.0, is_causal=False)
        want = (torch.tanh(scores / 2.0) * 2.0).masked_fill(padding[:, None, None, :] == 0, low)
    elif case == "bidirectional-window":
        got = interface_logits(None, q, k, None, scaling=0.5, sliding_window=3, is_causal=False)
        want = scores.masked_fill(gap.abs() >= 3, low)
    else:
        allowed = (gap >= 0) | (torch.arange(7) < 4)  # the first 4 keys seen by every query
        got = interface_logits(nn.Module(), q, k, allowed[None, None], scaling=0.5, is_causal=True)
        want = scores.masked_fill(~allowed, low)
    fast, expect = attention(got), definition.attention(want.numpy())
    for kind in ATTENTION_KINDS:
        np.testing.assert_allclose(fast[kind].numpy(), expect[kind], rtol=1e-5, atol=1e-6, err_msg=kind)



@pytest.mark.parametrize("loss, said", [(lambda step: 2.0 * 0.97 ** step, False), (lambda step: 2.0, True),
                                        (lambda step: 0.5 + 0.01 * step, True), (lambda step: -1.0, True)],
                         ids=["loss-falling-steeply", "loss-flat", "loss-rising", "loss-negative-flat"])
def test_heads_gone_one_hot_and_a_rising_log_z_are_said_unless_the_loss_falls_steeply(tmp_path, loss, said):
    """Four heads' entropy (over its maximum) falls from 0.8 to 0.02 by step 150 and the LM head's
    log Z rises 8 nats, readings every 10 steps to 300. While the logged loss falls to a fraction
    (a model finding its solution: an induction head is one-hot, a confident model's log Z rises)
    neither is said; with a flat or rising loss both are (entropy collapse, logit divergence)."""
    from actrace.analyzer import analyze

    rng = np.random.default_rng(0)
    with actrace.Writer(tmp_path / "t.parquet") as w:
        for step in range(0, 301, 10):
            entropy = max(0.02, 0.8 - 0.78 * step / 150)
            w.record_activation(step, "attn", np.clip(entropy + rng.normal(0, 0.005, (64, 4)), 0, 1).astype(
                np.float32), kind="attention_entropy")
            w.record_activation(step, "lm_head", (2.0 + 8 * step / 300 + rng.normal(0, 0.01, 64)).astype(
                np.float32), kind="log_z", unit_axis=None)
            w.log(step, loss=loss(step))
    rules = {f.rule for f in analyze(tmp_path / "t.parquet").findings}
    assert ({"attention_entropy_collapse", "logit_divergence"} <= rules) == said, rules
    assert said or not rules & {"attention_entropy_collapse", "logit_divergence"}
