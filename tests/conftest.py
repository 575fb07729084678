"""Shared fixtures: paths of the spec and its golden examples, and a runner for the CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "spec"
EXAMPLES = SPEC / "examples"


def run_cli(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed `actrace` command as a user would."""
    return subprocess.run([sys.executable, "-m", "actrace.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
