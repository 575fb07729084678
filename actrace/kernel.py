"""The fused float32 reduction kernel (actrace/_kernel.c) through ctypes, with its lookup table.

`reduce_many` runs a batch of tensors on every thread at once: on the OpenMP team of a framework
already in the process (PyTorch's libgomp, whose idle threads would otherwise spin beside ours),
else on two Python threads (ctypes releases the GIL). Optional: where the compiled module is
missing, `available` is False and `actrace.reduce` uses its numpy path, which gives the same
numbers (the tests hold the two to each other).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import bins

SHIFT = 14  # key = float32 bits >> SHIFT: 2^18 keys, a 512 KiB table of bins


_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Bins(ctypes.Structure):
    _fields_ = [("key_bin", _P), ("shift", ctypes.c_int), ("edges", _P), ("n_edges", ctypes.c_int),
                ("zero_bin", ctypes.c_int), ("n_bins", ctypes.c_int)]


class _Job(ctypes.Structure):  # Job in _kernel.c
    _fields_ = [("x", _P), ("before", _I64), ("units", _I64), ("after", _I64), ("centre", ctypes.c_float),
                ("status", ctypes.c_int)] + [(name, _P) for name in (
                    "sum", "sumsq", "rsum", "rsumsq", "mn", "mx", "mindev", "zero", "finite", "rzero", "hist",
                    "nan_inf")]


class _Batch(ctypes.Structure):
    _fields_ = [("bins", _Bins), ("jobs", _P), ("n", _I64), ("next", _I64)]


def _load():
    spec = importlib.util.find_spec("actrace._kernel")
    if spec is None or not spec.origin:
        return None
    fn = ctypes.CDLL(spec.origin).actrace_run_batch
    fn.argtypes, fn.restype = [_P], None
    return fn


def _openmp():
    """(GOMP_parallel, omp_get_max_threads) of the libgomp already loaded in this process
    (PyTorch's), or None: never loads one itself."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        parallel, threads = lib.GOMP_parallel, lib.omp_get_max_threads
    except (OSError, AttributeError):
        return None
    parallel.argtypes, parallel.restype = [_P, _P, ctypes.c_uint, ctypes.c_uint], None
    threads.argtypes, threads.restype = [], ctypes.c_int
    return parallel, threads


def _key_table() -> np.ndarray:
    """Each key's bin where every float32 with that key lands in one bin, else -1 (exact path)."""
    assert bins.N_BINS <= 160, "MAX_BINS in _kernel.c"
    keys = np.arange(1 << (32 - SHIFT), dtype=np.uint64)
    first = (keys << SHIFT).astype(np.uint32).view(np.float32)
    last = ((keys << SHIFT) | ((1 << SHIFT) - 1)).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        same = ~np.isnan(first) & ~np.isnan(last)
        b_first = np.where(same, bins.bin_index(np.where(same, first, 0)), -1)
        b_last = np.where(same, bins.bin_index(np.where(same, last, 0)), -1)
    table = np.where(same & (b_first == b_last), b_first, -1).astype(np.int16)
    table[[0, 1 << (31 - SHIFT)]] = bins.ZERO_BIN  # ±0's keys; the kernel sends their subnormals the exact way
    return table


_run = _load()
available = _run is not None
_RUN = ctypes.cast(_run, _P) if available else None
_TABLE = _key_table() if available else None
_EDGES = np.ascontiguousarray(bins.MAGNITUDE_EDGES, dtype=np.float64)
_BINS = _Bins(_TABLE.ctypes.data, SHIFT, _EDGES.ctypes.data, len(_EDGES), bins.ZERO_BIN, bins.N_BINS) \
    if available else None
_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actrace-kernel")
_gomp: list = []  # [(GOMP_parallel, omp_get_max_threads) or None], looked up at the first batch
SPLIT = 1 << 16   # values: a tensor this large is cut in pieces, one per thread


def _jobs(x3: np.ndarray, centre: float, histogram: bool, relu: bool, parts: int) -> tuple[list[_Job], tuple]:
    """Jobs for one task, its tensor cut into up to `parts` contiguous pieces (along `before`, or
    along `after` for a whole tensor read as one unit), and their outputs: three buffers with a row
    per piece (a ctypes pointer costs a microsecond). The caller keeps `x3` alive until they have run."""
    before, units, after = x3.shape
    if x3.size < SPLIT or parts < 2 or (before < parts and (before, units) != (1, 1)):
        parts = 1
    axis = 0 if before >= parts else 2
    cuts = [x3.shape[axis] * k // parts for k in range(parts + 1)]
    f64 = np.zeros((parts, 4, units))
    f32 = np.empty((parts, 3, units), np.float32)
    f32[:, 0::2], f32[:, 1] = np.inf, -np.inf
    width = 3 * units + bins.N_BINS + 2
    i64 = np.zeros((parts, width), np.int64)
    step = 4 * (units * after if axis == 0 else 1)  # bytes from one `before` row (or `after` value) to the next
    jobs = []
    for k in range(parts):
        d, f, i = f64.ctypes.data + 32 * units * k, f32.ctypes.data + 12 * units * k, i64.ctypes.data + 8 * width * k
        rows = cuts[k + 1] - cuts[k]
        shape = (rows, units, after) if axis == 0 else (1, 1, rows)
        hist = i + 24 * units
        jobs.append(_Job(x3.ctypes.data + step * cuts[k], *shape, centre, 0, d, d + 8 * units,
                         d + 16 * units if relu else None, d + 24 * units if relu else None, f, f + 4 * units,
                         f + 8 * units, i, i + 8 * units, i + 16 * units if relu else None,
                         hist if histogram else None, hist + 8 * bins.N_BINS))
    return jobs, (f64, f32, i64, histogram, relu)


def _results(f64: np.ndarray, f32: np.ndarray, i64: np.ndarray, histogram: bool, relu: bool) -> dict:
    """One task's statistics from its pieces' rows: sums and counts add, extremes take the extreme."""
    if len(f64) > 1:
        f64, i64 = f64.sum(axis=0, keepdims=True), i64.sum(axis=0, keepdims=True)
        f32 = np.stack([f32[:, 0].min(axis=0), f32[:, 1].max(axis=0), f32[:, 2].min(axis=0)])[None]
    (f64,), (f32,), (i64,) = f64, f32, i64
    units = f64.shape[1]
    out = {"sum": f64[0], "sumsq": f64[1], "min": f32[0], "max": f32[1], "min_dev": f32[2], "zero": i64[:units],
           "finite": i64[units: 2 * units], "hist": i64[3 * units: -2] if histogram else None, "nan_inf": i64[-2:],
           "relu_sum": f64[2] if relu else None, "relu_sumsq": f64[3] if relu else None,
           "relu_zero": i64[2 * units: 3 * units] if relu else None}
    empty = out["finite"] == 0  # spec: a unit with no finite value has NaN extremes
    if empty.any():
        f32[:, empty] = np.nan
    return out


def reduce_many(tasks: list[tuple[np.ndarray, float, bool, bool]]) -> list[dict]:
    """`reduce_f32` of every (x3, centre, histogram, relu) task on all threads at once: the tasks,
    and large tensors cut in pieces, are shared among the threads."""
    if not _gomp:  # PyTorch, where it is used, is loaded by the first call
        _gomp.append(_openmp())
    threads = _gomp[0][1]() if _gomp[0] else 2
    made = [_jobs(*task, threads) for task in tasks]
    jobs = (_Job * sum(len(j) for j, _ in made))(*(job for j, _ in made for job in j))
    batch = ctypes.byref(_Batch(_BINS, ctypes.addressof(jobs), len(jobs), 0))
    if len(jobs) == 1:
        _run(batch)
    elif _gomp[0]:
        _gomp[0][0](_RUN, batch, 0, 0)  # 0 threads: the team's size (torch.set_num_threads)
    else:
        helper = _pool.submit(_run, batch)
        _run(batch)
        helper.result()
    if any(job.status for job in jobs):
        raise MemoryError("actrace kernel: out of memory for its partial sums")
    return [_results(*outputs) for _, outputs in made]


def reduce_f32(x3: np.ndarray, centre: float, histogram: bool, relu: bool = False) -> dict:
    """Per-unit sums, sums of squares, extremes, min |h - centre|, zero and finite counts, the
    histogram, and NaN/Inf totals of a C-contiguous float32 (before, units, after) array; with
    `relu`, also the per-unit sums and sums of squares of relu(x) and how many finite values are <= 0
    (`relu_sum`, `relu_sumsq`, `relu_zero`), all over finite values."""
    return reduce_many([(x3, centre, histogram, relu)])[0]
