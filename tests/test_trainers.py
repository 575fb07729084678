"""Recording where people train: a Hugging Face `Trainer` and a Lightning `Trainer`, each a few
steps of a small real model with a unit killed by construction, read through the callbacks."""
from __future__ import annotations

import polars as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actrace
from actrace.format import metadata
from actrace.adapters.torch import Monitor
from actrace.analyzer.metrics import metrics
from actrace.files.validate import validate
from conftest import HUNG


def _acts(path) -> dict[str, dict]:
    return {r["layer"]: r for r in actrace.read_table(path).to_pylist() if r["stream"] == "activation"}


class Rows(torch.utils.data.Dataset):
    """Token ids and labels as a tokenized dataset gives them: one dict per example."""

    def __init__(self, n=64, length=12):
        g = torch.Generator().manual_seed(0)
        self.ids, self.labels = torch.randint(1, 100, (n, length), generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=3))
    with torch.no_grad():  # GELU(x - 1e4) is exactly -0.0 for these 5 of 64 units: dead for every input
        model.bert.encoder.layer[0].intermediate.dense.bias[:5] = -1e4
    return model


def test_a_hugging_face_trainer_run_is_recorded_and_reported_beside_a_pytorch_run(tmp_path, cli):
    from transformers import Trainer, TrainingArguments

    from actrace.adapters.huggingface import TraceCallback

    ds, model = Rows(), tiny_bert()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=6,
                             report_to=[], save_strategy="no", use_cpu=True, run_name="bert-trainer", logging_steps=2)
    callback = TraceCallback(probe=[ds[i] for i in range(16)], probe_every=2)  # rows, batched by the collator
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()
    path = tmp_path / "out" / "actrace.parquet"
    assert validate(path) == []
    meta = metadata.read(path)
    assert meta["run_name"] == "bert-trainer" and meta["status"] == "complete" and meta["mode"] == "eval"
    assert '"per_device_train_batch_size": 8' in meta["config"]
    act = "bert.encoder.layer.0.intermediate.intermediate_act_fn"
    acts = _acts(path)
    assert (acts[act]["kind"], acts[act]["units"], acts[act]["unit_axis"]) == ("gelu", 64, 2)
    assert acts["bert.encoder.layer.0.attention.self.query"]["kind"] == "linear"
    m = metrics(path)
    dead = m.filter((pl.col("layer") == act) & (pl.col("stream") == "activation"))
    assert dead["step"].to_list() == [1, 2, 4, 6] and set(dead["dead_fraction"]) == {5 / 64}
    grads = m.filter(pl.col("stream") == "param_grad")
    assert sorted(set(grads["step"])) == list(range(1, 7)) and grads["grad_norm"].drop_nulls().len() > 0
    scalars = [r for r in actrace.read_table(path).to_pylist() if r["stream"] == "scalar"]
    logged = {(e["step"], "loss"): e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert sorted(logged) == [(2, "loss"), (4, "loss"), (6, "loss")]  # the Trainer's own step numbers
    assert {(r["step"], r["layer"]): r["value"] for r in scalars if r["layer"] == "loss"} == logged
    assert {r["layer"] for r in scalars} >= {"loss", "lr", "grad_norm"}

    torch_run = tmp_path / "torch.parquet"  # the same model trained in a hand-written loop
    model = tiny_bert()
    probe = {k: torch.stack([ds[i][k] for i in range(16)]) for k in ("input_ids", "attention_mask")}
    with Monitor(model, probe, torch_run, run="bert-loop") as mon:
        mon.probe_reading(0)
    res = cli("report", path, torch_run, "-o", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr
    assert "bert-trainer" in (tmp_path / "r.html").read_text() and "bert-loop" in (tmp_path / "r.html").read_text()


def lit_cnn(fail_at: int | None = None):
    import lightning as L

    class Module(L.LightningModule):
        """A small CNN with 3 of 8 channels killed (far-negative bias) for every input."""

        def __init__(self, lr: float = 0.01):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
            with torch.no_grad():
                self.net[0].bias[:3] = -50.0
            self.losses = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            if i == fail_at:
                raise RuntimeError("planted failure")
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
    return Module()


def fit(tmp_path, module, steps=5):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from actrace.adapters.lightning import TraceCallback

    torch.manual_seed(0)
    x, y = torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[TraceCallback(probe=x[:16], out=tmp_path / "lit.parquet", probe_every=2, run="lit")])
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    return tmp_path / "lit.parquet"


def test_a_lightning_run_is_recorded_with_its_kinds_and_killed_channels_dead(tmp_path, cli):
    module = lit_cnn()
    path = fit(tmp_path, module)
    assert validate(path) == []
    meta = metadata.read(path)
    assert meta["status"] == "complete" and '"lr": 0.01' in meta["config"]
    acts = _acts(path)
    assert (acts["net.0"]["kind"], acts["net.0"]["unit_axis"], acts["net.0"]["units"]) == ("conv", 1, 8)
    m = metrics(path)
    relu = m.filter((pl.col("layer") == "net.1") & (pl.col("stream") == "activation"))
    assert relu["step"].to_list() == [0, 2, 4] and set(relu["dead_fraction"]) == {3 / 8}
    assert sorted(set(m.filter(pl.col("stream") == "param_grad")["step"])) == list(range(5))
    scalars = [r for r in actrace.read_table(path).to_pylist() if r["stream"] == "scalar"]
    assert [r["value"] for r in scalars if r["layer"] == "loss"] == pytest.approx(module.losses)  # steps 0 … 4
    assert [(r["step"], r["value"]) for r in scalars if r["layer"] == "lr"] == [(s, 0.01) for s in range(5)]
    with Monitor(lit_cnn(), torch.randn(16, 3, 8, 8), tmp_path / "loop.parquet", run="cnn-loop") as mon:
        mon.probe_reading(0)  # the same module in a hand-written loop
    res = cli("report", path, tmp_path / "loop.parquet", "-o", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr
    assert all(f'"{run}"' in (tmp_path / "r.html").read_text() for run in ("lit", "cnn-loop"))


def test_a_lightning_run_that_raises_keeps_its_readings_and_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="planted failure"):
        fit(tmp_path, lit_cnn(fail_at=3))
    path = tmp_path / "lit.parquet"
    assert metadata.read(path)["status"] == "failed: RuntimeError"
    assert sorted({r["step"] for r in actrace.read_table(path).to_pylist()}) == [0, 1, 2]


DDP = """
import sys, torch, lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from actrace.adapters.lightning import TraceCallback

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        with torch.no_grad():
            self.net[0].bias[:5] = -50.0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay: the readings compare

if __name__ == "__main__":
    torch.manual_seed(1)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    torch.save(x[:32], sys.argv[2] + ".probe.pt")
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[TraceCallback(probe=x[:32], out=sys.argv[2], probe_every=1, run="lit-ddp")])
    trainer.fit(Module(), DataLoader(TensorDataset(x, y), batch_size=8))
"""


def test_lightning_under_ddp_writes_once_what_one_process_reads(tmp_path):
    """Two CPU ranks (gloo): each reads half of the probe, rank 0 writes the merged readings."""
    import subprocess
    import sys

    import numpy as np

    (tmp_path / "ddp.py").write_text(DDP)
    out = tmp_path / "ddp.parquet"
    res = subprocess.run([sys.executable, "ddp.py", "2", str(out)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=HUNG)
    assert res.returncode == 0, res.stderr[-3000:]
    assert validate(out) == [] and not list(tmp_path.glob("*.parquet.parts"))
    sys.path.insert(0, str(tmp_path))
    try:
        from ddp import Module
    finally:
        sys.path.remove(str(tmp_path))
    with Monitor(Module(), torch.load(str(out) + ".probe.pt"), tmp_path / "one.parquet") as mon:
        mon.probe_reading(0)
    one = {r["layer"]: r for r in actrace.read_table(tmp_path / "one.parquet").to_pylist()}
    two = {r["layer"]: r for r in actrace.read_table(out).to_pylist() if r["stream"] == "activation" and r["step"] == 0}
    assert one.keys() == two.keys() == {"net.0", "net.1", "net.2"}
    for layer, r in one.items():
        assert (two[layer]["count"], two[layer]["unit_zero"]) == (r["count"], r["unit_zero"]), layer
        np.testing.assert_allclose(two[layer]["unit_sum"], r["unit_sum"], rtol=1e-5, atol=1e-6, err_msg=layer)
    assert metrics(out).filter(pl.col("layer") == "net.1")["dead_fraction"].unique().to_list() == [5 / 16]
