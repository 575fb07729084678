"""The reduction contract: every backend gives `actrace.reduce.reference`'s statistics.

One set of cases (NaN, ±inf, a unit with no finite value, subnormals, squares past float32,
zeros; every layout; every float dtype; whole and merged halves) runs against each backend
present here: the numpy reference itself (by construction), the C kernel, torch ops with the
kernel off, torch's fused CPU path (and the relu(x) it derives), the GPU's Triton kernel (by
Triton's interpreter where no GPU is), torch on CUDA, ONNX Runtime.
Counts, extremes and histograms must agree exactly; sums to the float32 cascade the spec allows.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from actrace.reduce import kernel
from actrace import ReductionError, merge, reduce_array
from actrace.reduce import Reading, reference
from actrace.format.schema import COLUMNS, MERGE, SAT_COUNTS, bounds_for, sat_thresholds
from conftest import HUNG

LAYOUTS = {"dense": ((6, 5), 1), "nchw": ((6, 3, 4, 2), 1), "nhwc": ((6, 4, 2, 3), -1),
           "sequence": ((6, 7, 5), -1), "whole": ((6, 4), None),
           # partial 8- and 16-column groups and a second block of 64 rows; runs of three 512-value
           # blocks; short runs read over blocks of rows
           "cols-19": ((66, 19), 1), "runs-1100": ((6, 2, 1100), 1), "short-runs": ((70, 3, 2), 1),
           # cut among threads by the kernel
           "large-nchw": ((300, 7, 40), 1), "large-whole": ((1, 70001), None), "large-dense": ((3000, 40), 1)}
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def values(case: str, shape: tuple, dtype) -> np.ndarray:
    """`clean`: normal values with zeros; `hard` adds NaN, ±inf, a unit with no finite value,
    subnormals and values whose float32 squares overflow."""
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x = rng.standard_normal(shape) * 3
    flat = x.reshape(-1)
    flat[::7] = 0.0
    if case == "hard":
        flat[1::11], flat[2::13], flat[3::17] = np.nan, np.inf, -np.inf
        flat[4::19], flat[5::23] = 1e-40, -1e-45
        flat[6::29] = 3e19
        if x.ndim > 1 and x.shape[-1] > 1:
            x[..., -1] = np.nan  # the last unit of the unit-last layouts has no finite value
    with np.errstate(over="ignore"):  # 3e19 is inf in float16, as the backends see it too
        return x.astype(dtype)


def from_reference(x, axis, kind, layer="x") -> Reading:
    bounds = bounds_for(kind)
    return Reading.from_stats(reference(x, axis, bounds=bounds), shape=x.shape, unit_axis=axis,
                              layer=layer, kind=kind, stream="activation", dtype=str(x.dtype), bounds=bounds)


def cascade_error(x: np.ndarray, axis, square: bool) -> np.ndarray:
    """How far a float32 sum (of squares) may stray: runs of up to 64 values summed in float32,
    then in float64 (spec §Numerics), err by at most 64·2⁻²⁴ of the sum of |terms| per unit."""
    clean = np.where(np.isfinite(x), x, 0).astype(np.float64)
    per_unit = clean.reshape(-1, 1) if axis is None else np.moveaxis(clean, axis, -1).reshape(-1, x.shape[axis])
    terms = per_unit ** 2 if square else np.abs(per_unit)
    return 64 * 2.0 ** -24 * terms.sum(axis=0) + 1e-6


def assert_same(got: Reading, want: Reading, x: np.ndarray, axis) -> None:
    for name in ("shape", "units", "unit_axis", "count", "nan_count", "inf_count", "zero_count"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("unit_count", "unit_zero", "hist", "sat_counts", "unit_min", "unit_max", "unit_min_dev"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    np.testing.assert_array_equal([got.min, got.max], [want.min, want.max])
    for name, square in (("unit_sum", False), ("unit_sumsq", True)):
        bound = cascade_error(x.astype(np.float32) if x.dtype.itemsize < 4 else x, axis, square)
        assert np.all(np.abs(getattr(got, name) - getattr(want, name)) <= bound), name
    clean = np.abs(np.where(np.isfinite(x), x, 0).astype(np.float64))
    for name, power in (("sum3", 3), ("sum4", 4)):  # float32 lanes as for the sums, and each power's rounding
        assert abs(getattr(got, name) - getattr(want, name)) <= (64 + 4) * 2.0 ** -24 * (clean ** power).sum() \
            + 1e-6, name


# --- the backends: (values, unit axis, kind, halves) -> Reading ---------------------------------

def numpy_reference(x, axis, kind, halves):
    if halves:
        return merge(from_reference(x[:3], axis, kind), from_reference(x[3:], axis, kind))
    return from_reference(x, axis, kind)


def c_kernel(x, axis, kind, halves):
    if halves:
        return merge(reduce_array(x[:3], axis, kind, layer="x"), reduce_array(x[3:], axis, kind, layer="x"))
    return reduce_array(x, axis, kind, layer="x")


def _torch_reading(x, axis, kind, halves, device, change=None):
    """The torch backend's reading of `x` (its halves merged by the core's `merge`); `change` is
    done to the tensors in place after they were reduced and before the reading reaches the host."""
    import torch

    from actrace.reduce import torch as tr

    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if x.dtype == ml_dtypes.bfloat16 \
        else torch.from_numpy(x)
    parts = [p.to(device) for p in ([t[:3], t[3:]] if halves else [t])]
    pending = [tr.reduce_tensor(p, axis, kind, layer="x") for p in parts]
    for p in parts if change else ():
        change(p)
    readings = tr.to_readings(pending)
    return readings[0] if len(readings) == 1 else merge(*readings)


def torch_ops(x, axis, kind, halves, monkeypatch, change=None):
    monkeypatch.setattr(kernel, "available", False)  # the path any tensor takes where the kernel is not
    return _torch_reading(x, axis, kind, halves, "cpu", change)


def torch_transfer(x, axis, kind, halves, monkeypatch, change=None):
    """`torch_ops` with the statistics moved to the host as a device's are: their bits in one transfer."""
    import torch

    from actrace.reduce import torch as tr

    monkeypatch.setattr(tr, "on_device", lambda v: isinstance(v, torch.Tensor))
    return torch_ops(x, axis, kind, halves, monkeypatch, change)


def triton_kernel(x, axis, kind, halves, monkeypatch, change=None):
    """The GPU's fused kernel (`actrace.reduce.fused`) on CPU tensors, run by Triton's interpreter."""
    import torch

    from actrace.reduce import fused

    monkeypatch.setattr(fused, "usable", lambda t, narrow=False: t.dtype in (torch.float32, torch.float64))
    return torch_transfer(x, axis, kind, halves, monkeypatch, change)


def torch_fused(x, axis, kind, halves, change=None):
    return _torch_reading(x, axis, kind, halves, "cpu", change)


def torch_cuda(x, axis, kind, halves, change=None):
    return _torch_reading(x, axis, kind, halves, "cuda", change)


def onnx_runtime(x, axis, kind, halves, tmp_path):
    """ONNX Runtime computes sigmoid(x) and the adapter reduces that intermediate tensor (unit axis
    as given for the graph input), over the probe's chunks when halved; the reference reduces the
    tensor ORT gives for the whole probe."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from actrace.adapters.onnx import Checkpoint

    elem = TensorProto.FLOAT if x.dtype == np.float32 else TensorProto.DOUBLE
    dims = ["N"] + list(x.shape[1:])
    graph = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["h"], name="h"),
                               helper.make_node("Identity", ["h"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", elem, dims)],
                              [helper.make_tensor_value_info("y", elem, dims)])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    (r,) = Checkpoint(path, input_axes={"x": axis}).read({"x": x}, chunk=3 if halves else len(x))
    (made,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    return r, made, axis


def _missing(*modules: str) -> str | None:
    import importlib.util

    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(absent)} not installed" if absent else None


def _cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device here"


def _interpreted() -> str | None:
    return None if os.environ.get("TRITON_INTERPRET") == "1" else "a GPU is here: torch-cuda reads the kernel"


TRITON_LAYOUTS = [k for k in LAYOUTS if not k.startswith("large")] + ["large-whole"]
NARROW = ("float16", "bfloat16", "float32")  # the kernel reads float32, narrower floats widened
# name: (backend, which (dtype, layout, kind) it reads, why it is absent here or None)
BACKENDS = {
    "numpy-reference": (numpy_reference, lambda d, lay, k: True, None),
    "c-kernel": (c_kernel, lambda d, lay, k: d in NARROW, None if kernel.available else "kernel not built"),
    "torch-ops": (torch_ops, lambda d, lay, k: True, _missing("torch")),
    "torch-transfer": (torch_transfer, lambda d, lay, k: True, _missing("torch")),
    # float32/float64 (narrower floats reach it widened), layouts small enough for the interpreter, and
    # one whose values are cut among programs
    "triton": (triton_kernel, lambda d, lay, k: d in ("float32", "float64") and lay in TRITON_LAYOUTS,
               _missing("torch", "triton") or _interpreted()),
    "torch-fused": (torch_fused, lambda d, lay, k: d in NARROW,
                    _missing("torch") or (None if kernel.available else "kernel not built")),
    "torch-cuda": (torch_cuda, lambda d, lay, k: True, _missing("torch") or _cuda()),
    # a Sigmoid of a graph input: float32/float64
    "onnxruntime": (onnx_runtime, lambda d, lay, k: d in ("float32", "float64") and k == "sigmoid",
                    _missing("onnx", "onnxruntime")),
}


def fixtures(backend: str, monkeypatch, tmp_path=None) -> dict:
    """The pytest fixtures a backend's function takes besides the values: those that switch the
    kernel (or the device) off for the call take `monkeypatch`, ONNX Runtime a folder for its model."""
    if backend in ("torch-ops", "torch-transfer", "triton"):
        return {"monkeypatch": monkeypatch}
    return {"tmp_path": tmp_path} if backend == "onnxruntime" else {}


def combinations():
    """Every (backend, layout, dtype, case, kind, halves) a backend reads; one skip for a backend
    absent here, saying why."""
    for backend, (_, reads, absent) in BACKENDS.items():
        if absent:
            yield pytest.param(backend, None, None, None, None, None, id=f"{backend}-absent",
                               marks=pytest.mark.skip(reason=f"backend {backend}: {absent}"))
            continue
        for layout, (shape, _) in LAYOUTS.items():
            for dtype in DTYPES:
                for case in ("clean", "hard"):
                    for kind in ("linear", "sigmoid"):
                        for halves in (False, True):
                            if reads(dtype, layout, kind) and not (halves and shape[0] < 6):
                                yield pytest.param(backend, layout, dtype, case, kind, halves, id="-".join(
                                    [backend, layout, dtype, case, kind, "halves" if halves else "whole"]))


@pytest.mark.parametrize("backend,layout,dtype,case,kind,halves", list(combinations()))
def test_every_backend_gives_the_reference_statistics(backend, layout, dtype, case, kind, halves, monkeypatch,
                                                     tmp_path):
    shape, axis = LAYOUTS[layout]
    x = values(case, shape, DTYPES[dtype])
    fn = BACKENDS[backend][0]
    got = fn(x, axis, kind, halves, **fixtures(backend, monkeypatch, tmp_path))
    if backend == "onnxruntime":
        got, x, axis = got
    assert_same(got, from_reference(x, axis, kind), x, axis)


def one_sided():
    """Every backend present that takes a float32 tensor in (ONNX Runtime makes its own)."""
    for backend, (_, reads, absent) in BACKENDS.items():
        if backend != "onnxruntime" and not absent and reads("float32", "dense", "sigmoid"):
            yield backend


@pytest.mark.parametrize("backend", list(one_sided()))
def test_a_unit_on_one_side_of_the_centre_stores_its_least_distance_rounded_down(backend, monkeypatch):
    """`unit_min_dev` of a sigmoid (centre 0.5) is the least |h - 0.5|, as float32 rounded down, never
    above it (spec §Numerics): units of tiny values (0.5 - 3e-9 is no float32), of values above the
    centre, and on both sides of it."""
    x = np.array([[1e-9, 0.7, 0.45], [2e-9, 0.8, 0.9], [3e-9, 0.9, 0.6]] * 2, np.float32)
    truth = np.abs(x.astype(np.float64) - 0.5).min(axis=0)
    fn = BACKENDS[backend][0]
    got = fn(x, 1, "sigmoid", False, **fixtures(backend, monkeypatch))
    assert got.unit_min_dev.dtype == np.float32
    np.testing.assert_array_equal(got.unit_min_dev, [np.nextafter(np.float32(t), np.float32(-1)) if np.float32(t) > t
                                                     else np.float32(t) for t in truth])


@pytest.mark.parametrize("backend", list(one_sided()))
def test_float32_values_either_side_of_each_saturation_level_are_counted_as_in_float64(backend, monkeypatch):
    """`sat_counts` compares with each level in float64 whatever the dtype (spec §Columns): the float32
    nearest 0.9 is 0.89999998, below it, so a sigmoid unit of it counts nothing at 0.9, while the
    float32 nearest 0.001 lies above 0.001; every float32 next to each level, on either side of it,
    counted as its float64 value is."""
    levels = np.array(sat_thresholds(bounds_for("sigmoid")))
    near = np.float32(levels)
    x = np.concatenate([near, np.nextafter(near, np.float32(0)), np.nextafter(near, np.float32(1))])[:, None]
    wide, half = x.astype(np.float64), len(SAT_COUNTS) // 2
    assert not np.isin(wide, levels).any()  # no float32 is a level: each is counted on one side of it
    truth = [int((wide <= v).sum()) for v in levels[:half]] + [int((wide >= v).sum()) for v in levels[half:]]
    fn = BACKENDS[backend][0]
    got = fn(np.ascontiguousarray(x), 1, "sigmoid", False, **fixtures(backend, monkeypatch))
    assert got.sat_counts.tolist() == truth

def mutated():
    """(backend, dtype) of every backend that takes a tensor of that dtype in (ONNX Runtime makes its
    own); one skip for a backend absent here."""
    for backend, (_, reads, absent) in BACKENDS.items():
        if backend == "onnxruntime":
            continue
        if absent:
            yield pytest.param(backend, None, id=f"{backend}-absent", marks=pytest.mark.skip(reason=f"{backend}: {absent}"))
            continue
        for dtype in ("float32", "float64", "bfloat16"):
            if reads(dtype, "dense", "linear"):
                yield pytest.param(backend, dtype, id=f"{backend}-{dtype}")


@pytest.mark.parametrize("backend,dtype", list(mutated()))
def test_a_value_changed_in_place_after_it_is_read_is_not_seen(backend, dtype, monkeypatch):
    """Read the moment it is made: a NaN and an Inf the model then cleans in place
    (`nan_to_num_()`) are in the reading, on every backend and device."""
    fn = BACKENDS[backend][0]
    shape, axis = LAYOUTS["dense"]
    x = values("hard", shape, DTYPES[dtype])
    original = x.copy()
    want = from_reference(original, axis, "linear")
    assert want.nan_count and want.inf_count
    extra = fixtures(backend, monkeypatch)
    if backend.startswith("torch") or backend == "triton":  # the tensors read (on the device, or sharing x's memory) cleaned afterwards
        cleaned = []
        got = fn(x, axis, "linear", True, change=lambda t: cleaned.append(t.nan_to_num_(0.0).mul_(3.0)), **extra)
        assert cleaned and not any(t.isnan().any() for t in cleaned)
    else:
        got = fn(x, axis, "linear", True)
        np.copyto(x, np.nan_to_num(x.astype(np.float64), nan=0.0).astype(x.dtype) * 3)
        assert not np.isnan(x.astype(np.float64)).any()  # the array read was cleaned afterwards
    assert_same(got, want, original, axis)


COMPILE = """
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from actrace.reduce import fused

if sys.argv[1] == "totals":  # a per-step gradient reading's, of bfloat16 tensors
    kernel, signature = fused._totals(), {"table_ptr": "*i64", "out_ptr": "*fp64"}
    constants = dict(CHUNK=fused._CHUNK, BLOCK=1024, DTYPE=tl.bfloat16, WIDE=tl.float32)
elif sys.argv[1] == "batch":  # a probe's many tensors, float32, unit last, bounded, with histogram
    kernel, signature = fused._batch(), {"table_ptr": "*i64", "edges_ptr": "*fp32", "words_ptr": "*i64"}
    constants = dict(DTYPE=tl.float32, BLOCK_R=16, BLOCK_U=32, HIST=256, BINS=141, NSAT=6, NLOW=3)
elif sys.argv[1] == "scores":  # an attention's per-head numbers, 12 heads
    kernel = fused._scores()
    signature = {**dict.fromkeys(["x_ptr", "peak_ptr", "entropy_ptr", "sink_ptr"], "*fp32"), "n_ptr": "*i64",
                 **dict.fromkeys(["heads", "queries", "keys", "reach"], "i32"), "lowest": "fp32"}
    constants = dict(BLOCK_H=16, BLOCK_K=256)
else:
    dtype, block_u, bins, nsat = sys.argv[1], *map(int, sys.argv[2:])
    kernel = fused._kernel()
    signature = {"x_ptr": f"*{dtype}", "edges_ptr": f"*{dtype}", "levels_ptr": f"*{dtype}", "out_ptr": "*fp64",
                 "counts_ptr": "*i64", "totals_ptr": "*i64", **dict.fromkeys(["rows", "units", "after", "span"], "i32")}
    constants = dict(BLOCK_R=512 // block_u, BLOCK_U=block_u, HIST=256, BINS=bins, NSAT=nsat, NLOW=nsat // 2)
signature |= dict.fromkeys(constants, "constexpr")
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
print(len(compiled.asm["cubin"]), f".entry {kernel.__name__}" in compiled.asm["ptx"])
"""


@pytest.mark.skipif(_missing("triton") is not None, reason="triton not installed")
@pytest.mark.parametrize("launch", [("fp32", 32, 141, 6), ("fp64", 1, 0, 0), ("batch",), ("totals",), ("scores",)],
                         ids=["unit-last", "unit-inside", "batch", "totals", "scores"])
def test_the_fused_kernels_compile_for_a_gpu_where_none_is(launch, tmp_path):
    """The interpreter that runs the `triton` backend here forgives what a GPU's compiler does not:
    the per-unit kernel, as a unit-last (bounded, with histogram) and a unit-inside reading launch
    it, its batch of many tensors, the per-step gradients' kernel and an attention's per-head numbers'
    are compiled to sm_90 binaries here too (in a process of their own: no interpreter there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE, *map(str, launch)], env=env, capture_output=True,
                          text=True, timeout=HUNG)
    assert done.returncode == 0, done.stderr[-3000:]
    size, entry = done.stdout.split()
    assert int(size) > 0 and entry == "True"


@pytest.mark.parametrize("shape,axis", [((2**31 + 2**20, 1), 1), ((70_000_000, 64), 1), ((4, 1, 2**30), 1)])
def test_the_fused_kernel_s_grid_stays_within_cuda_s_limits_and_covers_every_value(shape, axis, monkeypatch):
    """A tensor of 2³¹ values or more on few units is cut among at most 65,535 programs per unit block
    (CUDA's limit of a grid's second axis), which between them still read every value (meta tensors:
    no memory; the launch recorded, not run)."""
    import torch

    from actrace.reduce import fused

    launched = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, args, kw))

    monkeypatch.setattr(fused, "_kernel", Launcher)
    x = torch.empty(shape, device="meta")
    assert fused.stats(x, axis, None, True) is not None
    (columns, split), args, kw = launched[0]
    rows, units, span = x.numel() // shape[axis], shape[axis], args[9]
    assert split <= 65535 and columns * kw["BLOCK_U"] >= units
    assert split * span >= rows > (split - 1) * span and span % kw["BLOCK_R"] == 0


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k.startswith("large")])
def test_the_large_layouts_are_cut_among_threads(layout):
    from actrace.reduce import view3

    if not kernel.available:
        pytest.skip("the compiled kernel is not built here")
    shape, axis = LAYOUTS[layout]
    assert kernel._Layout(2, (view3(values("hard", shape, np.float32), axis).shape,), ((True, False),)).pieces == 2


def test_the_reference_gives_the_values_planted_in_it():
    """The oracle itself, by construction: NaN, ±inf, zeros and extremes where they were put."""
    x = np.array([[0.0, 2.0, np.nan], [0.0, 0.5, np.nan], [np.inf, -1e-40, np.nan], [-3.0, 3e19, np.nan]])
    st = reference(x, 1, bounds=(0.0, 1.0))
    assert (st["nan_count"], st["inf_count"]) == (4, 1)
    assert st["unit_count"].tolist() == [3, 4, 0] and st["unit_zero"].tolist() == [2, 0, 0]
    assert st["unit_sum"][:2].tolist() == [-3.0, 2.5 - 1e-40 + 3e19]
    assert st["unit_min"][:2].tolist() == [-3.0, -1e-40] and st["unit_max"][:2].tolist() == [0.0, 3e19]
    assert st["unit_min_dev"][:2].tolist() == [0.5, 0.0]  # |0.5 - 0.5|
    assert np.isnan(st["unit_min"][2]) and np.isnan(st["unit_max"][2]) and np.isnan(st["unit_min_dev"][2])
    assert st["hist"].sum() == x.size - 4


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", ["clean", "hard"])
def test_torch_reads_relu_from_its_inputs_pass_as_the_reference_reads_relu(case, dtype):
    """The fused pass over x also gives relu(x)'s statistics (a following ReLU needs no pass)."""
    torch = pytest.importorskip("torch")
    from actrace.reduce import torch as tr

    if not kernel.available:
        pytest.skip("the compiled kernel is not built here")
    x = values(case, (64, 9), dtype)
    p = tr.reduce_tensor(torch.from_numpy(x), 1, "linear", layer="x", relu_too=True)
    if case == "hard":
        assert p.relu is None  # NaN or Inf: the ReLU takes its own pass, where each value is known
        return
    (got,) = tr.to_readings([tr.relu_of(p, "x.relu")])
    relu = np.maximum(x, 0)
    assert_same(got, from_reference(relu, 1, "relu", "x.relu"), relu, 1)


def test_empty_and_non_float_tensors_are_refused_by_every_path():
    torch = pytest.importorskip("torch")
    from actrace.reduce import torch as tr

    for bad, message in ((np.zeros((0, 4), np.float32), "empty"), (np.zeros((2, 4), np.int64), "int64")):
        with pytest.raises(ReductionError, match=rf"layer 'blocks\.3'.*{message}"):
            reduce_array(bad, 1, "relu", layer="blocks.3")
        with pytest.raises(ReductionError, match=rf"layer 'blocks\.3'.*{message}"):
            tr.reduce_tensor(torch.from_numpy(bad), 1, "relu", layer="blocks.3")


def test_the_schema_merge_rules_are_the_specs():
    """Each column's merge rule in `actrace.format.schema` is the one in the spec's column table."""
    import re
    from pathlib import Path

    table = Path(__file__).parents[1].joinpath("spec", "trace-v1.md").read_text()
    spec = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| (?:yes|no) \| (\w+) \|", table, re.M))
    assert spec == MERGE and len(spec) == len(COLUMNS)


def test_a_kernel_built_for_another_struct_layout_is_refused_at_import(monkeypatch):
    if not kernel.available:
        pytest.skip("the compiled kernel is not built here")

    class Shorter(ctypes.Structure):  # a Job that lost a field, as after an edit of one side only
        _fields_ = kernel._Job._fields_[:-1]

    monkeypatch.setattr(kernel, "_Job", Shorter)
    with pytest.raises(kernel.LayoutError, match="rebuild"):
        kernel._load()


def test_whole_tensor_totals_of_buffers_of_sizes_read_before_are_this_call_s_own():
    """`kernel.reduce_totals` keeps its job table and outputs for the next call of the same sizes
    (a training step's gradients): each call gives its own buffers' numbers, whatever came between,
    and what it gave earlier stays as it was."""
    if not kernel.available:
        pytest.skip("the compiled kernel is not built here")
    rng = np.random.default_rng(0)
    sizes = [7, kernel.SPLIT + 3, 1, 300]  # one cut among threads

    def check(arrays, got):
        for x, row in zip(arrays, got, strict=True):
            finite = x[np.isfinite(x)].astype(np.float64)
            t = dict(zip(kernel.TOTALS, row, strict=True))
            for k, name in enumerate(("sum", "sumsq", "sum3", "sum4"), 1):  # to the spec's bound on float sums
                assert abs(t[name] - (finite ** k).sum()) <= 64 * 2 ** -24 * (np.abs(finite) ** k).sum()
            assert (t["min"], t["max"]) == (finite.min(), finite.max())
            assert (t["zero_count"], t["nan_count"], t["inf_count"]) == \
                ((finite == 0).sum(), np.isnan(x).sum(), np.isinf(x).sum())

    calls = []
    for n in range(3):
        arrays = [rng.standard_normal(size).astype(np.float32) * (n + 1) for size in sizes]
        arrays[0][n] = arrays[1][-1 - n] = [np.nan, np.inf, 0.0][n]  # the second in the last thread's piece
        if n == 2:  # the second call reused the first's layout; a call of other sizes before the third
            between = np.ones(5, np.float32)
            kernel.reduce_totals([between.ctypes.data], [5])
        calls.append((arrays, kernel.reduce_totals([a.ctypes.data for a in arrays], sizes)))
    for arrays, got in calls:
        check(arrays, got)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["clean", "hard"])
def test_reduce_arrays_reads_relu_from_its_inputs_pass_or_its_own(case, dtype):
    """The core's relu derivation (the ONNX adapter's Conv → Relu): from x's kernel pass where x
    is float32 and finite, else from a pass over relu(x); the reference's numbers either way."""
    from actrace.reduce import reduce_arrays

    x = values(case, (64, 9), DTYPES[dtype])
    got, relu = reduce_arrays([(x, 1, "linear", dict(layer="x", relu="x.relu"))])
    assert (relu.layer, relu.kind, relu.bounds) == ("x.relu", "relu", None)
    assert_same(got, from_reference(x, 1, "linear"), x, 1)
    with np.errstate(invalid="ignore"):
        r = np.maximum(x, 0)
    assert_same(relu, from_reference(r, 1, "relu", "x.relu"), r, 1)


ON_PYTHON_THREADS = """
import sys
import numpy as np
from actrace.reduce import kernel, reference
assert "torch" not in sys.modules and kernel._threads() == 2 and kernel._gomp == [None]
rng = np.random.default_rng(0)
x = rng.normal(size=(2, 3, kernel.POOL_SPLIT // 4)).astype(np.float32)  # 1.5x POOL_SPLIT, cut in pieces
x[0, 1, :5] = [np.nan, np.inf, -np.inf, 0.0, 1e-30]
ran = []
kernel._pool.submit = lambda fn, data, submit=kernel._pool.submit: ran.append(1) or submit(fn, data)
got = kernel.reduce_f32(x, 0.0, True)
ref = reference(x.astype(np.float64), 1, histogram=True)
assert ran == [1], ran  # the second thread took part
for k in ("unit_zero", "unit_count", "hist", "nan_count", "inf_count"):
    assert np.array_equal(np.asarray(got[k]).ravel(), np.asarray(ref[k]).ravel()), k
for k in ("unit_min", "unit_max"):
    assert np.array_equal(got[k], np.asarray(ref[k], np.float32)), k
assert np.allclose(got["unit_sumsq"], ref["unit_sumsq"], rtol=1e-5)
print("ok")
"""


def test_without_an_openmp_team_a_large_batch_is_shared_by_two_python_threads_and_read_the_same():
    """In a process without PyTorch's OpenMP team (JAX, ONNX Runtime, plain numpy) the kernel runs a
    batch of `POOL_SPLIT` values or more on two Python threads: a tensor cut in pieces there gives
    the reference's numbers, NaN, ±inf, a zero and a subnormal-scale value planted."""
    if not kernel.available:
        pytest.skip("the compiled kernel is not built here")
    done = subprocess.run([sys.executable, "-c", ON_PYTHON_THREADS], capture_output=True, text=True, timeout=HUNG)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr[-3000:]
