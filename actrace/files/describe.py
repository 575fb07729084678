"""What `actrace inspect` shows: a trace's run metadata, layers, steps, streams and size."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc

from actrace.files.reader import TraceError, part_files, read_source, settled
from actrace.format.schema import shown
from actrace.files.validate import metadata_problems, row_problems


COLUMNS = ["layer", "layer_index", "kind", "units", "stream", "step", "param"]


def describe(source: Path) -> dict:
    """A JSON-ready summary of one trace source, once what it reads is known to follow the spec; of its
    compacted trace where its writer compacted it while it was read (`settled`)."""
    return settled(_describe, source)


def _describe(source: Path) -> dict:
    table, meta = read_source(source, COLUMNS)
    problems = metadata_problems(meta, source) + row_problems(table, source, read=COLUMNS)
    if problems:
        more = f" (and {len(problems) - 1} more; `actrace validate {source}` lists them)" if len(problems) > 1 else ""
        raise TraceError(f"{problems[0]}{more}")
    meta = dict(meta, config=json.loads(meta.get("config") or "{}"))
    layers: dict[str, dict] = {}
    for row in table.select(["layer", "layer_index", "kind", "units", "stream"]).to_pylist():
        entry = layers.setdefault(row["layer"], {"layer": row["layer"], "index": row["layer_index"],
                                                 "kind": row["kind"], "units": None, "streams": []})
        if row["stream"] == "activation":
            entry["units"] = row["units"]
        if row["stream"] not in entry["streams"]:
            entry["streams"].append(row["stream"])
    steps = pc.unique(table["step"]).to_pylist() if len(table) else []
    streams = {s: int(n) for s, n in zip(*[c.to_pylist() for c in
               pc.value_counts(table["stream"]).flatten()])} if len(table) else {}
    return {
        "path": str(source), "spec_version": meta.get("spec_version"), "metadata": meta,
        "readings": len(table), "size_bytes": sum(f.stat().st_size for f in part_files(source)),
        "steps": {"count": len(steps), "first": min(steps, default=None), "last": max(steps, default=None)},
        "streams": streams, "layers": sorted(layers.values(), key=lambda l: l["index"]),
    }


def format_description(d: dict) -> str:
    """The human-readable form of `describe`'s result, every string from the trace `shown` (escaped)."""
    m = {k: shown(v) if isinstance(v, str) else v for k, v in d["metadata"].items()}
    lines = [
        f"{shown(d['path'])}  (spec {d['spec_version']}, {d['size_bytes'] / 1024:.1f} KiB, {d['readings']} readings)",
        f"  run        {m.get('run_name')}  id {m.get('run_id')}",
        f"  framework  {m.get('framework')} {m.get('framework_version')}  via {m.get('adapter')} "
        f"{m.get('adapter_version')}",
        f"  host       {m.get('host')}",
        f"  created    {m.get('created')}   mode {m.get('mode') or '-'}   status {m.get('status') or '-'}",
        f"  probe      {m.get('probe_fingerprint') or '-'}  ({m.get('probe_size') or '?'} examples)",
        f"  config     {json.dumps(m.get('config'))}",
        f"  steps      {d['steps']['count']} (from {d['steps']['first']} to {d['steps']['last']})",
        "  streams    " + ", ".join(f"{s} {n}" for s, n in d["streams"].items()),
        f"  layers     {len(d['layers'])}",
    ]
    for l in d["layers"]:
        lines.append(f"    {l['index']:>4}  {shown(l['layer']):<40} {shown(l['kind']):<11} "
                     f"{'' if l['units'] is None else str(l['units']) + ' units':<12} {','.join(l['streams'])}")
    return "\n".join(lines)
