"""Where traces live: a local path, or an object-store URL (`s3://`, `gs://`, `az://`, any fsspec
protocol) as a `UPath`, which has the same operations, so the code that reads and writes traces is
one. What a local disk alone has (a lock, fsync, a rename) stays the local path's; an object's
single PUT is atomic by itself. Credentials come from the protocol's standard environment and
profile (for S3, `AWS_*` and `AWS_ENDPOINT_URL` for a server of one's own); none is printed.
"""
from __future__ import annotations

import glob as _glob
import shutil
from pathlib import Path


def location(path):
    """`path` as a local `Path`, or a `UPath` where it is a URL (`file://` is local)."""
    if isinstance(path, Path) or remote(path):
        return path
    text = str(path)
    if "://" not in text:
        return Path(text)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    try:
        from upath import UPath
    except ImportError:
        raise ValueError(f"{text}: reading and writing object storage needs the cloud extra: "
                         "pip install 'actrace[cloud]' (and the protocol's fsspec package: s3fs, gcsfs, adlfs)") from None
    try:
        return UPath(text)
    except (ValueError, ImportError) as exc:  # an unknown protocol, or its fsspec package not installed
        raise ValueError(f"{text}: {exc}") from None


def remote(path) -> bool:
    """Whether `path` is an object-store location (a `UPath` of a protocol other than local)."""
    return type(path).__module__.startswith("upath") and getattr(path, "protocol", "") not in ("", "file", "local")


def has_magic(pattern) -> bool:
    return _glob.has_magic(str(pattern))


def glob(pattern) -> list:
    """The locations a glob pattern matches, sorted; local patterns by the local glob."""
    where = location(pattern)
    if not remote(where):
        return [Path(p) for p in sorted(_glob.glob(str(pattern)))]
    protocol = where.protocol
    return [location(f"{protocol}://{p}") for p in sorted(where.fs.glob(str(where)))]


def remove(path) -> None:
    """Remove a file or a folder of part files, if it is there."""
    if remote(path):
        if path.exists():
            path.fs.rm(path.path, recursive=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
