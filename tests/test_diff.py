"""`actrace diff` on runs whose parting is known by construction: the same seed and data until step
K, then the learning rate ×20, parts at K; two seeds of one config never part; a PyTorch run and
its ONNX export do not part, and layers only one of them reads are named."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from actrace.adapters.torch import Monitor

K, STEPS, PROBE_EVERY = 100, 200, 10


def train(path, *, seed=0, jump_at=None, nan_at=None, export=None):
    """A ReLU MLP on a fixed teacher task; `seed` draws its initialization and its batches; a NaN
    planted in the second Linear's weight at step `nan_at` makes it and all after it NaN."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1234)
    teacher, probe = torch.randn(16, 4, generator=g), torch.randn(128, 16, generator=g)
    batches = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Monitor(model, probe, path, probe_every=PROBE_EVERY, run=path.stem) as mon:
            for step in range(STEPS + 1):
                if step == jump_at:
                    for group in opt.param_groups:
                        group["lr"] *= 20
                if step == nan_at:
                    with torch.no_grad():
                        model[2].weight[0, 0] = float("nan")
                x = torch.randn(32, 16, generator=batches)
                loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
                opt.zero_grad()
                loss.backward()
                mon.step(step)
                mon.log(step, loss=loss)
                if export is not None and step % 50 == 0:
                    model.eval()
                    torch.onnx.export(model, (probe[:2],), export / f"step_{step}.onnx", input_names=["x"],
                                      dynamic_axes={"x": {0: "batch"}}, dynamo=False)
                    model.train()
                opt.step()
    return probe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("diff")
    (d / "onnx").mkdir()
    probe = train(d / "base.parquet", export=d / "onnx")
    for seed in (1, 2):
        train(d / f"seed{seed}.parquet", seed=seed)
    train(d / "lr20.parquet", jump_at=K)
    train(d / "nan.parquet", nan_at=K)
    import numpy as np

    from actrace.adapters.onnx import record_onnx

    np.save(d / "probe.npy", probe.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record_onnx(sorted((d / "onnx").glob("*.onnx")), d / "probe.npy", d / "onnx.parquet", run="onnx",
                    op_types=["Relu", "Gemm"], progress=False)
        record_onnx(sorted((d / "onnx").glob("*.onnx")), d / "probe.npy", d / "relus.parquet", run="relus",
                    op_types=["Relu"], progress=False)
    return d


def test_a_raised_learning_rate_parts_where_it_was_raised_and_exits_one(runs, cli):
    res = cli("diff", runs / "base.parquet", runs / "lr20.parquet", "--format", "json")
    assert res.returncode == 1, res.stderr
    answer = json.loads(res.stdout)
    first = answer["first"]["lr20"]
    assert K <= first["step"] <= K + PROBE_EVERY  # the same run until K: it parts at K, ± one reading
    assert all(p["step"] >= K for p in answer["partings"])  # and nowhere before
    assert {p["metric"] for p in answer["partings"]} >= {"grad_norm", "update_ratio"}
    text = cli("diff", runs / "base.parquet", runs / "lr20.parquet").stdout
    assert text.startswith(f"lr20 parts from base at step {first['step']} in {first['layer']}: ")


def test_a_run_gone_nan_parts_where_its_first_nan_is_read(runs, cli):
    """The same run as the baseline until a NaN is planted in layer 2's weight at step K: from then
    the outputs of layer 2 and all after it, and every gradient, hold NaN, where the baseline's hold
    none. Their metrics are unknown there, yet the run parts at step K, there and only there."""
    res = cli("diff", runs / "base.parquet", runs / "nan.parquet", "--format", "json")
    assert res.returncode == 1, res.stderr
    answer = json.loads(res.stdout)
    first = answer["first"]["nan"]
    assert (first["metric"], first["step"], first["baseline_value"]) == ("non_finite", K, 0) and first["value"] > 0
    nan = {(p["stream"], p["layer"]): p["step"] for p in answer["partings"] if p["metric"] == "non_finite"}
    # at K: the outputs from layer 2 on and every gradient; layers 0 and 1 once the NaN step updated them
    assert {layer for (stream, layer), step in nan.items() if stream == "activation" and step == K} == {"2", "3", "4"}
    assert {nan[("activation", "0")], nan[("activation", "1")]} == {K + PROBE_EVERY}, nan
    assert {layer for (stream, layer), step in nan.items() if stream == "param_grad" and step == K} == {"0", "2", "4"}
    assert all(p["step"] >= K for p in answer["partings"])
    text = cli("diff", runs / "base.parquet", runs / "nan.parquet").stdout
    assert text.startswith(f"nan parts from base at step {K} in {first['layer']}: NaN/Inf values 0 → "), text


def test_two_seeds_of_one_config_do_not_part(runs, cli):
    for seed in ("seed1", "seed2"):
        res = cli("diff", runs / "base.parquet", runs / f"{seed}.parquet")
        assert res.returncode == 0 and "no parting from the baseline" in res.stdout, res.stdout


def test_seeds_of_the_baseline_make_its_band_and_the_raised_rate_still_parts(runs, cli):
    res = cli("diff", runs / "base.parquet", runs / "seed1.parquet", "--", runs / "lr20.parquet",
              runs / "seed2.parquet", "--format", "json")
    answer = json.loads(res.stdout)
    assert res.returncode == 1 and set(answer["first"]) == {"lr20"}  # seed2 stays inside the seeds' band
    assert K <= answer["first"]["lr20"]["step"] <= K + PROBE_EVERY and answer["first"]["lr20"]["baseline"] == \
        "base,seed1"


def test_a_pytorch_run_and_its_onnx_export_do_not_part_and_unread_layers_are_named(runs, cli):
    res = cli("diff", runs / "base.parquet", runs / "onnx.parquet", runs / "relus.parquet", "--format", "json")
    answer = json.loads(res.stdout)
    assert answer["partings"] == [], answer["partings"]
    assert answer["unaligned"]["onnx"] == [] and set(answer["unaligned"]["relus"]) == {"0", "2", "4"}  # the Gemms
    text = cli("diff", runs / "base.parquet", runs / "relus.parquet").stdout
    assert "not compared: 3 layer(s) only one side has" in text


def test_diff_needs_a_run_to_compare(runs, cli):
    res = cli("diff", runs / "base.parquet")
    assert res.returncode == 2 and "give a baseline and at least one run" in res.stderr


def test_a_run_apart_from_the_start_parts_only_by_moving_further_apart(tmp_path, cli):
    """The baseline's layer grows its spread ×5 over its readings; one run holds it at 50 from the
    first reading, another holds it there and then jumps ×100 at step 100, a third drops there as
    far below the baseline as it was above. All are apart from the start; the first never moves, so
    the gap that narrows as the baseline drifts towards it is no parting of it; the others part
    where they moved."""
    import numpy as np

    import actrace

    def write(name, std):
        rng = np.random.default_rng(0)
        with actrace.Writer(tmp_path / f"{name}.parquet") as w:
            for i, step in enumerate(range(0, 200, 10)):
                w.record_activation(step, "fc", (rng.normal(size=(256, 16)) * std(i)).astype(np.float32),
                                    kind="linear")
    write("base", lambda i: 0.1 * 5 ** (i / 19))
    write("still", lambda i: 50.0)
    write("jumps", lambda i: 50.0 if i < 10 else 5000.0)
    write("crosses", lambda i: 50.0 if i < 10 else 0.0005)  # as far below the baseline as it was above
    still = cli("diff", tmp_path / "base.parquet", tmp_path / "still.parquet")
    assert still.returncode == 0 and still.stdout.startswith("still: no parting from the baseline"), still.stdout
    assert "from the first readings apart" in still.stdout and "std in fc" in still.stdout
    for run in ("jumps", "crosses"):
        said = cli("diff", tmp_path / "base.parquet", tmp_path / f"{run}.parquet")
        assert said.returncode == 1 and said.stdout.startswith(f"{run} parts from base at step 100 in fc: std "), \
            said.stdout


def test_runs_alike_after_their_first_reading_do_not_part_and_a_gradient_gone_to_zero_does(tmp_path, cli):
    """Truth by construction: "near" is the baseline but for its first reading (its spread 2.5× the
    baseline's there); its gap narrows to 0 and stays, which is two runs coming together, no
    parting. "stopped" is the baseline whose fc gradients are exactly 0 from step 100 (a layer cut
    off): a gradient norm of 0 has no logarithm, yet it parts there, said as 0."""
    import numpy as np

    import actrace

    def write(name, first=1.0, stop=None):
        with actrace.Writer(tmp_path / f"{name}.parquet") as w:
            for i, step in enumerate(range(0, 200, 10)):
                rng = np.random.default_rng(step)
                std = 0.05 * (1 + i) * (first if step == 0 else 1.0)
                w.record_activation(step, "fc", (rng.normal(size=(128, 32)) * std).astype(np.float32), kind="linear")
                grad = rng.normal(size=(32, 32)) * 1e-2 * (0.0 if stop is not None and step >= stop else 1.0)
                w.record_param_grad(step, "fc", "weight", grad, kind="linear")
    write("base")
    write("near", first=2.5)
    write("stopped", stop=100)
    near = cli("diff", tmp_path / "base.parquet", tmp_path / "near.parquet")
    assert near.returncode == 0 and near.stdout.startswith("near: no parting from the baseline"), near.stdout
    stopped = cli("diff", tmp_path / "base.parquet", tmp_path / "stopped.parquet")
    assert stopped.returncode == 1 and stopped.stdout.startswith(
        "stopped parts from base at step 100 in fc: gradient norm "), stopped.stdout
    assert " → 0, outside the baseline's band" in stopped.stdout.splitlines()[0]


def test_a_gradient_blip_of_a_few_steps_is_no_parting_and_a_lasting_shift_is(tmp_path, cli):
    """Gradients read every step, the probe every 10: "blip" is the baseline but for its gradients ×4
    at steps 55-57 (three readings in a row: a per-step gradient's noise between seeds), "shift" has
    them ×4 from step 100 on. Only the shift parts, at step 100."""
    import numpy as np

    import actrace

    def write(name, scale=lambda step: 1.0):
        with actrace.Writer(tmp_path / f"{name}.parquet") as w:
            for step in range(200):
                rng = np.random.default_rng(step)
                if step % 10 == 0:
                    w.record_activation(step, "fc", rng.normal(size=(64, 16)).astype(np.float32), kind="linear")
                w.record_param_grad(step, "fc", "weight", rng.normal(size=(16, 16)) * 1e-2 * scale(step), kind="linear")
    write("base")
    write("blip", lambda step: 4.0 if 55 <= step <= 57 else 1.0)
    write("shift", lambda step: 4.0 if step >= 100 else 1.0)
    blip = cli("diff", tmp_path / "base.parquet", tmp_path / "blip.parquet")
    assert blip.returncode == 0 and blip.stdout.startswith("blip: no parting"), blip.stdout
    shift = cli("diff", tmp_path / "base.parquet", tmp_path / "shift.parquet")
    assert shift.returncode == 1 and shift.stdout.startswith("shift parts from base at step 100 in fc: gradient norm"), \
        shift.stdout


def test_a_baseline_seed_whose_gradient_is_zero_does_not_widen_the_band_into_decades(tmp_path, cli):
    """Baseline seeds s1 and s2, s2's layer l1 with exactly 0 gradients (its units all dead in that
    seed); run r is s1 but for l1's gradients ×100 from step 500. The zero seed says nothing of how
    far the live ones spread: r parts at step 500 in l1, as against s1 alone."""
    import numpy as np

    import actrace

    def run(name, seed, l1):
        rng = np.random.default_rng(seed)
        with actrace.Writer(tmp_path / f"{name}.parquet", run=name) as w:
            for step in range(0, 1000, 50):
                for i in range(3):
                    w.record_activation(step, f"l{i}", np.abs(rng.normal(size=(32, 8))).astype(np.float32), kind="relu")
                    w.record_param_grad(step, f"l{i}", "weight", rng.normal(size=(8, 8)) * (l1(step) if i == 1 else 1.0),
                                        kind="relu")
    run("s1", 1, lambda s: 1.0)
    run("s2", 2, lambda s: 0.0)
    run("r", 1, lambda s: 100.0 if s >= 500 else 1.0)
    said = cli("diff", tmp_path / "s1.parquet", tmp_path / "s2.parquet", "--", tmp_path / "r.parquet", "--format", "json")
    parted = {(p["layer"], p["metric"], p["step"]) for p in json.loads(said.stdout)["partings"]}
    assert said.returncode == 1 and ("l1", "grad_norm", 500) in parted, said.stdout
