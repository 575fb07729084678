"""The PyTorch adapter in the training set-ups people use, on model code we did not write
(`transformers` models from tiny configs, `torch.utils.checkpoint`, `weight_norm`): gradient
accumulation, activation checkpointing, parametrized and tied weights, each against values known
by construction (the tensors' own gradients, read with torch)."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

import actrace
from actrace.adapters.torch import Monitor
from actrace.files.validate import validate
from actrace.format import metadata

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def gpt2_lm(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def grads_of(trace, stream):
    return {(r["layer"], r["param"]): r for r in actrace.read_table(trace).to_pylist() if r["stream"] == stream}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tied_weight_is_read_once_under_its_first_name_and_its_other_name_recorded(tmp_path, dtype):
    """GPT-2's `lm_head.weight` is `transformer.wte.weight`: one gradient reading, its norm the
    parameter's own (both uses accumulated), and the alias in the trace's metadata."""
    model = gpt2_lm(dtype)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 100, (4, 12))
    out = tmp_path / "g.parquet"
    with Monitor(model, ids, out, probe_every=100) as mon:
        model(ids, labels=ids).loss.backward()
        mon.step(0)
    grads = grads_of(out, "param_grad")
    assert ("lm_head", "weight") not in grads and ("transformer.wte", "weight") in grads
    assert len(grads) == len({id(p) for p in model.parameters()})  # every parameter once
    g = model.transformer.wte.weight.grad.double()
    np.testing.assert_allclose(grads[("transformer.wte", "weight")]["sumsq"], float((g * g).sum()), rtol=1e-6)
    assert json.loads(metadata.read(out)["aliases"]) == {"lm_head/weight": "transformer.wte/weight"}
    assert validate(out) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulated_micro_batches_give_one_activation_gradient_reading_per_layer(tmp_path, dtype):
    """Two micro-batches, two backwards, one step: each layer's activation gradient is one reading
    over both (merged by the schema's rules), equal to the gradients a hook of our own sees."""
    model = gpt2_lm(dtype)
    seen = []

    def watch(module, inputs, output):  # our own hook on the final norm's output gradient
        if output.requires_grad:
            output.register_hook(lambda g: seen.append(g.double()))
    model.transformer.ln_f.register_forward_hook(watch)
    batches = [torch.randint(0, 100, (2, 12)) for _ in range(2)]
    out = tmp_path / "acc.parquet"
    with Monitor(model, batches[0], out, probe_every=100, activation_grads=True) as mon:
        for ids in batches:
            (model(ids, labels=ids).loss / 2).backward()
        mon.step(0)
    assert validate(out) == []
    rows = grads_of(out, "activation_grad")
    ln_f = rows[("transformer.ln_f", None)]
    assert len(seen) == 2 and ln_f["shape"] == [4, 12, 32] and ln_f["count"] == 2 * seen[0].numel()
    want = sum(float((g * g).sum()) for g in seen)
    np.testing.assert_allclose(ln_f["sumsq"], want, rtol=1e-5 if dtype != torch.bfloat16 else 1e-2)


class Blocks(nn.Module):
    """Two Llama decoder layers (transformers' own code), run through torch.utils.checkpoint."""

    def __init__(self, reentrant: bool):
        super().__init__()
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=100)
        self.embed = nn.Embedding(100, 32)
        self.rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
        self.layers = nn.ModuleList(transformers.models.llama.modeling_llama.LlamaDecoderLayer(cfg, i)
                                    for i in range(2))
        self.reentrant = reentrant

    def forward(self, ids):
        h = self.embed(ids)
        pos = self.rotary(h, torch.arange(ids.shape[1])[None])
        for layer in self.layers:
            h = checkpoint(_run, layer, h, pos, use_reentrant=self.reentrant)
        return h


def _run(layer, h, pos):
    out = layer(h, position_embeddings=pos)
    return out[0] if isinstance(out, tuple) else out  # transformers before 4.54 gave a tuple


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_gradients_under_checkpointing_are_read_or_said_unreadable(tmp_path, reentrant):
    torch.manual_seed(0)
    model = Blocks(reentrant)
    ids = torch.randint(0, 100, (2, 8))
    out = tmp_path / "ckpt.parquet"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(model, ids, out, probe_every=100, activation_grads=True) as mon:
            model(ids).float().pow(2).mean().backward()
            mon.step(0)
    inside = {layer for layer, _ in grads_of(out, "activation_grad") if layer.startswith("layers.")}
    told = [str(w.message) for w in said if "cannot be read" in str(w.message)]
    if reentrant:
        assert not inside and len(told) == 1 and "layers.0" in told[0] and "use_reentrant" in told[0]
    else:
        assert {"layers.0.mlp.act_fn", "layers.1.mlp.down_proj"} <= inside and not told
    assert ("embed", None) in grads_of(out, "activation_grad")  # outside the checkpoints: read either way


def wav2vec2():
    cfg = transformers.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                      conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                                      num_conv_pos_embedding_groups=2, vocab_size=10)
    torch.manual_seed(0)
    return transformers.Wav2Vec2Model(cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_weight_normed_conv_is_a_layer_not_an_activation_and_its_originals_get_gradients(tmp_path, dtype):
    """Wav2Vec2's positional conv is weight-normed (`parametrizations.weight_norm`): the weight it
    computes is no activation of the probe, and its gradients are those of the originals."""
    model = wav2vec2().to(dtype)
    conv = model.encoder.pos_conv_embed.conv
    assert torch.nn.utils.parametrize.is_parametrized(conv)
    x = torch.randn(2, 400, dtype=dtype)
    out = tmp_path / "w2v.parquet"
    with Monitor(model, x, out, probe_every=100) as mon:
        model(x).last_hidden_state.float().pow(2).mean().backward()
        mon.step(0)
    layers = [r["layer"] for r in actrace.read_table(out).to_pylist() if r["stream"] == "activation"]
    assert "encoder.pos_conv_embed.conv" in layers and not any("parametrizations" in n for n in layers)
    grads = grads_of(out, "param_grad")
    for name, p in conv.parametrizations.weight.named_parameters():
        g = p.grad.double()
        np.testing.assert_allclose(grads[("encoder.pos_conv_embed.conv", f"weight.{name}")]["sumsq"],
                                   float((g * g).sum()), rtol=1e-6)
    assert ("encoder.pos_conv_embed.conv", "bias") in grads
    assert validate(out) == []


def test_activation_gradients_of_a_compiled_model_are_read_as_the_eager_ones(tmp_path):
    """`torch.compile`: the activation gradients read at every step equal the eager model's."""
    rows = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        run = torch.compile(model) if compiled else model
        x = torch.randn(16, 8)
        out = tmp_path / f"{compiled}.parquet"
        with Monitor(run, x, out, probe_every=100, activation_grads=True) as mon:
            for step in range(2):
                run(x).pow(2).mean().backward()
                mon.step(step)
                model.zero_grad()
        rows.append({(r["step"], r["layer"]): r for r in actrace.read_table(out).to_pylist()
                     if r["stream"] == "activation_grad"})
    assert sorted(rows[0]) == sorted(rows[1]) == [(s, layer) for s in (0, 1) for layer in ("0", "1", "2")]
    for key, a in rows[0].items():
        np.testing.assert_allclose(rows[1][key]["sumsq"], a["sumsq"], rtol=1e-5, err_msg=str(key))
