"""The PyTorch adapter on model code we did not write: Hugging Face `transformers` language and
vision models built from small configs (no weights downloaded). Every activation the model
applies is read once with its kind, and units killed by construction read as dead, also by the GPU's
fused kernels (`path`); their per-step gradients read as they were made."""
from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import polars as pl
import pytest
import torch
import transformers

import actrace
from actrace.adapters.torch.kinds import ACTIVATIONS
from actrace.adapters.torch import Monitor
from actrace.analyzer.metrics import metrics



def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2Model(cfg)
    return model, torch.randint(0, 100, (4, 12)), model.h[0].mlp.c_fc.bias, \
        {"h.0.mlp.act": ("gelu", 128), "h.1.mlp.act": ("gelu", 128)}


def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=100, mlp_bias=True)
    model = transformers.LlamaModel(cfg)
    return model, {"input_ids": torch.randint(0, 100, (4, 12))}, model.layers[0].mlp.gate_proj.bias, \
        {"layers.0.mlp.act_fn": ("silu", 64), "layers.1.mlp.act_fn": ("silu", 64)}


def convnext():
    cfg = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                      image_size=32)
    model = transformers.ConvNextModel(cfg)
    return model, torch.randn(2, 3, 32, 32), model.encoder.stages[0].layers[0].pwconv1.bias, \
        {"encoder.stages.0.layers.0.act": ("gelu", 32), "encoder.stages.1.layers.0.act": ("gelu", 64)}


def vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64)
    model = transformers.ViTModel(cfg)
    first = next(m for n, m in model.named_modules() if n.endswith("0.mlp.fc1") or n.endswith("0.intermediate.dense"))
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Module) and n.endswith(
        ("mlp.activation_fn", "intermediate.intermediate_act_fn"))}
    return model, torch.randn(2, 3, 16, 16), first.bias, {**{n: ("gelu", 64) for n in names},
                                                         "pooler.activation": ("tanh", 32)}


MODELS = {"gpt2": gpt2, "llama": llama, "convnext": convnext, "vit": vit}


@pytest.fixture(params=["native", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is here: its CUDA tests read the fused kernels"))])
def path(request, monkeypatch):
    """How the readings are reduced: as on this machine (`native`), or every tensor as a GPU's would be,
    by the fused Triton kernels (run by Triton's interpreter) and one transfer (`triton`)."""
    if request.param == "triton":
        from actrace.reduce import fused, kernel
        from actrace.reduce import torch as reductions

        monkeypatch.setattr(kernel, "available", False)
        monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.dtype in (torch.float32, torch.float64)
                            or narrow and t.is_floating_point())
        monkeypatch.setattr(reductions, "on_device", lambda v: isinstance(v, torch.Tensor))
    return request.param


@pytest.mark.parametrize("build", MODELS.values(), ids=MODELS.keys())
def test_every_activation_of_a_transformers_model_is_read_once_with_its_kind(tmp_path, build, cli, path):
    torch.manual_seed(0)
    model, probe, first_bias, expected = build()
    with torch.no_grad():
        first_bias[:8] = -1e4  # gelu/silu of -1e4 is exactly 0: 8 dead units in the first block
    trace = tmp_path / "hf.parquet"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no axis lost, no eval-mode doubt on these models
        with Monitor(model, probe, trace, grad_every=None) as mon:
            mon.probe_reading(0)
    t = actrace.read_table(trace).to_pylist()
    acts = {r["layer"]: (r["kind"], r["units"]) for r in t if r["kind"] in ACTIVATIONS}
    assert acts == expected
    assert all(r["unit_axis"] is not None for r in t)
    m = metrics(trace).filter(pl.col("stream") == "activation")
    dead = dict(zip(m["layer"], m["dead_fraction"]))
    first = min(expected, key=lambda n: [r["layer"] for r in t].index(n))
    assert dead[first] == 8 / expected[first][1]
    assert all(dead[n] == 0 for n in expected if n != first)
    res = cli("summary", trace)
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith(first + " "))
    assert expected[first][0] in line and f"{100 * 8 / expected[first][1]:.0f}%" in line


@pytest.mark.parametrize("build", MODELS.values(), ids=MODELS.keys())
def test_a_transformers_model_reads_the_same_replayed_as_traced(tmp_path, build):
    """Probe readings after the trial replay the modules whose ops read nothing (here each whole
    model, attention included): every column of every reading equals a fully traced forward's."""
    torch.manual_seed(0)
    model, probe, first_bias, _ = build()
    with torch.no_grad():
        first_bias[:8] = -1e4
    readings = []
    for replay in (True, False):
        mon = Monitor(model, probe, tmp_path / f"{replay}.parquet", grad_every=None)
        if replay:  # the whole model replays: its own call is in the plan
            assert any(isinstance(key, tuple) and key[0] is model for key in mon.forward.trace.plan)
        else:
            mon.forward.trace.plan = None
        readings.append([mon.forward.read()[0] for _ in range(2)])
        mon.close()
    replayed, traced = readings
    assert [[r.layer for r in step] for step in replayed] == [[r.layer for r in step] for step in traced]
    for a, b in zip(sum(replayed, []), sum(traced, [])):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert np.array_equal(x, y, equal_nan=True) if isinstance(x, np.ndarray) else x == y or x != x and y != y, \
                (a.layer, f.name)


def test_a_bert_attention_softmax_is_read_across_its_keys_and_a_mask_to_one_key_reads_peaked(tmp_path, path):
    """Eager BERT attention with the mask keeping only key 0: every query's distribution puts all its
    probability there, so every distribution is peaked and key 0 (1 of 6 units) is pinned at 1."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, attn_implementation="eager")
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(1, 100, (4, 6))
    mask = torch.zeros(4, 6, dtype=torch.long)
    mask[:, 0] = 1
    with Monitor(model, {"input_ids": ids, "attention_mask": mask}, tmp_path / "b.parquet") as mon:
        mon.probe_reading(0)
    rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "b.parquet").to_pylist() if r["kind"] == "softmax"}
    (name, r), = rows.items()
    assert (r["unit_axis"], r["units"], r["shape"]) == (3, 6, [4, 2, 6, 6]), name  # [batch, heads, queries, keys]
    m = metrics(tmp_path / "b.parquet").filter(pl.col("layer") == name)
    assert m["saturation_value"].to_list() == [1.0] and m["saturation_unit"].to_list() == [1 / 6]


@pytest.mark.parametrize("scaled", [False, True], ids=["healthy", "unit-5-x1000"])
def test_a_massive_activation_is_found_naming_its_unit_and_a_healthy_llama_has_none(tmp_path, scaled):
    """One output unit of a Llama MLP made 1000× the others (its down-projection row scaled): the
    finding names that layer and unit 5 at every reading; the same model unscaled says nothing."""
    from actrace.analyzer import analyze

    torch.manual_seed(0)
    model, probe, _, _ = llama()
    if scaled:
        with torch.no_grad():
            model.layers[0].mlp.down_proj.weight[5] *= 1000.0
    out = tmp_path / "l.parquet"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # attention scores read as one unit: said, not the point here
        with Monitor(model, probe, out, grad_every=None) as mon:
            for step in range(3):
                mon.probe_reading(step)
    every = analyze([out]).findings
    found = [f for f in every if f.rule == "massive_activation"]
    assert not [f for f in every if f.rule == "dormant_units"]  # the others are not dormant beside an outlier
    m = metrics(out).filter(pl.col("layer") == "layers.0.mlp.down_proj")
    if not scaled:
        assert found == [] and m["top_ratio"].max() < 100
        return
    assert m["top_unit"].to_list() == [5, 5, 5] and m["top_ratio"].min() > 500
    down = [f for f in found if f.layer == "layers.0.mlp.down_proj"]
    assert len(down) == 1 and "unit 5 " in down[0].evidence and down[0].step == 0
    assert all("unit 5 " in f.evidence for f in found)  # the residual stream carries the same unit on


@pytest.mark.parametrize("build", MODELS.values(), ids=MODELS.keys())
def test_a_transformers_model_s_gradients_are_read_as_they_were_made(tmp_path, build, path):
    """A per-step gradient reading of a `transformers` model (one batch for every parameter: the C
    kernel, or as on a GPU the fused kernels): one parameter's gradient set by construction (8
    zeros, a NaN, the rest 0.5) reads exactly so, and every other one as torch computes it."""
    torch.manual_seed(0)
    model, probe, first_bias, _ = build()
    trace = tmp_path / "g.parquet"
    with Monitor(model, probe, trace, probe_every=10 ** 9) as mon:
        model.train()
        out = model(**probe) if isinstance(probe, dict) else model(probe)
        out.last_hidden_state.pow(2).mean().backward()
        n = first_bias.numel()
        first_bias.grad.fill_(0.5)
        first_bias.grad[:8], first_bias.grad[8] = 0.0, float("nan")
        mon.gradient_reading(1)
        grads = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.grad is not None}
    rows = {f"{r['layer']}.{r['param']}": r for r in actrace.read_table(trace).to_pylist()
            if r["stream"] == "param_grad"}
    planted = next(name for name, p in model.named_parameters() if p is first_bias)
    r = rows[planted]
    assert (r["count"], r["nan_count"], r["inf_count"], r["zero_count"]) == (n, 1, 0, 8)
    assert (r["sum"], r["sumsq"], r["min"], r["max"]) == (0.5 * (n - 9), 0.25 * (n - 9), 0.0, 0.5)
    assert len(rows) > 4 and set(rows) <= set(grads)
    for name, r in rows.items():
        if name != planted:
            g = grads[name]
            assert (r["count"], r["nan_count"], r["zero_count"]) == (g.numel(), 0, int((g == 0).sum()))
            assert abs(r["sum"] - float(g.sum())) <= 64 * 2 ** -24 * float(g.abs().sum())  # spec §Numerics
            assert r["sumsq"] == pytest.approx(float(g.pow(2).sum()), rel=64 * 2 ** -24)
            assert (r["min"], r["max"]) == (float(g.min()), float(g.max()))


def test_mixtral_s_norms_after_its_moe_block_read_their_units_and_a_zeroed_gain_is_dead(tmp_path):
    """transformers' Mixtral sums its experts' outputs into zeros by index, which loses the unit axis;
    the norms after the block still read 32 units on the last axis (their gains name them), and
    layer 1's input norm with 4 of its 32 gains set to 0 reads exactly 4/32 dead."""
    cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    norm = "model.layers.1.input_layernorm"
    with torch.no_grad():
        model.get_submodule(norm).weight[:4] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Monitor(model, torch.randint(0, 32, (4, 12)), tmp_path / "m.parquet", grad_every=None) as mon:
            mon.probe_reading(0)
    rows = {r["layer"]: r for r in actrace.read_table(tmp_path / "m.parquet").to_pylist()}
    for name in (norm, "model.layers.1.post_attention_layernorm", "model.norm"):
        assert (rows[name]["units"], rows[name]["unit_axis"]) == (32, 2), name
    m = metrics(tmp_path / "m.parquet").filter(pl.col("layer") == norm)
    assert m["dead_fraction"].to_list() == [4 / 32]
