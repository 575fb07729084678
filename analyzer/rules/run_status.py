"""A run that did not finish cleanly, or left nothing to judge it by (metadata `status`, spec §File metadata)."""
from __future__ import annotations

import re

from actrace.files.location import location, remote
from actrace.files.writer import writer_holds

from ._base import Family, Rule, make

RUN_UNFINISHED = Rule(
    "run_unfinished", "critical", "the trace was never closed (`status` running; a `.parts` directory with no part "
    "file too) and no writer holds it: its run was killed",
    "the trace was never closed: the run was killed; its part files are what was flushed", reads=("status",))
RUN_RUNNING = Rule(
    "run_running", "info", "the trace is not closed yet and its writer holds its lock: the run is still going "
                           "(a gate reads it as `running`, not failed, unless --require-finished)",
    "the run is still going: judge it again when it ends, or pass --require-finished to fail it", reads=("status",))
RUN_FAILED = Rule("run_failed", "critical", "the trace's `status` is `failed: TYPE`",
                  "the run ended with an exception; its readings up to then are kept", reads=("status",))
RUN_STOPPED = Rule("run_stopped", "critical", "the trace's `status` is `interrupted` or `terminated`",
                   "the run was stopped (Ctrl-C or a termination signal) before it finished; its readings up to then "
                   "are kept", reads=("status",))
STREAM_MISSING = Rule("stream_missing", "critical", "the trace's `status` is `incomplete: no STREAM reading…`",
                      "the monitor never got what it was set to read: call monitor.step(step) after loss.backward() "
                      "and before optimizer.zero_grad()", reads=("status",))
READINGS_LOST = Rule("readings_lost", "critical", "the trace's `status` says `N readings lost` (spec 1.5): its writer "
                     "dropped readings it could not write (the disk or store refused them and its buffer was full); "
                     "the findings read what was kept, and nothing of the lost steps can pass a gate",
                     "free space on the trace's disk or fix its store, or raise the writer's buffer_bytes; the trace holds "
                     "every reading before and after the gap", reads=("status",))
TRACE_UNREADABLE = Rule("trace_unreadable", "critical", "the trace breaks the spec and an analysis given "
                        "--skip-invalid left it out (its `status` reads `unreadable: …`): nothing of that run can pass",
                        "`actrace validate FILE` names what is wrong with it: record the run again, or mend the file",
                        reads=("status",))
RUN_EMPTY = Rule("run_empty", "critical", "a closed trace holds no reading",
                 "the trace was closed without a reading: the monitor read nothing (no probe reading due, no layer "
                 "selected?), so nothing about this run can pass a gate", reads=("status",))


def running(file: str) -> bool:
    """Whether the trace `file` names (itself or its `.parts` folder) is held by a live writer."""
    if remote(file):
        return False
    path = location(file)
    return writer_holds(path.with_name(path.name.removesuffix(".parts")))


def check(view, r):
    """Each is critical: a gate must not pass a crashed run, nor one it has nothing to judge by; a run
    still going is said as such (info)."""
    meta = view.meta
    if meta is None:
        return None
    status, file = meta.get("status", ""), meta["file"]
    if status == "running" and running(file):
        return make(RUN_RUNNING, view.run, "-", -1, f"{file} is being written: its writer holds the trace"
                    + (" and has not flushed yet" if meta.get("readings") == 0 else ""))
    if status == "running" and meta.get("readings") == 0:
        return make(RUN_UNFINISHED, view.run, "-", -1, f"{file} holds no part file: its writer was killed before its "
                    "first flush")
    if status == "running":
        return make(RUN_UNFINISHED, view.run, "-", -1, f"{file} was not closed (status running)")
    if status.startswith("unreadable"):
        return make(TRACE_UNREADABLE, view.run, "-", -1, f"{file} was left out, {status}")
    if status.startswith("failed"):
        return make(RUN_FAILED, view.run, "-", -1, f"the run ended with an exception ({status})")
    if status in ("interrupted", "terminated"):
        return make(RUN_STOPPED, view.run, "-", -1, f"the run was {status} before it finished")
    if status.startswith("incomplete"):
        lost = re.search(r"(\d+) readings lost", status)
        said = [make(STREAM_MISSING, view.run, "-", -1, f"the run closed {status}")] if re.search(
            r"no \w+ reading", status) else []
        return said + ([make(READINGS_LOST, view.run, "-", -1, f"the run closed {status}: {lost[1]} readings its writer "
                             "could not write were dropped, counted", value=int(lost[1]), threshold=0)] if lost else [])
    if meta.get("readings") == 0:  # closed cleanly, yet with nothing to judge it by
        return make(RUN_EMPTY, view.run, "-", -1, f"{file} holds no reading")
    return None


FAMILY = Family((RUN_UNFINISHED, RUN_RUNNING, RUN_FAILED, RUN_STOPPED, STREAM_MISSING, READINGS_LOST, TRACE_UNREADABLE,
                 RUN_EMPTY), check)
