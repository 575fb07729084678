"""actrace: a versioned Parquet trace format for per-layer activation and gradient health.

The core needs numpy and pyarrow only; adapters (`actrace.adapters.torch`, `.onnx`) and the
analyzer (`actrace.analyzer`) are imported on demand. The spec is spec/trace-v1.md.
"""
__version__ = "0.1.0"

from .fingerprint import fingerprint
from .reader import TraceError, read_table, scan, trace_sources
from .reduce import Reading, ReductionError, merge, reduce_array
from .schema import SPEC_VERSION
from .writer import Writer

__all__ = ["SPEC_VERSION", "Reading", "ReductionError", "TraceError", "Writer", "fingerprint",
           "merge", "read_table", "reduce_array", "scan", "trace_sources", "__version__"]
