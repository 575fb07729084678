"""The analyzer: Polars metrics over traces, findings, cross-run comparison and the Altair report.

    from actrace.analyzer import analyze
    a = analyze("runs/")          # every trace read once
    a.metrics                     # per (run, layer, stream, step), a Polars frame
    a.findings_frame              # the findings, most urgent first, a Polars frame
"""
from .analysis import Analysis, analyze

__all__ = ["Analysis", "analyze"]
