"""The reference reductions: values by construction, dtypes, merges and the histogram's fast path
(every backend against the reference: tests/test_contract.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from actrace import ReductionError, merge, reduce_array
from actrace.format.bins import MAGNITUDE_EDGES, N_BINS, ZERO_BIN


def test_worked_example_of_the_spec():
    r = reduce_array(np.array([[0, 2, 0], [0, 0.5, 3]], dtype=np.float32), 1, "relu", layer="fc")
    assert (r.count, r.zero_count, r.units, r.shape) == (6, 3, 3, (2, 3))
    assert (r.sum, r.sumsq, r.min, r.max) == (5.5, 13.25, 0.0, 3.0)
    assert r.unit_zero.tolist() == [2, 0, 1] and r.unit_count.tolist() == [2, 2, 2]
    assert r.unit_sumsq.tolist() == [0, 4.25, 9] and r.unit_min_dev.tolist() == [0, 0.5, 0]
    assert {int(i): int(c) for i, c in enumerate(r.hist) if c} == {70: 3, 102: 1, 108: 2}


def test_killed_units_are_the_only_all_zero_units_while_healthy_relu_is_half_zeros():
    rng = np.random.default_rng(0)
    pre = rng.normal(size=(256, 64))
    pre[:, :16] -= 100.0  # bias far negative: these 16 units are dead
    r = reduce_array(np.maximum(pre, 0).astype(np.float32), 1, "relu")
    absmax = np.maximum(np.abs(r.unit_min), np.abs(r.unit_max))
    assert (absmax == 0).sum() == 16
    healthy = slice(16, None)
    sparsity_of_healthy = r.unit_zero[healthy].sum() / r.unit_count[healthy].sum()
    assert 0.45 < sparsity_of_healthy < 0.55


def test_bounded_kind_measures_distance_from_the_centre_of_its_bounds():
    x = np.array([[0.001, 0.5], [0.999, 0.6]], dtype=np.float64)
    r = reduce_array(x, 1, "sigmoid")
    assert r.bounds == (0.0, 1.0)
    np.testing.assert_allclose(r.unit_min_dev, [0.499, 0.0], atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_accumulates_in_wide_floats(dtype):
    x = np.full((4096, 2), 1.0, dtype=dtype)  # a float16 running sum would stop at 2048
    r = reduce_array(x, 1, "linear")
    assert r.unit_sum.tolist() == [4096.0, 4096.0] and r.dtype == np.dtype(dtype).name


def test_nonfinite_values_are_counted_and_kept_out_of_sums_and_extremes():
    x = np.array([[1.0, np.nan], [np.inf, np.nan], [-2.0, np.nan]], dtype=np.float32)
    r = reduce_array(x, 1, "linear")
    assert (r.nan_count, r.inf_count, r.count) == (3, 1, 6)
    assert r.unit_count.tolist() == [2, 0] and r.unit_sum.tolist() == [-1.0, 0.0]
    assert r.unit_min[0] == -2 and r.unit_max[0] == 1 and np.isnan(r.unit_max[1])
    assert (r.min, r.max) == (-2.0, 1.0)
    assert r.hist.sum() == r.count - r.nan_count and r.hist[-1] == 1


def test_a_nan_storm_gives_nan_extremes_and_zero_sums():
    r = reduce_array(np.full((3, 4), np.nan, dtype=np.float32), 1, "relu")
    assert r.nan_count == 12 and r.sum == 0 and np.isnan(r.min) and np.isnan(r.max)
    assert r.hist.sum() == 0 and len(r.hist) == N_BINS


def test_merge_refuses_readings_of_different_layers():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ReductionError, match="layer"):
        merge(reduce_array(x, 1, "relu", layer="a"), reduce_array(x, 1, "relu", layer="b"))


def test_zero_lands_in_its_own_bin():
    r = reduce_array(np.array([[0.0, -0.0, 1e-30]], np.float32), None, "relu")
    assert r.hist[ZERO_BIN] == 2 and r.hist[ZERO_BIN + 1] == 1


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 300), elements=st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([float(e) for e in MAGNITUDE_EDGES]),
    st.sampled_from([-0.0, 0.0, 0.99, -0.999, 1.0]))))
def test_the_float32_fast_histogram_equals_the_definition(x):
    from actrace.format import bins

    np.testing.assert_array_equal(bins.histogram_float32(x), bins.histogram_exact(x))
    zeros = int((x == 0).sum())
    np.testing.assert_array_equal(bins.histogram_float32(x, zeros), bins.histogram_exact(x))


def test_gradients_read_in_one_batch_are_the_gradients_read_one_by_one(tmp_path):
    """`gradient_totals` (the Keras and Flax adapters' per-step gradient reading: one kernel batch, no
    Reading per gradient) gives each gradient's layer-level reading as `reduce_arrays` of its
    `param_grad_job` does, on a NaN, an inf, zeros, a 0-d gradient, a transposed (non-contiguous)
    one, one cut among the threads and those of layers of bounded kinds (their bounds kept: a valid
    trace); and leaves a batch holding a float64 gradient to it."""
    import actrace
    from actrace.files.validate import validate
    from actrace.reduce import gradient_totals, kernel, param_grad_job, reduce_arrays

    if not kernel.available:
        pytest.skip("the compiled kernel is not built here")
    rng = np.random.default_rng(0)
    grads = [(rng.normal(size=(6, 5)).astype(np.float32), "fc", "weight", "linear"),
             (np.float32(-2.5), "scale", "s", "other"),
             (rng.normal(size=(4, 3)).astype(np.float32), "head", "kernel", "softmax"),  # Keras: Dense(softmax)
             (rng.normal(size=(3,)).astype(np.float32), "gate", "bias", "hard_tanh"),
             (rng.normal(size=(7, 3)).astype(np.float32).T, "conv", "weight", "conv"),
             (rng.normal(size=kernel.SPLIT + 5).astype(np.float32), "emb", "weight", "embedding")]
    grads[0][0][1, 2], grads[0][0][3, 1], grads[0][0][0] = np.nan, -np.inf, 0.0
    got = gradient_totals(grads).readings()
    want = reduce_arrays([param_grad_job(*g) for g in grads])
    for a, b in zip(got, want, strict=True):
        assert (a.layer, a.param, a.kind, a.bounds, a.stream, a.dtype, a.shape, a.unit_axis, a.units, a.count) == \
            (b.layer, b.param, b.kind, b.bounds, b.stream, b.dtype, b.shape, b.unit_axis, b.units, b.count)
        assert (a.nan_count, a.inf_count, a.zero_count, a.min, a.max) == (b.nan_count, b.inf_count, b.zero_count,
                                                                          b.min, b.max)
        assert (a.sum, a.sumsq) == pytest.approx((b.sum, b.sumsq), rel=1e-6)
        assert a.unit_sum is None and a.hist is None
    assert (got[0].nan_count, got[0].inf_count, got[0].zero_count) == (1, 1, 5) and got[1].shape == ()
    assert gradient_totals(grads + [(np.ones(3), "b", "bias", "linear")]) is None
    with actrace.Writer(tmp_path / "g.parquet") as w:  # a bounded kind's rows carry its bounds (spec §Validity)
        w.record_totals(0, gradient_totals(grads), layer_indexes=list(range(len(grads))))
    assert validate(tmp_path / "g.parquet") == []
