"""Sharded training read as one model: FSDP2 (`fully_shard`), FSDP1, tensor parallel (alone, inside
FSDP or inside pipeline stages on a 2-D mesh), eager and compiled, pipeline stages and experts placed
on ranks, under `torchrun` with two or four CPU ranks (gloo) against one process on the same weights
and batch. Gradients and parameters are read from their local shards, reduced across ranks, never
gathered; a tensor-parallel layer's units from each rank's slice, joined in unit order."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import numpy as np
import polars as pl
import pytest

import actrace
from actrace.analyzer.metrics import metrics
from actrace.format import metadata
from actrace.files.validate import validate

from conftest import HUNG, LEAVE

# three steps, readings between each backward and optimizer step (the next forward must see the step's
# weights); the script before sets model, watched, probe, train and the Monitor's options
TRAIN = textwrap.dedent("""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(watched, probe, out, param_every=1, **options) as mon:
            for step in range(3):
                train()
                mon.step(step)
                opt.step()
                opt.zero_grad()
    told = [str(w.message) for w in said if "actrace" in str(w.message)]
    assert told == [], told
    if how != "one":
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
""")

SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    from actrace.adapters.torch import Monitor

    out, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias[:4] = -100.0  # 4 of 16 units dead for every input
    probe, x, y = torch.randn(9, 8), torch.randn(16, 8), torch.randn(16, 3)  # 5 and 4 probe rows per rank
    if how.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        fully_shard(model[0])
        fully_shard(model)  # the root's own unit: the other linears, kept whole after a forward
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]  # FSDP averages the ranks' gradients: the batch's
    if how.startswith("fsdp1"):  # two units: the middle linear, and the rest under the root (the default:
        # each unit's parameters flattened into one, `use_orig_params=True`: each still a parameter)
        import functools
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
        dist.init_process_group("gloo")
        wrap = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is model[2])
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=wrap,
                                         use_orig_params=how == "fsdp1")
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    if how == "hsdp":  # FSDP2 on a 2 x 2 mesh: parameters sharded within pairs, replicated across them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        x, y = x.chunk(4)[dist.get_rank()], y.chunk(4)[dist.get_rank()]
    if how.startswith("2d"):  # a 2 x 2 mesh: FSDP2 over two data-parallel pairs, each pair tensor parallel
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model[0], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh["dp"].get_local_rank()
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]
    if how.startswith("tp"):  # every rank the whole batch, each a slice of the linears' units
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        local = how != "tp-dtensor"  # else the ReLU between gets and gives a DTensor
        parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=local),
                                         "2": RowwiseParallel(input_layouts=Shard(-1))})
    if how.endswith("compile"):
        model = torch.compile(model)
    watched, train = model, lambda: ((model(x) - y) ** 2).mean().backward()
    if how.startswith("pp") or how == "staged-tp":  # two stages: layers 0-1, then 2-4; the same probe on both
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        dist.init_process_group("gloo")
        rank, group = dist.get_rank(), None
        if how == "staged-tp":  # 4 ranks: each stage on two, its linears' units split between them
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
            rank, group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(),  # hands on its slice to stage 1
                                                   "2": RowwiseParallel(input_layouts=Shard(-1))})
        model = model[:2] if rank == 0 else model[2:] if how != "pp-renumbered" else nn.Sequential(*model[2:])  # 0-2
        watched = PipelineStage(model, rank, 2, torch.device("cpu"), group=group)
        schedule = ScheduleGPipe(watched, n_microbatches=4, loss_fn=lambda out, y: ((out - y) ** 2).mean())
        train = (lambda: schedule.step(x)) if rank == 0 else (lambda: schedule.step(target=y))
    options = dict(probe_every=2, probe_chunk=4)  # 2 chunks each
""") + TRAIN


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(d, script: str, hows, ranks: int = 2) -> str:
    """`script` in `d` as one process ("one") and under torchrun on `ranks` ranks for each of
    `hows`, each writing `d/HOW.parquet`; what the ranks printed."""
    (d / "run.py").write_text(script + LEAVE)
    subprocess.run([sys.executable, d / "run.py", d / "one.parquet", "one"], check=True, timeout=HUNG)
    printed = ""
    for how in hows:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                               "--master_addr", "127.0.0.1", "--master_port", _port(), d / "run.py", d / f"{how}.parquet", how],
                              timeout=HUNG, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        printed += done.stdout
    return printed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    hows = ("fsdp2", "tp", "fsdp2-compile", "tp-compile", "tp-dtensor", "pp", "fsdp1", "fsdp1-flat")
    launch(d, SCRIPT, hows)
    return (d / "one.parquet", *(d / f"{how}.parquet" for how in hows))


def same_per_unit(one: dict, other: dict) -> None:
    """Every reading of `one` in `other`: the same shape and counts, per-unit sums and extremes
    within float tolerance (sums over ranks add in another order)."""
    for key, a in one.items():
        b = other[key]
        assert (a["shape"], a["units"], a["count"], a["unit_count"]) == (b["shape"], b["units"], b["count"],
                                                                          b["unit_count"]), key
        for name in ("unit_sum", "unit_sumsq", "unit_min", "unit_max"):
            np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=f"{key} {name}")


def _rows(path):
    return {(r["step"], r["stream"], r["layer"], r["param"]): r for r in actrace.read_table(path).to_pylist()}


def read_as_one(d, how: str) -> dict:
    """The rows of `d/HOW.parquet`, once it is checked to be one valid trace holding every reading
    of `d/one.parquet` (activations, gradients, parameters) and no other, each at the same depth,
    of the same kind and counts, and its sums, extremes and update norms within float tolerance."""
    one, other = _rows(d / "one.parquet"), _rows(d / f"{how}.parquet")
    assert validate(d / f"{how}.parquet") == [] and sorted(other) == sorted(one)
    assert {s for _, s, _, _ in one} == {"activation", "param_grad", "param"}
    same_per_unit({k: r for k, r in one.items() if r["unit_max"] is not None}, other)
    for key, a in one.items():
        for name in ("layer_index", "kind", "count", "zero_count"):
            assert other[key][name] == a[name], (key, name)
        for name in ("sum", "sumsq", "min", "max", "update_norm"):
            if a[name] is not None:
                np.testing.assert_allclose(other[key][name], a[name], rtol=1e-5, atol=1e-6, err_msg=f"{key} {name}")
    return other


SHARDED = {"fsdp2": 1, "tp": 2, "fsdp2-compile": 3, "tp-compile": 4, "tp-dtensor": 5, "pp": 6, "fsdp1": 7, "fsdp1-flat": 8}


@pytest.mark.parametrize("how", SHARDED)
def test_a_sharded_run_is_one_trace_that_reads_as_one_process(runs, how):
    """FSDP2 and FSDP1 with and without its original parameters (each rank its share of the probe,
    its shards of the parameters: a FlatParameter's pieces for FSDP1), tensor parallel
    (column- then row-parallel linears: each rank the whole probe and a slice of the units; their
    outputs local or DTensors), eager or under `torch.compile`, and a pipeline of two stages (each
    rank its own layers, the probe handed from stage to stage): every reading, its depth in forward
    order and its activations per unit in the model's unit order included, equals one process's on
    the same weights and batch."""
    path = runs[SHARDED[how]]
    one, sharded = _rows(runs[0]), _rows(path)
    assert validate(path) == [] and sorted(path.parent.glob("*.parquet*")) == sorted(runs)  # one trace each
    assert sorted(one) == sorted(sharded)
    assert {s for _, s, _, _ in one} == {"activation", "param_grad", "param"}
    for key, a in one.items():
        b = sharded[key]
        same = ("shape", "count", "units", "nan_count", "zero_count", "layer_index", "kind")
        assert [a[f] for f in same] == [b[f] for f in same], key
        for name in ("sum", "sumsq", "min", "max", "update_norm"):
            if a[name] is not None:
                np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7, err_msg=f"{key} {name}")
        if a["unit_max"] is not None:  # activations: per unit, in the model's order
            for name in ("unit_max", "unit_min", "unit_sum", "unit_sumsq"):
                np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=f"{key} {name}")
            assert (a["unit_zero"], a["unit_count"]) == (b["unit_zero"], b["unit_count"]), key


def test_tensor_parallel_inside_fsdp_or_pipeline_stages_on_a_2d_mesh_reads_as_one_process(tmp_path):
    """Four ranks on a 2 x 2 mesh whose pairs split the linears' units: FSDP2 over two data-parallel
    pairs (each pair reads its share of the probe, joins its slices in unit order, and the pairs'
    shares merge), eager and compiled, and two pipeline stages of a pair each (the probe handed on
    from pair to pair), and FSDP2 sharding within pairs and replicating across them (HSDP): every
    reading equals one process's, and the units killed by their bias (all on one rank's slice) read
    4 of 16 dead."""
    hows = ("2d", "2d-compile", "staged-tp", "hsdp")
    launch(tmp_path, SCRIPT, hows, ranks=4)
    for how in hows:
        read_as_one(tmp_path, how)
        table = metrics(tmp_path / f"{how}.parquet")
        dead = table.filter((pl.col("layer") == "1") & (pl.col("stream") == "activation"))["dead_fraction"]
        assert dead.to_list() == [4 / 16] * 2


LLAMA_MODEL = textwrap.dedent("""
    import sys, warnings
    import torch, torch.distributed as dist
    import transformers
    from actrace.adapters.torch import Monitor

    out, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa"))
    with torch.no_grad():
        model.model.layers[1].mlp.gate_proj.weight[40:] = 0.0  # 24 of 64 units silent: rank 1's slice under TP
""")


LLAMA_FSDP = LLAMA_MODEL + textwrap.dedent("""
    ids, probe = torch.randint(0, 64, (4, 10)), torch.randint(0, 64, (3, 10))
    if how != "one":  # each rank half the batch; FSDP averages the ranks' gradients: the batch's
        dist.init_process_group("gloo")
        ids = ids.chunk(dist.get_world_size())[dist.get_rank()]
        if how == "fsdp2":  # each decoder layer a unit; the embeddings, norm and head in the root's
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer
            model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=how == "fsdp1",
                                             auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    watched, probe, options = model, {"input_ids": probe}, dict(probe_every=1)
    train = lambda: model(input_ids=ids, labels=ids).loss.backward()
""") + TRAIN


def test_hugging_face_llama_under_fsdp2_and_fsdp1_trains_and_reads_as_one_process(tmp_path):
    """Hugging Face's Llama trained three steps under FSDP2 (a unit per decoder layer, the embeddings,
    norm and head in the root's) and FSDP1 (with and without its original parameters), a probe
    reading between each backward and optimizer step: every reading, the parameters after each step
    and the 24 gate units silenced at the start included, equals one process's (a root left gathered
    by the probe would have run the next step on the weights before the last)."""
    hows = ("fsdp2", "fsdp1", "fsdp1-flat")
    launch(tmp_path, LLAMA_FSDP, hows)
    for how in hows:
        rows = read_as_one(tmp_path, how)
        gate = rows[(0, "activation", "model.layers.1.mlp.gate_proj", None)]  # silent until the first step
        assert np.all(np.asarray(gate["unit_max"])[40:] == 0) and np.all(np.asarray(gate["unit_max"])[:40] > 0)


def test_dead_units_of_a_sharded_model_read_as_one_processs(runs):
    """The 4 units killed by their bias are all on rank 0's slice under tensor parallel: joined in
    unit order, the layer is 4 of 16 dead, as in one process."""
    dead = [metrics(p).filter((pl.col("layer") == "1") & (pl.col("stream") == "activation"))["dead_fraction"].to_list()
            for p in runs[:3]]
    assert dead[0] == dead[1] == dead[2] and dead[0][0] == 4 / 16


LLAMA = LLAMA_MODEL + textwrap.dedent("""
    ids = torch.randint(0, 64, (3, 10))
    if how == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        dist.init_process_group("gloo")
        plan = {f"model.layers.*.{m}": ColwiseParallel() for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                                    "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
        plan |= {"model.layers.*.self_attn.o_proj": RowwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}
        parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), plan)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(model, {"input_ids": ids}, out, grad_every=None) as mon:
            mon.probe_reading(0)
    told = sorted({str(w.message) for w in said if "actrace" in str(w.message) and "gradient" not in str(w.message)})
    print("TOLD", told)
    if how == "tp":
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    printed = launch(d, LLAMA, ("tp",))
    return d / "one.parquet", d / "tp.parquet", printed


def test_a_tensor_parallel_llama_reads_its_layers_as_one_process_and_says_what_it_cannot_place(llama_runs):
    """Hugging Face's Llama under a column/row-parallel plan (q, k, v, gate, up column; o, down
    row): every layer reading, the SiLU of the split gate and the product's inputs included, equals
    one process's per unit in unit order; the gate units silenced on rank 1's slice read silent at
    their global indices; the derived readings (heads split across ranks) are said once and left out."""
    one_path, tp_path, stdout = llama_runs
    one = {k: r for k, r in _rows(one_path).items() if not r["kind"].startswith(("attention_", "log_z", "max_logit"))}
    tp = _rows(tp_path)
    assert validate(tp_path) == [] and sorted(tp) == sorted(one)
    same_per_unit(one, tp)
    gate = tp[(0, "activation", "model.layers.1.mlp.gate_proj", None)]
    assert np.all(np.asarray(gate["unit_max"])[40:] == 0) and np.all(np.asarray(gate["unit_max"])[:40] > 0)
    assert stdout.count("derived readings (attention heads, log Z, experts) are not read") == 1  # rank 0 or 1 once


def test_a_slice_is_carried_by_elementwise_ops_alone():
    """A column-parallel slice of 8 of 16 units at offset 8: an elementwise op (ReLU, a product
    with another of the same slice, a dtype change) keeps it; an op across units (softmax, a sum,
    a matmul) or one that broadcasts it to a new shape makes its result unplaceable."""
    import torch

    from actrace.adapters.torch.shards import UNPLACED, Shards

    shards, x = Shards(), torch.randn(4, 8)
    shards.tags[x] = (1, 8, 16)
    other = torch.randn(4, 8)
    shards.tags[other] = (1, 8, 16)
    kept = {"relu": torch.relu(x), "mul": x * other, "to": x.double()}
    for name, out in kept.items():
        shards.follow(name, (x, other) if name == "mul" else (x,), {}, out)
        assert shards.of(out) == (1, 8, 16), name
    lost = {"softmax": (torch.softmax(x, -1), (x,)), "sum": (x.sum(-1), (x,)), "matmul": (x @ torch.eye(8), (x,)),
            "add": (x[None] + torch.zeros(3, 4, 8), (x,))}
    for name, (out, args) in lost.items():
        shards.follow(name, args, {}, out)
        assert shards.of(out) == UNPLACED, name


SEQUENCE = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from torch import nn
    from actrace.adapters.torch import Monitor

    out, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.LayerNorm(16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    ids = torch.randint(0, 64, (3, 8))
    if how == "sp":  # Megatron's sequence parallel: the norm on each rank's positions, the linears on its units
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       parallelize_module)
        dist.init_process_group("gloo")
        parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), {
            "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), "1": SequenceParallel(),
            "2": ColwiseParallel(input_layouts=Shard(1)), "4": RowwiseParallel(output_layouts=Shard(1))})
    with Monitor(model, ids, out, grad_every=None) as mon:
        mon.probe_reading(0)
    if how == "sp":
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
""")


def test_a_sequence_parallel_norm_merges_over_positions_between_split_linears(tmp_path):
    """Embedding (row parallel, reduce-scattered over positions), a LayerNorm on each rank's 4 of 8
    positions, column- then row-parallel linears: every reading, per unit, equals one process's,
    the norm's merged over the ranks' positions into its whole [3, 8, 16]."""
    launch(tmp_path, SEQUENCE, ("sp",))
    one, sp = _rows(tmp_path / "one.parquet"), _rows(tmp_path / "sp.parquet")
    assert sorted(one) == sorted(sp) and len(one) == 5
    same_per_unit(one, sp)
    assert sp[(0, "activation", "1", None)]["shape"] == [3, 8, 16]


UNEVEN = textwrap.dedent("""
    import sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    from actrace.adapters.torch import Monitor

    out, how = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 3), nn.ReLU())
    if how == "tp":  # 3 units over 4 ranks: 1, 1, 1 and none
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        dist.init_process_group("gloo")
        parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), {"0": ColwiseParallel()})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(model, torch.randn(6, 8), out, grad_every=None) as mon:
            mon.probe_reading(0)
    assert not [w for w in said if "skipping" in str(w.message)], [str(w.message) for w in said]
    if how == "tp":
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
""")


def test_more_ranks_than_units_join_the_slices_the_others_hold(tmp_path):
    """Column parallel over 4 ranks of a 3-unit layer: one rank holds none, says nothing, and the
    three slices join into the layer one process reads."""
    launch(tmp_path, UNEVEN, ("tp",), ranks=4)
    one, tp = _rows(tmp_path / "one.parquet"), _rows(tmp_path / "tp.parquet")
    assert sorted(one) == sorted(tp) and len(one) == 2
    same_per_unit(one, tp)



def test_pipeline_stages_that_renumber_the_models_layers_are_told_at_the_start(tmp_path):
    """A stage rebuilt from the model's layers (`nn.Sequential(*model[2:])`: named 0-2 again) reads
    names the other stage reads too: the Monitor refuses at construction, naming them and the fix."""
    (tmp_path / "run.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", _port(), tmp_path / "run.py", tmp_path / "a.parquet",
                           "pp-renumbered"], timeout=HUNG, capture_output=True, text=True)
    assert done.returncode != 0
    assert "2 reading name(s) are read in more than one pipeline stage (0, 1)" in done.stderr, done.stderr[-3000:]
    assert not list(tmp_path.glob("a.parquet*"))


PIPELINE_LLAMA = textwrap.dedent("""
    import sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    import transformers
    from actrace.adapters.torch import Monitor

    class Part(nn.Module):
        '''The layers of Hugging Face's Llama a stage holds (the others None), under the model's names.'''
        def __init__(self, lm, first, last):
            super().__init__()
            self.model, self.lm_head, self.first, self.last = lm.model, lm.lm_head if last else None, first, last
        def forward(self, x):
            m = self.model
            h = m.embed_tokens(x) if self.first else x
            position = torch.arange(h.shape[1])[None]
            rope = m.rotary_emb(h, position)
            for layer in m.layers:
                if layer is not None:
                    h = layer(h, position_embeddings=rope, position_ids=position)
            return self.lm_head(m.norm(h)) if self.last else h

    out, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", use_cache=False))
    with torch.no_grad():
        lm.model.layers[1].mlp.gate_proj.weight[40:] = 0.0  # 24 of 64 gate units silent: on stage 1
    probe, ids = torch.randint(0, 64, (3, 10)), torch.randint(0, 64, (4, 10))
    loss = lambda logits, labels: nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    watched, model, train = lm, lm, lambda: loss(lm(ids).logits, ids).backward()
    if how == "pp":  # embeddings and layer 0 on rank 0; layer 1, the norm and the head on rank 1
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        lm.model.layers[1 - rank] = None
        if rank == 0:
            lm.model.norm = None
        else:
            lm.model.embed_tokens = None
        model = Part(lm, rank == 0, rank == 1)
        watched = PipelineStage(model, rank, 2, torch.device("cpu"))
        schedule = ScheduleGPipe(watched, n_microbatches=2, loss_fn=loss)
        train = (lambda: schedule.step(ids)) if rank == 0 else (lambda: schedule.step(target=ids))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(watched, probe, out, probe_every=2, param_every=1, logits="lm_head") as mon:  # not HF's own
            for step in range(3):
                train()
                mon.step(step)
                opt.step()
                opt.zero_grad()
    print("TOLD", sorted({str(w.message) for w in said if "actrace" in str(w.message)}))
    if how == "pp":
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
""")


def test_a_pipeline_of_llama_stages_reads_as_one_process(tmp_path):
    """Hugging Face's Llama in two pipeline stages (GPipe, two microbatches), each stage holding
    its layers under the model's names: one trace whose every reading (activations per unit, the
    attention's derived readings, gradients, parameters and update norms) and depth equals one
    process's on the same weights and batch; the gate units silenced in stage 1 read silent."""
    printed = launch(tmp_path, PIPELINE_LLAMA, ("pp",))
    pp = read_as_one(tmp_path, "pp")
    gate = np.asarray(pp[(0, "activation", "model.layers.1.mlp.gate_proj", None)]["unit_max"])
    assert np.all(gate[40:] == 0) and np.all(gate[:40] > 0)
    assert printed.count("TOLD []") == 2, printed


EXPERTS = textwrap.dedent("""
    import sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    from actrace.adapters.torch import Monitor

    class SparseMoeBlock(nn.Module):
        '''Top-2 of 4 experts; under expert parallel each rank holds two of them and runs them on the
        tokens of every rank (gathered, and the outputs summed back, by differentiable all-reduces).'''
        def __init__(self, rank, world):
            super().__init__()
            self.rank, self.world = rank, world
            self.gate = nn.Linear(8, 4)
            self.experts = nn.ModuleDict({str(e): nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                                          for e in range(4)})
        def spread(self, t):  # every rank's rows, in rank order
            if self.world == 1:
                return t
            from torch.distributed.nn.functional import all_reduce
            whole = t.new_zeros(len(t) * self.world, *t.shape[1:])
            return all_reduce(whole.index_copy(0, torch.arange(len(t)) + self.rank * len(t), t))
        def forward(self, x):
            weight, chosen = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
            x, weight, chosen = self.spread(x), self.spread(weight), self.spread(chosen.float()).long()
            out = torch.zeros_like(x)
            for e, expert in self.experts.items():
                token, slot = (chosen == int(e)).nonzero(as_tuple=True)
                out = out.index_add(0, token, expert(x[token]) * weight[token, slot, None])
            if self.world > 1:
                from torch.distributed.nn.functional import all_reduce
                out = all_reduce(out).chunk(self.world)[self.rank]
            return out

    out, how = sys.argv[1], sys.argv[2]
    rank, world = 0, 1
    if how == "ep":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SparseMoeBlock(rank, world))
    moe = model[1]
    with torch.no_grad():
        moe.gate.bias[3] = -100.0                       # expert 3 (rank 1's) never chosen
        moe.experts["2"][0].bias[:4] = -100.0           # 4 of expert 2's 16 units dead (rank 1's)
    if how == "ep":
        for e in list(moe.experts):
            if int(e) // 2 != rank:
                del moe.experts[e]
    probe, x, y = torch.randn(8, 8), torch.randn(16, 8), torch.randn(16, 8)
    if how == "ep":
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replicated = [p for n, p in model.named_parameters() if "experts" not in n]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Monitor(model, probe, out, probe_every=2, param_every=1) as mon:
            for step in range(3):
                (((model(x) - y) ** 2).sum() / 16).backward()
                if how == "ep":
                    for p in replicated:
                        dist.all_reduce(p.grad)
                mon.step(step)
                opt.step()
                opt.zero_grad()
    print("TOLD", sorted({str(w.message) for w in said if "actrace" in str(w.message)}))
    if how == "ep":
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
""")


def test_experts_placed_on_ranks_read_as_one_process(tmp_path):
    """Expert parallel: four experts, two a rank, each run on the tokens every rank's router sent
    it. Every reading (each expert's layers under its own name from the rank that holds it, the
    router's per-expert token counts merged over the ranks' probe shares, gradients and update
    norms) equals one process's, in its forward order; the expert no token reaches reads 0 tokens
    and is said once, by its rank; the units killed by their bias in another read dead."""
    printed = launch(tmp_path, EXPERTS, ("ep",))
    ep = read_as_one(tmp_path, "ep")
    load = ep[(0, "activation", "1.expert_load", None)]["unit_sum"]
    assert load[3] == 0 and min(load[:3]) > 0 and sum(load) == 8 * 2  # 8 probe tokens, top-2
    relu = np.asarray(ep[(0, "activation", "1.experts.2.1", None)]["unit_max"])
    dead = [metrics(p).filter((pl.col("layer") == "1.experts.2.1") & (pl.col("step") == 0))["dead_fraction"].item()
            for p in (tmp_path / "one.parquet", tmp_path / "ep.parquet")]
    assert np.all(relu[:4] == 0) and dead[0] == dead[1] >= 4 / 16
    said = [line for line in printed.splitlines() if line.startswith("TOLD")]
    assert sorted(said) == sorted(["TOLD []", "TOLD [" + ", ".join(
        repr(f"actrace: skipping 1.experts.3.{i}: an empty output (an expert no probe token reached?) holds no value")
        for i in range(3)) + "]"]), said
