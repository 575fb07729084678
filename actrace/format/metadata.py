"""The file metadata of spec §File metadata: the `actrace:` keys, made for a writer and parsed,
version-checked, for every reader (reader, validator, analyzer)."""
from __future__ import annotations

import getpass
import json
import math
import platform
import socket
import stat
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from actrace.format.schema import SPEC_MAJOR, SPEC_VERSION, VERSION

PREFIX = "actrace:"
KEYS = ("spec_version", "run_name", "run_id", "framework", "framework_version", "adapter",
        "adapter_version", "host", "created", "config", "probe_fingerprint", "probe_size", "mode", "status", "aliases")


__version__ = "0.2.0"  # this package's, written as `adapter_version` (pyproject reads it here)


class TraceError(Exception):
    """A trace that cannot be read: names the file and what is wrong."""


def make(*, run: str, framework: str, framework_version: str | None, adapter: str, config: dict | None,
         probe_fingerprint: str | None, probe_size: int | None, mode: str | None,
         aliases: dict[str, str] | None = None) -> dict[str, str]:
    """A new trace's metadata (unprefixed keys, string values; empty where unknown)."""
    return {
        "spec_version": SPEC_VERSION, "run_name": run, "run_id": uuid.uuid4().hex,
        "framework": framework, "framework_version": framework_version or "",
        "adapter": adapter, "adapter_version": __version__,
        "host": f"{getpass.getuser()}@{socket.gethostname()} ({platform.platform()})",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": json.dumps(finite(config or {}), sort_keys=True, default=str, allow_nan=False),
        "probe_fingerprint": probe_fingerprint or "", "probe_size": str(probe_size or ""), "mode": mode or "",
        "status": "running",  # until the writer closes: `complete`, or `failed: TYPE`
        **({"aliases": json.dumps(aliases, sort_keys=True)} if aliases else {}),
    }


def finite(value):
    """`value` with each non-finite float as its string ("nan", "inf"): JSON has no number for them,
    and a strict parser (jq, a browser, DuckDB) refuses Python's `NaN`."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(float(value))
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def encode(meta: dict[str, str]) -> dict[str, str]:
    """The Parquet key/value form: every key prefixed `actrace:`."""
    return {PREFIX + k: v for k, v in meta.items()}


MAX_FOOTER = 16 * 2 ** 20  # bytes of Parquet metadata a reader parses: a trace's are KiB (spec §Validity)
# what one Parquet file of a trace may declare, checked before its data are read (spec §Validity)
MAX_ROWS = 2 ** 20  # rows (readings)
MAX_DECODED = 4 * 2 ** 30  # bytes of its pages uncompressed, as its row groups declare them
MAX_UNITS = 2 ** 20  # units of a reading, as its `units` column says (read alone: at most 4 MiB)


def open_file(path: Path) -> pq.ParquetFile:
    """One Parquet file of a trace, opened once: its footer read, its pages' CRC checksums verified
    as they are read (a flipped bit is corruption, not a number). A footer that declares more than
    MAX_FOOTER bytes is refused before it is parsed: reading costs what the file holds, not what it
    claims. A local file that is not a regular one (a FIFO, a device) is refused without being opened.
    `path`: a local path, or an object-store location (`UPath`), read by ranges."""
    path = path if hasattr(path, "open") else Path(path)
    try:
        if isinstance(path, Path) and not stat.S_ISREG(path.stat().st_mode):  # asked before opening: a pipe blocks
            raise TraceError(f"{path}: not a regular file (a pipe, a device or a socket): not read")
        f = path.open("rb")  # an object's handle read on by the Parquet reader: each range fetched once
        size = f.seek(0, 2)
        f.seek(max(size - 8, 0))
        tail = f.read(8)
        if isinstance(path, Path):
            f.close()
        footer = int.from_bytes(tail[:4], "little")
        if size < 12 or tail[4:] != b"PAR1":
            raise TraceError(f"{path}: not a readable Parquet file (truncated, or not written as one)")
        if footer > min(MAX_FOOTER, size - 12):
            raise TraceError(f"{path}: its footer declares {footer} bytes of metadata "
                             f"({'more than the file holds' if footer > size - 12 else 'over the 16 MiB a trace may hold'})")
        pf = pq.ParquetFile(path if isinstance(path, Path) else f, page_checksum_verification=True)
        pf.schema_arrow  # noqa: B018 - its names decoded now: a name that is not UTF-8 is no trace's
        declared(pf, path)
        return pf
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file (truncated or corrupt?): {exc}") from None


def declared(pf: pq.ParquetFile, path) -> None:
    """Refuses a file that declares more work than a reader takes on: over MAX_ROWS rows or MAX_DECODED
    bytes uncompressed (its footer says), or a reading of over MAX_UNITS units (its `units` column
    says, read before any per-unit list is). A small file that declares millions of units or rows
    costs what it declares. (A column chunk's own metadata is not read here: pyarrow aborts the
    process on some corrupt ones, where its reader raises.)"""
    md = pf.metadata
    if md.num_rows > MAX_ROWS:
        raise TraceError(f"{path}: its footer declares {md.num_rows:,} rows, over the {MAX_ROWS:,} a trace file "
                         "may hold: not read")
    decoded = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
    if decoded > MAX_DECODED:
        raise TraceError(f"{path}: its footer declares {decoded:,} bytes uncompressed, over the "
                         f"{MAX_DECODED >> 30} GiB a trace file may hold: not read")
    if "units" in pf.schema_arrow.names and pa.types.is_integer(pf.schema_arrow.field("units").type):
        units = pc.max(pf.read(columns=["units"])["units"]).as_py()
        if units is not None and units > MAX_UNITS:
            raise TraceError(f"{path}: a reading declares {units:,} units, over the {MAX_UNITS:,} a reading may "
                             "hold: not read")


def read(path: Path) -> dict[str, str]:
    """The `actrace:` metadata of one Parquet file, as `parse` gives it."""
    return parse(open_file(path).schema_arrow, path)


def parse(schema: pa.Schema, path: Path) -> dict[str, str]:
    """The `actrace:` metadata of a file's schema (unprefixed), refusing a file of another major
    version with a message naming the version this actrace reads."""
    try:
        meta = {k.decode()[len(PREFIX):]: v.decode() for k, v in (schema.metadata or {}).items()
                if k.startswith(PREFIX.encode())}
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: its metadata is not UTF-8 ({exc})") from None
    version = meta.get("spec_version")
    if version is None:
        raise TraceError(f"{path}: not an actrace trace (no '{PREFIX}spec_version' metadata)")
    match = VERSION.fullmatch(version)
    if match is None:
        raise TraceError(f"{path}: spec version {version[:40]!r} is not MAJOR.MINOR (two numbers of at most 4 digits, "
                         "no leading zero)")
    if int(match.group(1)) != SPEC_MAJOR:
        raise TraceError(f"{path}: trace spec version {version} is not supported; this actrace "
                         f"reads {SPEC_MAJOR}.x (it implements {SPEC_VERSION})")
    return meta
