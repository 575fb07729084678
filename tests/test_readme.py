"""Every code block of the README runs, in order, as a new user would run it.

The one exception is `bash scripts/test`, the test command itself, which CI runs (`.ci/run`).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import HUNG, ROOT

BLOCKS = re.findall(r"```(bash|python)\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
# torch 2.13's gloo teardown aborts a rank at interpreter exit, after its work and destroy_process_group,
# about once in 25-50 loaded runs (tests/conftest.py's LEAVE): such a block runs once more, and
# only on that abort, which its ranks' stderr (kept here: the README sends it to /dev/null) shows
TEARDOWN = "terminate called without an active exception"


def test_the_readme_has_the_two_commands_first():
    assert [code.strip() for _, code in BLOCKS[:2]] == ["bash scripts/demo", "bash scripts/test"]
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("exec bash scripts/test")


def test_every_readme_code_block_runs(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    ran = 0
    for lang, code in BLOCKS:
        if code.strip() == "bash scripts/test":
            continue
        cwd = ROOT if code.strip() == "bash scripts/demo" else tmp_path
        cmd = ["bash", "-euo", "pipefail", "-c", code.replace(" 2>/dev/null", "")] if lang == "bash" else \
            [sys.executable, "-c", code]
        before = set(tmp_path.rglob("*"))
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=HUNG)
        if res.returncode and TEARDOWN in res.stderr:  # gloo's teardown, now and then: again from where it began
            for made in sorted(set(tmp_path.rglob("*")) - before, reverse=True):  # (what it wrote refuses a rewrite)
                made.unlink() if made.is_file() or made.is_symlink() else made.rmdir()
            res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=HUNG)
        assert res.returncode == 0, f"README block failed:\n{code}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
        ran += 1
    assert ran == len(BLOCKS) - 1
    assert (ROOT / "actrace-demo" / "report.html").exists()
    assert {p.name for p in (tmp_path / "runs").glob("*.parquet")} == {"baseline.parquet", "teamB.parquet",
                                                                        "mlx-run.parquet", "lstm.parquet", "heads.parquet",
                                                                        "bert-hf.parquet", "lightning.parquet", "fsdp.parquet",
                                                                        "tp.parquet", "fsdp_tp.parquet", "pp.parquet", "keras.parquet",
                                                                        "flax.parquet"}
    # every quickstart's run passes the default gate: no critical finding, every run closed cleanly, but the
    # heads example, whose every head of layer 1 collapses on purpose: that and nothing else fails it
    gate = subprocess.run([sys.executable, "-m", "actrace.cli", "check", tmp_path / "runs", "--format", "json"],
                          capture_output=True, text=True, timeout=HUNG)
    verdicts = {r["run"]: (r["verdict"], r["failed_rules"]) for r in json.loads(gate.stdout)["runs"]}
    assert verdicts.pop("heads") == ("failed", ["attention_entropy_collapse"]), gate.stdout
    assert all(verdict == ("passed", []) for verdict in verdicts.values()), gate.stdout
