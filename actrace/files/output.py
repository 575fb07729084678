"""Where a command writes: never over one of its own inputs, never through a symbolic link, never
over a file that is not its own kind of output (unless forced), never over a device or a pipe (into
it), and atomically, so that an error leaves the old file or the whole new one and no temporary
file behind."""
from __future__ import annotations

import os
from pathlib import Path

from actrace.files.location import location, remote

# what a command's own earlier output holds in its first KiB, by kind of output (and `[]`, an empty
# JSON answer)
SIGNATURES = {
    "report": ('<meta name="generator" content="actrace report">', "<title>actrace report</title>"),
    "json": ('"rule":', '"dead_fraction":', '"passed":', '"partings":', '"also_differ":'),
    "csv": ("severity,rule,run,layer", "run,layer,layer_index,kind,stream,step", "run,baseline,aligned"),
    "junit": ('<testsuites name="actrace check"',),
    "text": ("findings: ", "check: ", " parts from ", ": no parting from the baseline", "sweep over "),
}


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check(path, kind: str, inputs=(), force: bool = False) -> Path:
    """`path` if a command may write its `kind` of output there; else ValueError saying why."""
    if remote(location(path)):
        raise ValueError(f"{path}: a command's {kind} output is written to a local file (traces are read from "
                         "object storage; copy the output there after)")
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link: actrace does not write through one (remove it, or write "
                         "elsewhere)")
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give a file name for the {kind} output")
    if path.parent.name.endswith(".parquet.parts"):  # a reader takes every part-*.parquet there as the trace's
        raise ValueError(f"{path} is inside a trace's part folder ({path.parent}), which its writer owns: write the "
                         "output elsewhere")
    for source in (s for s in map(location, inputs) if not remote(s)):  # a trace file, or a .parts directory
        inside = source.is_dir() and path.resolve().is_relative_to(source.resolve())
        if _same(path, source) or inside:
            raise ValueError(f"{path} is one of this command's inputs ({source}): it would be overwritten; "
                             "write the output elsewhere")
    if path.exists() and path.stat().st_size and not force:
        with open(path, "rb") as f:
            head = f.read(1024).decode("utf-8", "replace")
        if not any(mark in head for mark in SIGNATURES[kind]) and not (kind == "json" and head.strip() == "[]"):
            raise ValueError(f"{path} exists and is not an actrace {kind} output: not overwritten (--force replaces "
                             "it)")
    return path


def write(path, text: str, kind: str, inputs=(), force: bool = False) -> Path:
    """Write `text` to `path` once `check` allows it: to a temporary file beside it, then moved into
    place; on any error the temporary file is removed and the old file stays. A device or a pipe
    (`-o /dev/null`) is written into, never replaced by a file."""
    path = check(path, kind, inputs, force)
    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
