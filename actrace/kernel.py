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

SHIFT = 14  # (KEY_SHIFT in _kernel.c) key = float32 bits >> SHIFT: 2^18 keys, a 256 KiB table of bins
EXACT = 255  # in the table: the key straddles an edge (EXACT in _kernel.c)


_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Bins(ctypes.Structure):
    _fields_ = [("key_bin", _P), ("edges", _P), ("n_edges", ctypes.c_int),
                ("zero_bin", ctypes.c_int), ("n_bins", ctypes.c_int)]


class _Job(ctypes.Structure):  # Job in _kernel.c
    _fields_ = [("x", _P), ("before", _I64), ("units", _I64), ("after", _I64), ("centre", ctypes.c_float)] + \
        [(name, ctypes.c_int32) for name in ("pieces", "relu", "hist", "done")] + \
        [("f64", _P), ("f32", _P), ("i64", _P)]


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
    """Each key's bin where every float32 with that key lands in one bin, else EXACT (exact path)."""
    assert bins.N_BINS <= 160 < EXACT, "MAX_BINS in _kernel.c"
    keys = np.arange(1 << (32 - SHIFT), dtype=np.uint64)
    first = (keys << SHIFT).astype(np.uint32).view(np.float32)
    last = ((keys << SHIFT) | ((1 << SHIFT) - 1)).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        same = ~np.isnan(first) & ~np.isnan(last)
        b_first = np.where(same, bins.bin_index(np.where(same, first, 0)), -1)
        b_last = np.where(same, bins.bin_index(np.where(same, last, 0)), -1)
    table = np.where(same & (b_first == b_last), b_first, EXACT).astype(np.uint8)
    table[[0, 1 << (31 - SHIFT)]] = bins.ZERO_BIN  # ±0's keys; the kernel sends their subnormals the exact way
    return table


_run = _load()
available = _run is not None
_RUN = ctypes.cast(_run, _P) if available else None
_TABLE = _key_table() if available else None
_EDGES = np.ascontiguousarray(bins.MAGNITUDE_EDGES, dtype=np.float64)
_BINS = _Bins(_TABLE.ctypes.data, _EDGES.ctypes.data, len(_EDGES), bins.ZERO_BIN, bins.N_BINS) \
    if available else None
_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actrace-kernel")
_gomp: list = []  # [(GOMP_parallel, omp_get_max_threads) or None], looked up at the first batch
SPLIT = 1 << 16   # values: a tensor this large is cut in pieces, one per thread


def _address(a: np.ndarray) -> int:
    """The array's data pointer (`ndarray.ctypes` builds an object per call: ~0.1 ms each)."""
    return a.__array_interface__["data"][0]


def _job(x3: np.ndarray, centre: float, histogram: bool, relu: bool, threads: int) -> tuple[_Job, dict]:
    """A job for the kernel and the views of its results. A large tensor is cut into a piece per
    thread (along `before`, or along `after` for a whole tensor read as one unit); the outputs have
    a row per piece, merged into row 0 by the kernel. The caller keeps `x3` alive until it has run."""
    before, units, after = x3.shape
    cut = x3.size >= SPLIT and (before >= threads or (before, units) == (1, 1))
    pieces = threads if cut else 1
    f64 = np.zeros((pieces, 4, units))
    f32 = np.empty((pieces, 3, units), np.float32)
    i64 = np.zeros((pieces, 3 * units + bins.N_BINS + 2), np.int64)
    job = _Job(_address(x3), before, units, after, centre, pieces, relu, histogram, 0,
               _address(f64), _address(f32), _address(i64))
    (d, f, i) = (f64[0], f32[0], i64[0])
    out = {"sum": d[0], "sumsq": d[1], "min": f[0], "max": f[1], "min_dev": f[2], "zero": i[:units],
           "finite": i[units: 2 * units], "hist": i[3 * units: -2] if histogram else None, "nan_inf": i[-2:],
           "relu_sum": d[2] if relu else None, "relu_sumsq": d[3] if relu else None,
           "relu_zero": i[2 * units: 3 * units] if relu else None}
    return job, out


def reduce_many(tasks: list[tuple[np.ndarray, float, bool, bool]]) -> list[dict]:
    """`reduce_f32` of every (x3, centre, histogram, relu) task on all threads at once: the tasks,
    and large tensors cut in pieces, are shared among the threads."""
    if not _gomp:  # PyTorch, where it is used, is loaded by the first call
        _gomp.append(_openmp())
    threads = _gomp[0][1]() if _gomp[0] else 2
    made = [_job(*task, threads) for task in tasks]
    jobs = (_Job * len(made))(*(job for job, _ in made))
    batch = ctypes.byref(_Batch(_BINS, ctypes.addressof(jobs), len(made), 0))
    if sum(job.pieces for job in jobs) == 1:
        _run(batch)
    elif _gomp[0]:
        _gomp[0][0](_RUN, batch, 0, 0)  # 0 threads: the team's size (torch.set_num_threads)
    else:
        helper = _pool.submit(_run, batch)
        _run(batch)
        helper.result()
    return [out for _, out in made]


def reduce_f32(x3: np.ndarray, centre: float, histogram: bool, relu: bool = False) -> dict:
    """Per-unit sums, sums of squares, extremes, min |h - centre|, zero and finite counts, the
    histogram, and NaN/Inf totals of a C-contiguous float32 (before, units, after) array; with
    `relu`, also the per-unit sums and sums of squares of relu(x) and how many finite values are <= 0
    (`relu_sum`, `relu_sumsq`, `relu_zero`), all over finite values; a unit with no finite value
    has NaN extremes."""
    return reduce_many([(x3, centre, histogram, relu)])[0]
