"""Reductions (spec §Units, §Columns): a tensor, its unit axis and its kind become one mergeable
`Reading`, by the one dispatch (`reduce_arrays`) that chooses a backend: the fused C kernel, the
numpy reference, or (imported only when torch is) the torch backend."""
from .dispatch import gradient_totals, param_grad_job, reduce_array, reduce_arrays, relu_stats
from .reading import Reading, ReductionError, combine, fold, merge, outward
from .reference import centre, check_reducible, reference, sat_counts, view3

__all__ = ["Reading", "ReductionError", "centre", "check_reducible", "combine", "fold", "gradient_totals", "merge",
           "outward", "param_grad_job", "reduce_array", "reduce_arrays", "reference", "relu_stats", "sat_counts",
           "view3"]
