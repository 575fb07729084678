"""The analyzer: Polars metrics over traces, findings, cross-run comparison and the Altair report."""
