"""The `actrace` command: the top floor, the one place that knows the core, the adapters and the analyzer."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

from actrace.files.reader import TraceError, trace_sources
from actrace.format.schema import shown

EXAMPLES = """examples:
  actrace demo                                          # the main job on built-in data
  actrace record model.onnx --probe probe.npz -o runs/b.parquet
  actrace record -o runs/a.parquet -- python train.py   # a script using actrace.adapters.torch.Monitor
  actrace report runs/*.parquet -o report.html --baseline a
  actrace summary runs/ --format csv > metrics.csv
  actrace findings runs/*.parquet --format json -o findings.json
  actrace check runs/*.parquet --max-dead 0.2 --no-nan
  actrace diff runs/base.parquet runs/lr-x20.parquet      # where and when a run parts from a baseline
  actrace diff runs/seed*.parquet -- runs/new.parquet     # the baseline's band from several seeds
  actrace sweep runs/width-*.parquet --by width           # µP-style coordinate check; rules along lr, …
  actrace validate runs/*.parquet
  actrace inspect runs/a.parquet --json
  actrace record -o s3://bucket/runs/a.parquet -- python train.py    # object storage (the cloud extra)
  actrace record --lake s3://bucket/lake --project vision --run lr3 -- python train.py
  actrace summary s3://bucket/lake/project=vision                  # a lake's partition, read alone
  actrace summary s3://bucket/lake --engine duckdb                  # the metrics by DuckDB (or spark)
  actrace summary runs/*.parquet --engine spark --spark-conf spark.driver.memory=4g
  actrace sql --dialect spark > metrics.sql                         # the spec's metrics as SQL
"""


# what a terminal must not receive raw from a trace: controls (but the line breaks and tabs of our own
# text), line and paragraph separators, bidirectional controls
_CONTROL = {ord(c): shown(c) for c in map(chr, range(0x2070)) if shown(c) != c and c not in "\n\t"}


class Escaped:
    """A text stream that writes control characters escaped (`\\x1b`): names and metadata come from
    traces other people wrote, and must not clear, retitle or fake lines on the reader's terminal."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(text.translate(_CONTROL))

    def __getattr__(self, name):
        return getattr(self.stream, name)


EXTRAS = {"torch": "torch", "onnx": "onnx", "onnxruntime": "onnx", "polars": "report", "altair": "report",
          "vl_convert": "report", "transformers": "hf", "accelerate": "hf",
          "lightning": "lightning", "keras": "keras", "jax": "jax"}  # module → the pyproject extra that installs it


def progress(message: str) -> None:
    print(f"actrace: {message}…", file=sys.stderr, flush=True)


def analysis(args):
    """Every trace read once, with the analyzer commands' common options."""
    from actrace.analyzer.analysis import analyze
    from actrace.analyzer.compare import load_mapping
    from actrace.analyzer.metrics import Thresholds
    from actrace.analyzer.rules import REGISTRY, Rules

    th = Thresholds(args.dead_eps, args.sat_threshold, args.dormant_tau)
    unknown = sorted(set(getattr(args, "allow", ())) - set(REGISTRY))
    if unknown:
        raise ValueError(f"--allow {unknown[0]!r} is not a rule; the rules are {', '.join(sorted(REGISTRY))}")
    if getattr(args, "output", None):  # refused before any work: an input, a link, another kind of file
        from actrace.files.output import check

        check(args.output, output_kind(args), trace_sources(args.paths), args.force)
    progress("reading traces, computing metrics and findings")
    a = analyze(args.paths, th, Rules(**given_thresholds(args)),
                mapping=load_mapping(args.mapping) if args.mapping else None, x=args.x,
                skip_invalid=args.skip_invalid, engine=args.engine, spark=spark_settings(args))
    if not a.read and args.command not in ("check", "findings"):  # those two say why: run_empty, run_unfinished
        said = "; ".join(f.evidence for f in a.findings if f.rule in ("run_empty", "run_unfinished"))
        raise ValueError(f"no readings in {' '.join(args.paths)}" + (f" ({said})" if said else ""))
    return a


def given_thresholds(args) -> dict:
    """The rule thresholds given on the command line (the registry's flags), by name."""
    from actrace.analyzer.rules import THRESHOLDS

    return {name: getattr(args, name) for name in THRESHOLDS if getattr(args, name, None) is not None}


def spark_settings(args) -> dict:
    """--engine spark's settings from --spark-master, --spark-scratch and each --spark-conf KEY=VALUE."""
    conf = {"spark.master": args.spark_master}
    for item in args.spark_conf:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--spark-conf {item!r}: expected KEY=VALUE, e.g. spark.driver.memory=6g")
        conf[key.strip()] = value
    if args.spark_scratch:
        conf["actrace.scratch"] = args.spark_scratch
    return conf


def output_kind(args) -> str:
    """What an analyzer command writes to -o: its report, or its answer in the format asked."""
    return "report" if args.command == "report" else args.format


def emit(text: str, args, what: str) -> None:
    """Write a command's answer to its -o (spec of actrace.files.output: never over an input, a link or
    another kind of file; atomically), saying so, or to stdout."""
    if args.output:
        from actrace.files.output import write

        write(args.output, text, output_kind(args), trace_sources(args.paths), args.force)
        progress(f"wrote {what} to {args.output}")
    else:
        sys.stdout.write(text)


def cmd_summary(args) -> int:
    from actrace.analyzer.summary import NO_BASELINE, format_findings, format_parting, layer_table, machine_metrics

    a = analysis(args)
    if args.format != "text":
        emit(machine_metrics(a.metrics, args.format), args, f"{a.metrics.height} metric rows")
        return 0
    baseline = a.baseline(args.baseline)
    if baseline is not None:
        progress("comparing runs")
        parted = a.parted(baseline)
    print(format_findings(a.findings))
    print()
    print(layer_table(a.latest))
    others = [m["run_name"] for m in a.read if baseline is None or m["run_name"] not in baseline.runs]
    if len(a.read) > 1 or baseline is not None:
        print()
        print(format_parting(parted, baseline, others) if baseline is not None else NO_BASELINE)
    if args.by:
        from actrace.analyzer.sweep import as_text, sweep

        print()
        print(as_text(sweep(a.latest_aligned, a.findings, a.runs, args.by)), end="")
    return 0


def cmd_report(args) -> int:
    from actrace.analyzer.report import build_report
    from actrace.analyzer.summary import format_findings

    a = analysis(args)
    page = build_report(a, baseline=a.baseline(args.baseline), progress=progress)
    emit(page, args, "the report")
    print(format_findings(a.findings))
    print(f"report: {args.output} ({len(page.encode()) / 2**20:.1f} MiB; open it in any browser, it works offline)")
    return 0


def cmd_findings(args) -> int:
    from actrace.analyzer.summary import format_findings, machine_findings

    a = analysis(args)
    found = a.findings
    emit(format_findings(found) + "\n" if args.format == "text" else machine_findings(found, args.format),
         args, f"{len(found)} findings")
    return 0


def cmd_check(args) -> int:
    from actrace.analyzer.check import as_json, as_junit, as_text, gate

    a = analysis(args)
    runs = [meta.get("run_name") for meta in a.runs]
    g = gate(a.latest, a.findings, runs, given=given_thresholds(args), no_nan=args.no_nan, fail_on=args.fail_on,
             allow=set(args.allow), strict=args.strict, require_finished=args.require_finished)
    if args.format != "text":
        for note in g.notes:  # said once, beside the machine's answer
            print(f"actrace check: note: {note}", file=sys.stderr)
    text = {"text": lambda: as_text(g), "json": lambda: as_json(g), "junit": lambda: as_junit(g)}[args.format]()
    emit(text, args, f"the check of {len(runs)} run(s)")
    return 0 if g.passed else 1


def cmd_diff(args) -> int:
    from actrace.analyzer.diff import METRICS, as_csv, as_json, as_text

    if args.compared == []:
        raise ValueError("nothing after --: give the runs to compare there, actrace diff A1 A2 -- B")
    if args.compared:  # diff A1 A2 A3 -- B C: the baseline's seeds, then the runs compared with them
        base_paths, args.paths = args.paths, args.paths + args.compared
    else:
        if len(args.paths) < 2:
            raise ValueError("give a baseline and at least one run to compare: actrace diff A B [C ...], or "
                             "several seeds of the baseline: actrace diff A1 A2 A3 -- B")
        base_paths = args.paths[:1]
    bad = sorted(set(args.metrics) - set(METRICS))
    if bad:
        raise ValueError(f"--metrics {bad[0]!r} is not a metric diff compares; they are {', '.join(METRICS)}")
    base_files = {str(s) for s in trace_sources(base_paths, unwritten=True)}
    a = analysis(args)
    empty = {m["run_name"] for m in a.runs} - {m["run_name"] for m in a.read}  # nothing to compare: said, no pass
    baselines = [m["run_name"] for m in a.read if m["file"] in base_files]
    runs = [m["run_name"] for m in a.runs if m["file"] not in base_files]
    if not runs:
        raise ValueError("every trace given is a baseline: put the runs to compare after --")
    if not baselines:
        raise ValueError(f"the baseline's trace ({', '.join(base_paths)}) holds no reading: nothing to compare with")
    progress(f"comparing {len(runs)} run(s) with {', '.join(baselines)}")
    read = [r for r in runs if r not in empty]
    d = a.compared(baselines, read, persist=args.persist, sigmas=args.sigmas, metrics=args.metrics)
    d.unread = [r for r in runs if r in empty]
    unread = "".join(f"{shown(r)}: holds no reading: nothing compared\n" for r in d.unread)
    if args.format == "csv":  # a table of partings has no row for them: said beside it
        sys.stderr.write(unread)
    emit({"text": lambda: unread + (as_text(d, read) if read else ""), "json": lambda: as_json(d),
          "csv": lambda: as_csv(d)}[args.format](), args, f"{len(d.partings)} parting(s)")
    return 1 if d.partings or d.unread else 0


def cmd_sweep(args) -> int:
    from actrace.analyzer.sweep import as_json, as_text, sweep

    a = analysis(args)
    s = sweep(a.latest_aligned, a.findings, a.runs, args.by)
    emit(as_text(s) if args.format == "text" else as_json(s), args, f"the sweep over {args.by}")
    return 0


def cmd_sql(args) -> int:
    from actrace.analyzer.metrics import Thresholds
    from actrace.analyzer.sql import metrics_sql

    print(metrics_sql(args.dialect, Thresholds(args.dead_eps, args.sat_threshold, args.dormant_tau), args.table))
    return 0


def cmd_validate(args) -> int:
    from actrace.files.validate import validate_source

    n_bad = 0
    for source in _traces_named(args.paths):  # a path that names nothing is a usage error: exit 2
        problems = validate_source(source)
        for p in problems:
            print(p)
        n_bad += bool(problems)
        if not problems and not args.quiet:
            print(f"{source}: valid")
    return 1 if n_bad else 0


def _traces_named(paths) -> list:
    """The traces `paths` name; a folder that holds none names nothing (exit 2), as a missing path."""
    sources = trace_sources(paths)
    if not sources:
        raise TraceError(f"no trace in {' '.join(map(str, paths))}")
    return sources


def cmd_inspect(args) -> int:
    from actrace.files.describe import describe, format_description

    out = [describe(s) for s in _traces_named(args.paths)]
    print(json.dumps(out if len(out) > 1 else out[0], indent=2) if args.json
          else "\n\n".join(format_description(d) for d in out))
    return 0


def _config(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--config expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _stamp(path) -> float | None:
    """When the trace at `path` (or its part files) last changed; None if there is none."""
    from actrace.files.location import location
    from actrace.files.writer import parts_dir

    times = [_mtime(p) for p in (location(path), parts_dir(location(path))) if p.exists()]
    return max((t for t in times if t is not None), default=None) if times else None


def _mtime(path) -> float | None:
    """A file's change time; for a folder of objects (which has none), its newest object's."""
    try:
        return path.stat().st_mtime
    except (OSError, AttributeError, KeyError, NotImplementedError):
        return max((_mtime(p) or 0.0 for p in path.glob("part-*.parquet")), default=None) if path.is_dir() else None


def report_trace(path, before: float | None = None) -> None:
    """Say where the trace this run recorded is, how many readings and steps it holds, and its
    size; `before`: the trace's stamp before the run, so an older trace is not reported as new."""
    from actrace.files.describe import describe
    from actrace.files.location import location
    from actrace.files.writer import parts_dir

    path = location(path)
    source = path if path.exists() else parts_dir(path)
    if not source.exists() or (before is not None and _stamp(path) == before):
        older = " (the trace there is an older one)" if source.exists() else ""
        print(f"actrace record: no trace was written at {path} by this run{older}", file=sys.stderr)
        return
    d = describe(source)
    state = "" if source == path else " (not compacted: the run did not close its Monitor/Writer)"
    print(f"actrace record: trace {source}{state}: {d['readings']} readings, {d['steps']['count']} steps, "
          f"{len(d['layers'])} layers, {d['size_bytes'] / 1024:.1f} KiB", file=sys.stderr)


def cmd_record(args) -> int:
    import subprocess

    if args.lake:
        if not args.run:
            raise ValueError("--lake needs --run NAME: a lake holds each run under its name")
        from actrace.files.lake import lake_path

        args.output = lake_path(args.lake, args.run, args.project)
    config = _config(args.config)
    if args.model:
        if args.command_line:
            raise ValueError("give either MODEL.onnx ... or -- COMMAND, not both")
        first = args.model[0]
        if not first.endswith(".onnx") and not any(c in first for c in "*?["):
            raise ValueError(f"{first!r} is not an ONNX model; to record a training script, put -- before it: "
                             f"actrace record -o {args.output} -- {' '.join(args.model)}")
        from actrace.adapters.onnx import record_onnx

        record_onnx(args.model, args.probe, args.output, run=args.run, config=config, layers=args.layers,
                    op_types=args.op_types, steps=args.steps, step_pattern=args.step_pattern,
                    chunk=args.chunk, overwrite=args.overwrite, progress=not args.quiet)
        report_trace(args.output)
        return 0
    if not args.command_line:
        raise ValueError("nothing to record: give MODEL.onnx --probe FILE, or -- python train.py ARGS")
    if args.command_line[0] in ("python", "python3"):  # the interpreter actrace (and its torch) runs in
        args.command_line = [sys.executable] + args.command_line[1:]
    env = dict(os.environ, ACTRACE_OUT=str(args.output), ACTRACE_CONFIG=json.dumps(config),
               ACTRACE_OVERWRITE="1" if args.overwrite else "0")
    if args.run:
        env["ACTRACE_RUN"] = args.run
    before = _stamp(args.output)
    try:
        code = subprocess.call(args.command_line, env=env)
    except FileNotFoundError:
        raise ValueError(f"cannot run {args.command_line[0]!r}: no such program") from None
    report_trace(args.output, before)
    return code


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.output)


def number(low: float = -math.inf, high: float = math.inf, *, above: bool = False):
    """An option's type: a finite float in [low, high] (above `low` where `above`). NaN compares false
    with every limit, so a NaN threshold would switch its gate off: refused, as ±inf."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            where = f" in [{low:g}, {high:g}]" if high < math.inf else \
                f" {'above' if above else 'at least'} {low:g}" if low > -math.inf else ""
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number{where}")
        return value
    return parse


def count(text: str) -> int:
    """An option's type: a whole number of 1 or more."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of 1 or more")
    return int(text)


def baseline_option(p) -> None:
    """--baseline, of the commands that compare runs with one (summary, report; diff takes its first path)."""
    p.add_argument("--baseline", metavar="RUN", help="run the others are compared with, or KEY=VALUE: the runs whose "
                   "config holds it (a baseline's seeds); default: baseline = \"RUN\" in actrace.toml (here or in a "
                   "folder above), else none (never the file that sorts first)")


def version() -> str:
    """The package's version, the trace format's and the rules'."""
    from actrace.format.metadata import __version__
    from actrace.format.schema import SPEC_VERSION

    try:
        from actrace.analyzer.rules import RULES_VERSION
    except ModuleNotFoundError:  # the analyzer's extra is not installed
        RULES_VERSION = "(not installed: pip install 'actrace[report]')"
    return f"actrace {__version__} (trace format {SPEC_VERSION}, rules {RULES_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actrace", description=__doc__.split(":")[0] + ": per-layer "
                                     "activation and gradient health traces.", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("demo", help="train five small runs that go wrong in the classic ways, record and report",
                       description="The main job on built-in synthetic data (no downloads, about a minute on two "
                       "CPU cores): trains five small PyTorch runs (healthy, dying ReLU, saturated tanh, vanishing "
                       "gradients, NaN), exports one to ONNX and records it through ONNX Runtime, then writes "
                       "DIR/runs/*.parquet and DIR/report.html and prints the findings.")
    p.add_argument("-o", "--output", default="actrace-demo", metavar="DIR", help="where to write (default actrace-demo)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("record", help="record a trace: an ONNX model on a probe, or a training script",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Record MODEL.onnx (one reading per checkpoint) on a probe through ONNX Runtime, "
                       "or run `-- COMMAND ...` with the output path and run metadata handed over in environment "
                       "variables (ACTRACE_OUT, ACTRACE_RUN, ACTRACE_CONFIG) so a Monitor built without out= "
                       "writes there. The command's exit code passes through.")
    p.add_argument("model", nargs="*", metavar="MODEL.onnx", help="ONNX model files (checkpoints, globs); "
                   "or, after --, the command to run")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("-o", "--output", metavar="TRACE",
                       help="trace to write: runs/NAME.parquet, or a URL (s3://bucket/runs/NAME.parquet)")
    where.add_argument("--lake", metavar="LAKE", help="write into the partitioned lake at LAKE (a folder or a URL): "
                       "LAKE/project=P/run=R/trace.parquet, which DuckDB, Polars and Spark read as one table; needs --run")
    p.add_argument("--project", default="default", help="the lake's project partition (default: default)")
    p.add_argument("--run", help="run name (default: the trace's file name)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="run metadata (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing trace")
    p.add_argument("--probe", metavar="FILE",
                   help="ONNX: .npz (arrays by input name) or .npy (one input), at most 1 GiB uncompressed")
    p.add_argument("--layers", action="append", metavar="PATTERN", help="ONNX: node or output name glob")
    p.add_argument("--op-types", metavar="OPS", help="ONNX: comma-separated op types to read (e.g. Relu,Tanh)")
    p.add_argument("--steps", metavar="N,N,...", help="ONNX: the step of each checkpoint, in the order given")
    p.add_argument("--step-pattern", metavar="REGEX", help="ONNX: regex whose first group is the step in a file name")
    p.add_argument("--chunk", type=int, default=256, metavar="N", help="ONNX: probe examples per run (default 256)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_record)
    p = sub.add_parser("validate", help="check traces against the spec (exit 1 if any is invalid)")
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files, .parts dirs, globs or folders")
    p.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("inspect", help="run metadata, layers, steps, streams and size of traces")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    try:
        from actrace.analyzer.rules import THRESHOLDS
    except ModuleNotFoundError:  # the analyzer's extra is not installed: its commands say so when run
        THRESHOLDS = {}

    def analyzer_command(name, help_text, func):
        p = sub.add_parser(name, help=help_text, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("paths", nargs="+", metavar="PATH", help="trace files, .parts dirs, globs or folders")
        p.add_argument("--dead-eps", type=number(0), default=0.0, metavar="EPS",
                       help="a unit is dead when max |h| over the probe is <= EPS (default 0)")
        p.add_argument("--sat-threshold", type=number(), default=0.99, metavar="T",
                       help="saturated when within (1-T) of a bound, e.g. |tanh| >= T (default 0.99)")
        p.add_argument("--dormant-tau", type=number(), default=0.1, metavar="TAU",
                       help="a live unit is dormant when its RMS is <= TAU x the layer's mean unit RMS (default 0.1)")
        p.add_argument("--x", choices=["step", "progress"], default="step",
                       help="align runs by step or by fraction of training")
        p.add_argument("--mapping", metavar="FILE", help="layer alignment: CSV run,layer,aligned or JSON")
        p.add_argument("--force", action="store_true",
                       help="let -o replace an existing file that is not an actrace output of this kind")
        p.add_argument("--skip-invalid", action="store_true",
                       help="leave out traces that cannot be read or break the spec (each named), instead of stopping")
        p.add_argument("--engine", choices=["polars", "duckdb", "spark"], default="polars",
                       help="what computes the metrics: Polars here (default, every row checked against the spec), "
                            "or DuckDB or Spark from the spec's SQL (`actrace sql`; the files' footers checked)")
        p.add_argument("--spark-master", default="local[2]", metavar="URL",
                       help="--engine spark: the cluster (spark://host:7077, yarn, …; default local[2])")
        p.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                       help="--engine spark: a Spark setting, repeatable (e.g. spark.driver.memory=6g)")
        p.add_argument("--spark-scratch", metavar="URL",
                       help="--engine spark on a cluster: a folder the cluster writes the metric table to and this "
                            "machine reads (e.g. s3://bucket/tmp; default in local mode: a temporary folder here)")
        rules = p.add_argument_group("rule thresholds", "each findings rule's limits (docs/rulebook.md); check "
                                     "also gates every rule a threshold given here is read by")
        for t in THRESHOLDS.values():
            rules.add_argument(t.flag, type=count if t.whole else number(t.low, t.high), metavar="N" if t.whole else "X",
                               help=f"{t.help} (default {t.default if t.default is not None else 'off'})")
        p.set_defaults(func=func)
        return p

    p = sub.add_parser("sql", help="print the spec's normative metrics as one SQL query (DuckDB or Spark)",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="The query computes the metric table of `actrace summary --format csv` from a "
                       "table of trace rows named `readings` (--table), e.g. in DuckDB: CREATE VIEW readings AS "
                       "SELECT * FROM read_parquet('runs/*.parquet', union_by_name = true)")
    p.add_argument("--dialect", choices=["duckdb", "spark"], default="duckdb")
    p.add_argument("--table", default="readings", help="the table of trace rows (default readings)")
    p.add_argument("--dead-eps", type=number(0), default=0.0, metavar="EPS", help="as in summary (default 0)")
    p.add_argument("--sat-threshold", type=number(), default=0.99, metavar="T", help="as in summary (default 0.99)")
    p.add_argument("--dormant-tau", type=number(), default=0.1, metavar="TAU", help="as in summary (default 0.1)")
    p.set_defaults(func=cmd_sql)

    p = analyzer_command("diff", "where and when runs part from a baseline, against its own noise (exit 1 if any)",
                         cmd_diff)
    p.add_argument("--format", choices=["text", "json", "csv"], default="text", help="json/csv: every parting")
    p.add_argument("--compared", nargs="*", help=argparse.SUPPRESS)  # what `--` stands for
    p.add_argument("-o", "--output", help="write the answer here instead of stdout")
    p.add_argument("--persist", type=count, default=3, metavar="N",
                   help="readings in a row outside the baseline's band that make a parting (default 3)")
    p.add_argument("--sigmas", type=number(0, above=True), default=4.0, metavar="K",
                   help="band: K times the baseline's step-to-step noise, at least (default 4)")
    p.add_argument("--metrics", nargs="+", default=["dead_fraction", "saturation_value", "std", "grad_norm",
                                                    "update_ratio"], metavar="METRIC",
                   help="metrics compared (also: mean, which depends on a layer's initialization)")
    p = analyzer_command("sweep", "runs that differ in one config key: activation scale against it, where rules fire",
                         cmd_sweep)
    p.add_argument("--by", required=True, metavar="KEY", help="the config key the runs differ in (width, lr, …)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("-o", "--output", help="write the answer here instead of stdout")
    p = analyzer_command("report", "write a self-contained offline HTML report", cmd_report)
    baseline_option(p)
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")
    p = analyzer_command("summary", "findings and a per-layer table in the terminal", cmd_summary)
    baseline_option(p)
    p.add_argument("--format", choices=["text", "json", "csv"], default="text",
                   help="json/csv: per-(run, layer, step) metrics for machines")
    p.add_argument("-o", "--output", help="write json/csv here instead of stdout")
    p.add_argument("--by", metavar="KEY", help="also the sweep over this config key (as actrace sweep --by KEY)")
    p = analyzer_command("findings", "findings only: text, or JSON/CSV records for CI jobs and notebooks",
                         cmd_findings)
    p.add_argument("--format", choices=["text", "json", "csv"], default="text",
                   help="json/csv: one record per finding (severity, rule, run, layer, stream, step, evidence, "
                        "advice, score)")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p = analyzer_command("check", "CI gate: a verdict per run; exit 1 on critical findings, unfinished runs and "
                         "the rules of the thresholds given; exit 2 on refused input", cmd_check)
    p.add_argument("--no-nan", action="store_true", help="fail on any NaN or Inf")
    p.add_argument("--strict", action="store_true",
                   help="fail a run where a threshold given has nothing to read (default: said once, not failed)")
    p.add_argument("--require-finished", action="store_true",
                   help="fail a run still being written (default: its verdict is 'running')")
    p.add_argument("--fail-on", choices=["critical", "warning", "never"], default="critical",
                   help="fail on findings of this severity or worse (default critical: NaN, dying units, vanishing "
                        "or exploding gradients, and runs that failed, stopped or never closed); never: only the "
                        "thresholds given")
    p.add_argument("--allow", action="append", default=[], metavar="RULE",
                   help="accept findings of this rule (repeatable), e.g. --allow dead_high")
    p.add_argument("--format", choices=["text", "json", "junit"], default="text",
                   help="json: {passed, rules_version, runs: [{run, verdict, failed_rules}], violations, notes}; "
                        "junit: one test case per run and rule, for CI systems")
    p.add_argument("-o", "--output", help="write the answer here instead of stdout")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command_line = []
    if argv[:1] == ["diff"] and "--" in argv:  # `diff A1 A2 -- B --format json`: after -- the runs compared
        argv[argv.index("--")] = "--compared"
    elif "--" in argv:  # `actrace record -o X -- python train.py ...`: the rest is the command
        cut = argv.index("--")
        argv, command_line = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    args.command_line = command_line
    warnings.formatwarning = lambda message, *_, **__: f"actrace: warning: {message}\n"
    sys.stdout, sys.stderr = Escaped(sys.stdout), Escaped(sys.stderr)
    try:
        return args.func(args)
    except (TraceError, FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"actrace {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:  # an optional extra that is not installed
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"actrace {args.command}: error: this needs {exc.name}, which is not installed: "
              f"pip install 'actrace[{extra}]'", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `actrace summary … | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # a full disk, a read-only folder, a folder where a file was meant: one line
        print(f"actrace {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = sys.stdout.stream, sys.stderr.stream
