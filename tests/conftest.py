"""Shared fixtures: paths of the spec and its golden examples, a runner for the CLI, a report in
headless Chromium."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

import torch

# Where no GPU is, Triton runs its kernels by its interpreter on CPU tensors, which must be asked for
# before triton is imported: so the GPU's fused kernel (actrace.reduce.fused) is held to the reference
# here too (test_contract). Where a GPU is, the kernel is compiled for it and read on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "spec"
EXAMPLES = SPEC / "examples"
# Seconds after which a child process or a page is taken to be hung, not slow: the limits only stop
# a hang, so they leave room for a loaded two-core CI machine (the demo alone takes ~20 s idle).
HUNG = 1800
# A multi-process test script leaves at its end without the interpreter's teardown: torch 2.13's
# (gloo's) aborted a rank there ("terminate called without an active exception") in 1 of ~25 runs
# on a loaded machine, after destroy_process_group had returned on both ranks and every trace was
# written and closed.
LEAVE = "\nimport os, sys\nsys.stdout.flush()\nos._exit(0)\n"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def run_cli(*args: str, cwd=None, timeout: float = HUNG) -> subprocess.CompletedProcess:
    """Run the installed `actrace` command as a user would."""
    return subprocess.run([sys.executable, "-m", "actrace.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


@contextmanager
def rendered(html: Path, chart: str):
    """(page, script errors so far) of the report `html` in headless Chromium, once its chart
    `chart` has drawn its cells."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(html.as_uri())
            page.wait_for_selector(f"#{chart} svg .mark-rect", state="attached", timeout=HUNG * 1000)
            yield page, errors
        finally:
            browser.close()


def start_s3() -> tuple[subprocess.Popen, dict]:
    """A local S3 server (moto's server mode on 127.0.0.1, a free port), once it answers, and the
    standard environment that points S3 clients at it."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "actrace-test-key",
           "AWS_SECRET_ACCESS_KEY": "actrace-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    deadline = time.monotonic() + HUNG
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return server, env
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("the S3 server did not start") from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def s3_server():
    """`start_s3`'s server for the session, its environment in this process's (every child process
    inherits it); stopped, and the environment restored, after the tests that asked for it."""
    import os

    server, env = start_s3()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        server.terminate()
        server.wait(timeout=HUNG)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """`actrace demo` run once for the session: its output folder and the finished process."""
    out = tmp_path_factory.mktemp("demo")
    res = run_cli("demo", "-o", out)
    assert res.returncode == 0, res.stderr
    return out, res
