"""The report in a real headless Chromium: renders, no script error, no request, names escaped."""
from __future__ import annotations

import json

import pytest

import numpy as np

import actrace
from traces import relu_layer, write_run
from conftest import CHROMIUM, HUNG, LAUNCH_ARGS

HOSTILE = "<img src=x onerror=alert(1)></script><b>"


@pytest.fixture(scope="module")
def report(tmp_path_factory, ):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("report")
    write_run(d / "healthy.parquet", "healthy")
    write_run(d / "dying.parquet", "dying", dead=lambda s: s // 25)
    write_run(d / "hostile.parquet", HOSTILE, layer_names=[HOSTILE, "b1", "b2", "b3", "b4", "b5", "out"])
    with actrace.Writer(d / "relu-only.parquet", run="relu-only") as w:  # as an ONNX run: no gradients, no tanh
        for step in range(0, 600, 100):
            w.record_activation(step, "block0.relu", relu_layer(np.random.default_rng(step), 32, 0), kind="relu")
    res = run_cli("report", d / "dying.parquet", d / "healthy.parquet", d / "hostile.parquet", d / "relu-only.parquet",
                  "-o", d / "report.html", "--baseline", "healthy")
    assert res.returncode == 0, res.stderr
    assert "computing metrics" in res.stderr and "writing page" in res.stderr  # progress is shown
    assert "warning" not in res.stderr.lower()  # no library's warning reaches the user
    return d / "report.html"


def test_report_renders_offline_with_every_chart_and_no_script_error(report):
    from playwright.sync_api import sync_playwright

    errors, requests, dialogs = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        page = browser.new_page()
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: r.url.startswith("file:") or r.url.startswith("data:") or requests.append(r.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(report.as_uri())
        for chart in ("heatmaps", "trends", "profile", "histogram"):
            page.wait_for_selector(f"#{chart} svg .mark-rect, #{chart} svg .mark-line, #{chart} svg .mark-symbol",
                                   state="attached", timeout=HUNG * 1000)
        findings_text = page.inner_text("table")
        page_text = page.inner_text("body")
        images = page.eval_on_selector_all("img", "els => els.length")
        bold = page.eval_on_selector_all("b", "els => els.length")
        browser.close()
    assert errors == [] and requests == [] and dialogs == []
    assert "dead_growing" in findings_text and "dying" in findings_text
    assert HOSTILE in page_text and images == 0 and bold == 0
    assert "Against the baseline" in page_text and "parts from healthy" in page_text
    assert "Recurrent layers" not in page_text  # no recurrent layer, no section


def test_the_first_screen_opens_on_the_baseline_and_an_empty_panel_says_why(report):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        page = browser.new_page()
        page.goto(report.as_uri())
        page.wait_for_selector("#heatmaps svg .mark-rect", state="attached", timeout=HUNG * 1000)
        menu = page.locator("#heatmaps select")
        options = menu.locator("option").all_inner_texts()
        menu.select_option("relu-only")
        page.wait_for_timeout(500)
        panel_text = page.inner_text("#heatmaps")
        shot = page.screenshot(full_page=False)
        browser.close()
    assert options[0] == "healthy" and options[1:3] == ["dying", HOSTILE]  # the baseline, then as given
    assert "no gradient readings in this run" in panel_text and "no bounded layers in this run" in panel_text
    assert len(shot) > 10_000


def test_report_is_self_contained(report):
    text = report.read_text()
    assert "cdn.jsdelivr" not in text.split("const specs")[1]
    assert "<script src" not in text and "vegaEmbed" in text


def test_report_embeds_layers_in_depth_order(report):
    spec = json.loads(report.read_text().split("const specs = ")[1].split(";\nconst first")[0])
    heat = spec["heatmaps"]["hconcat"][0]["layer"][0]
    order = heat["encoding"]["y"]["sort"]
    assert order.index("block0.relu") < order.index("block1.relu") < order.index("block5.relu") < order.index("out")


def test_a_reading_that_holds_a_nan_is_a_black_cell_not_a_healthy_one(tmp_path, cli):
    """A NaN at step 300 in the outputs of layers 3 to 5 of one run: in its dead-fraction and
    largest ÷ median panels the 3 layers × 3 steps from there are black (9 cells each: its metrics
    are unknown, and undrawn they read as healthy), and its gradient panel has none; a run without a
    NaN has no black cell."""
    from conftest import rendered

    write_run(tmp_path / "nan.parquet", "nan", nan_at=300)
    write_run(tmp_path / "healthy.parquet", "healthy")
    res = cli("report", tmp_path / "nan.parquet", tmp_path / "healthy.parquet", "-o", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr
    black = {}
    with rendered(tmp_path / "r.html", "heatmaps") as (page, errors):
        for run in ("nan", "healthy"):
            page.locator("#heatmaps select").select_option(run)
            page.wait_for_timeout(500)
            black[run] = page.evaluate("""() => document.querySelectorAll('#heatmaps .mark-rect path[fill="#111"]')
                .length""")
    assert errors == []
    assert black == {"nan": 2 * 9, "healthy": 0}, black  # the gradients hold no NaN: no black cell there
