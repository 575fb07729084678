"""The reference reductions: values by construction, exact merges, dtypes and bad input."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from actrace import ReductionError, merge, reduce_array
from actrace.bins import N_BINS, ZERO_BIN


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


SHAPES = {"dense": ((6, 5), 1), "nchw": ((6, 3, 4, 2), 1), "nhwc": ((6, 4, 2, 3), -1),
          "sequence": ((6, 7, 5), -1), "whole": ((6, 4), None)}


@pytest.mark.parametrize("shape,axis", SHAPES.values(), ids=SHAPES.keys())
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_two_half_batches_merge_into_the_whole_batch(shape, axis, data):
    x = data.draw(hnp.arrays(np.float32, shape, elements=st.one_of(
        st.floats(-1e6, 1e6, width=32), st.just(0.0), st.sampled_from([np.nan, np.inf, -np.inf]))))
    cut = data.draw(st.integers(1, shape[0] - 1))
    whole = reduce_array(x, axis, "tanh")
    merged = merge(reduce_array(x[:cut], axis, "tanh"), reduce_array(x[cut:], axis, "tanh"))
    assert merged.shape == whole.shape
    for name in ("count", "nan_count", "inf_count", "zero_count"):
        assert getattr(merged, name) == getattr(whole, name)
    for name in ("unit_count", "unit_zero", "hist"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(whole, name))
    for name in ("unit_min", "unit_max", "unit_min_dev"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(whole, name))
    # counts, extremes and histograms merge exactly; sums to the float32 accumulation the spec allows
    clean = np.where(np.isfinite(x), x, 0).astype(np.float64)
    per_unit = clean.reshape(-1, 1) if axis is None else np.moveaxis(clean, axis, -1).reshape(-1, shape[axis])
    for name, square in (("unit_sum", False), ("unit_sumsq", True)):
        bound = 2 * cascade_error(per_unit, square, axes=0)
        assert np.all(np.abs(getattr(merged, name) - getattr(whole, name)) <= bound), name
        assert abs(getattr(merged, name[5:]) - getattr(whole, name[5:])) <= bound.sum(), name[5:]


def cascade_error(clean: np.ndarray, square: bool, axes) -> np.ndarray:
    """How far a float32 sum (of squares) over `axes` may stray: runs of up to 64 values summed in
    float32, then in float64 (spec §Numerics), err by at most 64·2⁻²⁴ of the sum of |terms|."""
    terms = clean ** 2 if square else np.abs(clean)
    return 64 * 2.0 ** -24 * terms.sum(axis=axes) + 1e-6


@pytest.mark.skipif(not __import__("actrace").kernel.available, reason="the compiled kernel is not built here")
@pytest.mark.parametrize("shape", [(300, 7, 40), (1, 1, 70001), (3000, 40, 1)])
def test_a_large_tensor_cut_among_threads_gives_the_whole_tensors_statistics(shape):
    from actrace import kernel
    from actrace.reduce import _numpy_stats

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::997] = np.nan
    x.reshape(-1)[5::1009] = -np.inf
    x[..., 0] = 0.0
    assert kernel._job(x, 0.0, True, True, 2)[0].pieces == 2
    (got,), want = kernel.reduce_many([(x, 0.0, True, True)]), _numpy_stats(x, 0.0, True)
    for name in ("hist", "zero", "finite", "nan_inf", "min", "max", "min_dev"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(got["relu_zero"], ((x <= 0) & np.isfinite(x)).sum(axis=(0, 2)))
    clean = np.where(np.isfinite(x), x, 0).astype(np.float64)
    for name, square in (("sum", False), ("sumsq", True)):
        assert np.all(np.abs(got[name] - want[name]) <= cascade_error(clean, square, (0, 2))), name
    assert np.all(np.abs(got["relu_sum"] - np.maximum(clean, 0).sum(axis=(0, 2))) <=
                  cascade_error(np.maximum(clean, 0), False, (0, 2)))


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


@pytest.mark.parametrize("bad,message", [
    (np.zeros((0, 4), np.float32), "empty tensor"),
    (np.zeros((2, 4), np.int64), "int64"),
    (np.zeros((2, 4), bool), "bool"),
])
def test_unreducible_tensors_get_an_error_naming_the_layer(bad, message):
    with pytest.raises(ReductionError, match=rf"layer 'blocks\.3\.act'.*{message}"):
        reduce_array(bad, 1, "relu", layer="blocks.3.act")


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
    st.sampled_from([float(e) for e in __import__("actrace").bins.MAGNITUDE_EDGES]),
    st.sampled_from([-0.0, 0.0, 0.99, -0.999, 1.0]))))
def test_the_float32_fast_histogram_equals_the_definition(x):
    from actrace import bins

    np.testing.assert_array_equal(bins.histogram_float32(x), bins.histogram_exact(x))
    zeros = int((x == 0).sum())
    np.testing.assert_array_equal(bins.histogram_float32(x, zeros), bins.histogram_exact(x))


@pytest.mark.skipif(not __import__("actrace").kernel.available, reason="the compiled kernel is not built here")
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_fused_kernel_equals_the_numpy_path(data):
    from actrace import kernel
    from actrace.reduce import _numpy_stats

    # dense shapes cover partial and whole 8- and 16-column groups and a second block of 64 rows;
    # (1, 2, 1100) runs of three 512-value blocks, any of which may hold a NaN or Inf; (70, 3, 2)
    # short runs read over blocks of 64 rows
    shape = data.draw(st.sampled_from([(7, 5, 1), (3, 4, 6), (1, 1, 40), (2, 3, 1), (3, 12, 1), (2, 16, 1),
                                       (66, 19, 1), (1, 2, 1100), (70, 3, 2)]))
    x = data.draw(hnp.arrays(np.float32, shape, elements=st.one_of(
        st.floats(-1e6, 1e6, width=32), st.just(0.0),
        st.sampled_from([np.nan, np.inf, -np.inf, 0.99, -0.999, 3e19, -3e19, 1e-40, -1e-45]))))
    c = data.draw(st.sampled_from([0.0, 0.5]))
    got, want = kernel.reduce_f32(x, c, True, relu=True), _numpy_stats(x, c, True)
    with np.errstate(invalid="ignore"):
        relu = _numpy_stats(np.where(np.isfinite(x), np.maximum(x, 0), np.nan).astype(np.float32), 0.0, False)
    np.testing.assert_array_equal(got["relu_zero"], relu["zero"])
    np.testing.assert_array_equal(got["hist"], want["hist"])
    for name in ("zero", "finite", "nan_inf"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("min", "max", "min_dev"):  # NaN in both for a unit with no finite value
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
    clean = np.where(np.isfinite(x), x, 0).astype(np.float64)
    for name, square in (("sum", False), ("sumsq", True)):
        assert np.all(np.abs(got[name] - want[name]) <= cascade_error(clean, square, (0, 2))), name
        assert np.all(np.abs(got["relu_" + name] - relu[name]) <= cascade_error(np.maximum(clean, 0), square, (0, 2)))
