"""Analyzer bench: a synthetic corpus of RUNS runs × 32 layers × 100 readings × 512 units.

Times `actrace summary --format json` (a fresh process, as a user runs it) against the floor of
reading the same columns with pyarrow alone, and against the per-layer dead fraction computed
by DuckDB in one SQL query; peak memory (max RSS) of the summary; growth with 5, 10, 20 runs;
`actrace report` time and HTML size.
With --runs N: `actrace summary` (findings, layer table, partings) of N runs and of a tenth of
them, as a fresh process: seconds, peak memory and the bytes it read (issue goal at 1,000 runs:
<= 2 minutes and <= 1 GB on 2 cores), and of a hundredth of them from 10,000 on; with --engine
spark the same through Spark local[2]; --shape LAYERSxREADINGSxUNITS makes runs of another size
(10,000 runs of the default shape are 143 GiB: `--runs 10000 --shape 32x3x16` fits a small disk).
With --fleet: `actrace diff` of 2 and of 200 runs, and the 200-run report's size and drawing time;
with --many-layers: `summary` of one run of 10,000 small layers × 3 readings.
Run: .venv/bin/python bench/bench_analyzer.py [--out DIR] [--runs N [--engine spark] [--shape 32x100x512]]
     [--fleet | --many-layers]
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

import actrace
from actrace.analyzer.metrics import _READ
from actrace.files.reader import trace_sources
from actrace.files.writer import PARQUET_OPTIONS

LAYERS, READINGS, UNITS, BATCH = 32, 100, 512, 64


TEMPLATES = 20  # runs recorded by the writer; the rest of a corpus are their copies under new names


def make_corpus(out: Path, runs: int, layers: int = LAYERS, readings: int = READINGS, units: int = UNITS) -> None:
    """`runs` traces in `out` of `layers` × `readings` × `units`: the first TEMPLATES recorded by the
    writer, each with its own dead units; every later one a copy of one of them under its own run
    name and id (seconds each)."""
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    for r in range(runs):
        path = out / f"run{r:04d}.parquet"
        if path.exists():
            continue
        if r >= TEMPLATES:
            copy_run(out / f"run{r % TEMPLATES:04d}.parquet", path, f"run{r:04d}")
            continue
        with actrace.Writer(path, run=f"run{r:04d}", flush_every=4096) as w:
            for step in range(readings):
                for layer in range(layers):
                    h = rng.normal(size=(BATCH, units)).astype(np.float32)
                    h[:, : (step * r) % min(64, units)] = -1
                    w.record_activation(step * 100, f"block{layer:02d}.act", np.maximum(h, 0),
                                        kind="relu")
        print(f"  wrote {path.name}", file=sys.stderr, flush=True)


def copy_run(template: Path, path: Path, name: str) -> None:
    """`template`'s readings as another run: its rows' and metadata's run name, a new run id."""
    import uuid

    t = pq.read_table(template)
    t = t.set_column(t.column_names.index("run"), "run", pa.array([name] * len(t), t.schema.field("run").type))
    meta = {**t.schema.metadata, b"actrace:run_name": name.encode(), b"actrace:run_id": uuid.uuid4().hex.encode()}
    pq.write_table(t.replace_schema_metadata(meta), path, **PARQUET_OPTIONS)


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return wall, max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before) / 1024


def in_process(files: list[Path]) -> float:
    """`summary --format json`'s work without the interpreter's start-up."""
    from actrace.analyzer.metrics import metrics
    from actrace.analyzer.summary import machine_metrics

    t0 = time.perf_counter()
    machine_metrics(metrics(files), "json")
    return time.perf_counter() - t0


def pyarrow_floor(files: list[Path]) -> float:
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    for f in files:
        pq.read_table(f, columns=_READ)
    return time.perf_counter() - t0


def duckdb_dead_fraction(files: list[Path]) -> float:
    import duckdb

    con = duckdb.connect()
    t0 = time.perf_counter()
    con.sql(f"""
        SELECT run, layer, step,
               list_count(list_filter(list_zip(unit_min, unit_max),
                                      lambda z: z[1] >= 0 AND z[2] <= 0)) / units AS dead_fraction
        FROM read_parquet({[str(f) for f in files]})
        WHERE stream = 'activation'
    """).fetchall()
    return time.perf_counter() - t0


MEASURED = """import atexit, resource, runpy, sys
def said():
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"MEASURED {io['rchar']} {peak}", file=sys.__stderr__)
atexit.register(said)
sys.argv = ["actrace", *sys.argv[1:]]
runpy.run_module("actrace.cli", run_name="__main__")
"""


def measured(args: list[str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and bytes read (every read call's, the page cache's included)
    of `actrace ARGS` as a fresh process."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURED, *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"actrace {' '.join(args[:3])} … failed:\n{done.stderr[-2000:]}")
    read, peak = done.stderr.rsplit("MEASURED ", 1)[1].split()
    return wall, int(peak) / 1024, int(read)


def at_scale(out: Path, runs: int, engine: str, shape: tuple[int, int, int]) -> None:
    """`actrace summary` of `runs` runs, of a tenth of them and (from 10,000) of a hundredth: the
    issue's goal at 1,000 runs is <= 2 minutes in <= 1 GB on 2 cores; the cost per run flat."""
    print(f"building a corpus of {runs} runs (once; {TEMPLATES} recorded, the rest copied)…", file=sys.stderr)
    make_corpus(out, runs, *shape)
    print(f"actrace summary --engine {engine}, a fresh process, runs of {' x '.join(map(str, shape))} "
          f"(layers x readings x units):")
    print(f"{'runs':>6} {'readings':>10} {'seconds':>8} {'per run ms':>10} {'peak MiB':>9} {'read GiB':>9} "
          f"{'corpus GiB':>10}")
    for n in sorted({max(1, runs // 10), runs} | ({runs // 100} if runs >= 10_000 else set())):
        files = [str(out / f"run{r:04d}.parquet") for r in range(n)]
        size = sum(Path(f).stat().st_size for f in files)
        wall, peak, read = measured(["summary", "--engine", engine, *files])
        print(f"{n:>6} {n * shape[0] * shape[1]:>10,} {wall:>8.1f} {1000 * wall / n:>10.0f} {peak:>9.0f} "
              f"{read / 2**30:>9.2f} {size / 2**30:>10.2f}", flush=True)


def fleet(out: Path) -> None:
    """`actrace diff` of 2 and of 200 runs, and the 200-run report: its size and how long Chromium
    takes to draw it (median of 3 loads)."""
    import statistics

    from fleet import write_fleet

    from actrace.analyzer import analyze
    from actrace.analyzer.diff import diff

    paths = sorted(out.glob("*.parquet")) if (out / "run199-lr0.005.parquet").exists() else write_fleet(out, 200)
    for n in (2, 200):
        a = analyze(paths[:n])
        names = [m["run_name"] for m in a.runs]
        t0 = time.perf_counter()
        found = diff(a.aligned, names[:1], names[1:])
        print(f"diff of {n} runs × 32 layers × 20 readings: {time.perf_counter() - t0:.2f} s "
              f"({len(found.partings)} partings)")
    report = out.parent / "fleet-report.html"
    wall, peak = timed([sys.executable, "-m", "actrace.cli", "report", str(out), "-o", str(report), "--force"])
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"]
    loads = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=args)
        for _ in range(3):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            t0 = time.perf_counter()
            page.goto(report.as_uri())
            page.wait_for_selector("body[data-ready=yes]", timeout=120_000)
            loads.append(time.perf_counter() - t0)
            page.close()
        browser.close()
    print(f"report of 200 runs: written in {wall:.1f} s (peak {peak:.0f} MiB), {report.stat().st_size / 2**20:.1f} MiB, "
          f"drawn by Chromium in {statistics.median(loads):.2f} s (median of 3: {', '.join(f'{t:.2f}' for t in loads)})")


def many_layers(path: Path, layers: int = 10_000, steps: int = 3) -> None:
    """`actrace summary` of a run of many small layers, as a fresh process (start-up included)."""
    from actrace.reduce import reduce_arrays

    if not path.exists():
        rng = np.random.default_rng(0)
        path.parent.mkdir(parents=True, exist_ok=True)
        with actrace.Writer(path, run="many", flush_every=10 ** 6) as w:
            for step in range(steps):
                w.record_many(step, reduce_arrays([(rng.normal(size=(8, 16)).astype(np.float32), 1,
                                                    "relu" if i % 2 else "linear", dict(layer=f"blocks.{i}"))
                                                   for i in range(layers)]), layer_indexes=list(range(layers)))
    wall, peak = timed([sys.executable, "-m", "actrace.cli", "summary", "-o", "/dev/null", str(path)])
    print(f"summary of {layers:,} layers x {steps} readings: {wall:.2f} s (goal <= 5 s), peak {peak:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/actrace-bench-corpus"))
    parser.add_argument("--fleet", action="store_true", help="only the 200-run fleet: diff times, report size and draw")
    parser.add_argument("--runs", type=int, help="only `summary` of this many runs and of a tenth of them")
    parser.add_argument("--engine", default="polars", choices=["polars", "duckdb", "spark"],
                        help="with --runs: the engine of the metric table (default polars)")
    parser.add_argument("--shape", default=f"{LAYERS}x{READINGS}x{UNITS}",
                        help="with --runs: each run's layers x readings x units (default %(default)s)")
    parser.add_argument("--many-layers", action="store_true",
                        help="only `summary` of one run of 10,000 layers x 3 readings (goal: <= 5 s)")
    args = parser.parse_args()
    if args.fleet:
        fleet(args.out.with_name(args.out.name + "-fleet"))
        return
    if args.runs:
        shape = tuple(int(n) for n in args.shape.split("x"))
        if len(shape) != 3:
            parser.error(f"--shape {args.shape}: give LAYERSxREADINGSxUNITS, such as 32x3x16")
        default = shape == (LAYERS, READINGS, UNITS)
        at_scale(args.out if default else args.out.with_name(f"{args.out.name}-{args.shape}"), args.runs, args.engine,
                 shape)
        return
    if args.many_layers:
        many_layers(args.out.with_name(args.out.name + "-layers") / "many.parquet")
        return
    print("building corpus (once)…", file=sys.stderr)
    make_corpus(args.out, 20)
    actrace_cmd = [sys.executable, "-m", "actrace.cli"]
    print("in process (no interpreter start-up):")
    print(f"{'runs':>5} {'metrics+json s':>15} {'pyarrow s':>10} {'ratio':>6} {'duckdb s':>9} {'vs duckdb':>9}")
    for runs in (5, 10, 20):
        files = [args.out / f"run{r:04d}.parquet" for r in range(runs)]
        floor = min(pyarrow_floor(files) for _ in range(3))
        duck = min(duckdb_dead_fraction(files) for _ in range(3))
        ours = min(in_process(files) for _ in range(3))
        print(f"{runs:>5} {ours:>15.2f} {floor:>10.2f} {ours / floor:>6.2f} {duck:>9.2f} {ours / duck:>9.2f}")
    print("as a user runs it (fresh processes, start-up included):")
    print(f"{'runs':>5} {'summary s':>10} {'pyarrow s':>10} {'ratio':>6} {'peak MiB':>9}")
    for runs in (5, 10, 20):
        files = [str(args.out / f"run{r:04d}.parquet") for r in range(runs)]
        floor, _ = timed([sys.executable, "-c", "import sys, pyarrow.parquet as pq\n"
                          f"for f in sys.argv[1:]: pq.read_table(f, columns={_READ!r})", *files])
        wall, peak = timed(actrace_cmd + ["summary", "--format", "json", "-o", "/dev/null", *files])
        print(f"{runs:>5} {wall:>10.2f} {floor:>10.2f} {wall / floor:>6.2f} {peak:>9.0f}")
    files = [str(args.out / f"run{r:04d}.parquet") for r in range(20)]
    report = args.out / "report.html"
    wall, peak = timed(actrace_cmd + ["report", *files, "-o", str(report)])
    print(f"report of 20 runs: {wall:.1f} s, {report.stat().st_size / 2**20:.1f} MiB HTML, peak {peak:.0f} MiB")
    size = sum(p.stat().st_size for p in trace_sources(files))
    print(f"corpus: {len(files)} traces, {size / 2**20:.0f} MiB on disk")


if __name__ == "__main__":
    main()
