"""Lake bench: a fleet of runs (bench/fleet.py: 32 layers × 20 readings, a pathology each) in a lake
on a local S3 server (moto), summarized whole and by one project's partition, on the Polars analyzer
and on DuckDB: wall seconds, and the bytes fetched from the store against the lake's size (what the
column projection and the partition pruning save). Then Spark in local mode over local lakes of
growing size: its seconds per run, which a cluster would keep flat.

Run: .venv/bin/python bench/bench_lake.py [--runs 40] [--spark-runs 100 400]
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def s3_server() -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return server
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the S3 server did not start")


def lake(fleet: list[Path], root: str, projects: int = 2) -> None:
    """The fleet's traces as a lake at `root`: project=p0, p1, … in turn, one run each."""
    from actrace.files.lake import lake_path
    from actrace.files.location import location

    for i, f in enumerate(fleet):
        where = location(lake_path(root, f.stem, f"p{i % projects}"))
        if isinstance(where, Path):
            where.parent.mkdir(parents=True, exist_ok=True)
        where.write_bytes(f.read_bytes())


class Fetched:
    """Bytes the S3 client fetched while in the block (every ranged GET of s3fs)."""

    def __enter__(self):
        import s3fs.core

        self.bytes, self._fetch = 0, s3fs.core.S3File._fetch_range
        outer = self

        def counted(file, start, end):
            data = outer._fetch(file, start, end)
            outer.bytes += len(data)
            return data
        s3fs.core.S3File._fetch_range = counted
        return self

    def __exit__(self, *exc):
        import s3fs.core

        s3fs.core.S3File._fetch_range = self._fetch


def summarized(where: str, engine: str) -> tuple[float, int, int]:
    """Seconds, bytes fetched and runs of the metric table and findings of `where` on `engine`."""
    from actrace.analyzer import analyze

    with Fetched() as got:
        t0 = time.perf_counter()
        a = analyze(where, engine=engine)
        len(a.findings)
        wall = time.perf_counter() - t0
    return wall, got.bytes, len(a.runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--spark-runs", type=int, nargs="*", default=[100, 400])
    args = ap.parse_args()
    from fleet import write_fleet

    import s3fs

    server = s3_server()
    try:
        with tempfile.TemporaryDirectory() as d:
            fleet = write_fleet(Path(d) / "fleet", max([args.runs, *args.spark_runs]))
            s3fs.S3FileSystem().mkdir("bench")
            lake(fleet[: args.runs], "s3://bench/lake")
            size = sum(f.stat().st_size for f in fleet[: args.runs])
            print(f"lake of {args.runs} runs x 32 layers x 20 readings in two projects on a local S3 server: "
                  f"{size / 2**20:.1f} MiB")
            for engine in ("polars", "duckdb"):
                for where in ("s3://bench/lake/project=p0", "s3://bench/lake", "s3://bench/lake"):
                    wall, fetched, runs = summarized(where, engine)
                    print(f"  {engine:6} {where:28} {runs:4} runs  {wall:6.2f} s  fetched {fetched / 2**20:6.1f} MiB "
                          f"({fetched / size:.0%} of the lake)")
            for n in args.spark_runs:
                local = Path(d) / f"lake{n}"
                lake(fleet[:n], str(local))
                t0 = time.perf_counter()
                runs = len(__import__("actrace.analyzer", fromlist=["analyze"]).analyze(local, engine="spark").runs)
                wall = time.perf_counter() - t0
                print(f"  spark local[2], local lake of {runs} runs: {wall:6.1f} s, {1000 * wall / runs:.0f} ms per run")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
