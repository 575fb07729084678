"""actrace: a versioned Parquet trace format for per-layer activation and gradient health.

The core needs numpy and pyarrow only; adapters (`actrace.adapters.torch`, `.onnx`) and the
analyzer (`actrace.analyzer`) are imported on demand. The spec is spec/trace-v1.md.
"""
from actrace.files.lake import lake_path
from actrace.files.reader import TraceError, read_table, scan, trace_sources
from actrace.files.writer import Writer
from actrace.format.fingerprint import fingerprint
from actrace.format.metadata import __version__
from actrace.format.schema import SPEC_VERSION
from actrace.reduce import Reading, ReductionError, merge, reduce_array

__all__ = ["SPEC_VERSION", "Reading", "ReductionError", "TraceError", "Writer", "fingerprint",
           "lake_path", "merge", "read_table", "reduce_array", "scan", "trace_sources", "__version__"]
