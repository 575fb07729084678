"""The trace format itself (spec/trace-v1.md): the Arrow schema and layer kinds, the histogram's
bin edges, the file metadata, the probe fingerprint and the recurrent-layer rules."""
