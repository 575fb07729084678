"""Shared fixtures: paths of the spec and its golden examples, and a runner for the CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "spec"
EXAMPLES = SPEC / "examples"
# Seconds after which a child process or a page is taken to be hung, not slow: the limits only stop
# a hang, so they leave room for a loaded two-core CI machine (the demo alone takes ~20 s idle).
HUNG = 1800


def run_cli(*args: str, cwd=None, timeout: float = HUNG) -> subprocess.CompletedProcess:
    """Run the installed `actrace` command as a user would."""
    return subprocess.run([sys.executable, "-m", "actrace.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
