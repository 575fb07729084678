"""The partitioned layout of many runs (spec §Files): `LAKE/project=P/run=R/trace.parquet`,
Hive style, so DuckDB, Polars, Spark and Trino read a lake as one table (the `project` and `run`
partition columns from the path) and a reader picks partitions by path before it reads a byte.
"""
from __future__ import annotations

import fnmatch
import os
from urllib.parse import unquote

from actrace.files.location import remote

TRACE = "trace.parquet"


# what Hive escapes in a partition value (and control characters); anything else, non-ASCII
# included, stays as it is, so every engine's partition discovery reads the name back
_HIVE = set('"#%\'*/:=?\\{[]^') | {chr(c) for c in range(32)} | {"\x7f"}


def _escaped(value: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _HIVE else c for c in value)


def lake_path(lake, run: str, project: str = "default") -> str:
    """Where run `run` of `project` lives in the lake at `lake` (a folder or a URL); the names
    escaped as Hive escapes partition values ("/" as %2F)."""
    return f"{str(lake).rstrip('/')}/project={_escaped(project)}/run={_escaped(run)}/{TRACE}"


def path_run(path) -> str:
    """The run a trace's path names, a writer's run when none is given: a lake's partition
    (`…/run=R/trace.parquet`), else the file's name without `.parquet`."""
    parent = path.parent.name
    if path.name == TRACE and parent.startswith("run="):
        return unquote(parent.removeprefix("run="))
    return path.name.removesuffix(".parquet")


def traces_in(folder, unwritten: bool = False) -> list:
    """The traces in `folder` and in its Hive partitions (`key=value` folders) at any depth: each
    compacted trace, and the `.parts` folder of each one that is not compacted (yet); with
    `unwritten`, one its writer has not flushed into (yet: or never will, killed before it did) too."""
    files, empty = _files(folder)
    traces = [f for f in files if f.endswith(".parquet") and all("=" in d for d in f.split("/")[:-1])]
    parts = {f.rsplit("/", 1)[0] for f in files + [f"{d}/" for d in (empty if unwritten else ())]
             if "/" in f and f.rsplit("/", 1)[0].endswith(".parquet.parts") and _part_or_none(f.rsplit("/", 1)[1])
             and all("=" in d for d in f.split("/")[:-2])}
    return [folder / f for f in sorted(traces)] + [folder / p for p in sorted(parts)]


def _part_or_none(name: str) -> bool:
    """Whether a name in a `.parts` folder makes it a trace: a part file's (not its writer's temporary
    file, mid-flush), or none (an unwritten folder's)."""
    return not name or fnmatch.fnmatchcase(name, "part-*.parquet")


def _files(folder) -> tuple[list[str], list[str]]:
    """Paths of the files under `folder`, relative to it, descending only into partition and
    `.parts` folders (in an object store: one listing of the prefix); and of the `.parts` folders
    that hold no file (on a local disk: an object store has no empty folders)."""
    if remote(folder):
        base = folder.path.rstrip("/") + "/"
        return [p[len(base):] for p in folder.fs.find(folder.path) if p.startswith(base)], []
    out, empty = [], []
    for here, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if "=" in d or d.endswith(".parquet.parts")]
        rel = os.path.relpath(here, folder).replace(os.sep, "/")
        out += [n if rel == "." else f"{rel}/{n}" for n in names]
        if rel.endswith(".parquet.parts") and not any(map(_part_or_none, names)) and not dirs:
            empty.append(rel)
    return out, empty
