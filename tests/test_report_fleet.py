"""The report at 200 runs × 32 layers, in a real headless Chromium: it fits in 10 MiB, opens on the
most urgent finding with an overview of runs × rules, a click on a cell opens that run in every
chart and in the diff view, and a filter narrows the runs by name or config."""
from __future__ import annotations

import sys

import pytest

from conftest import CHROMIUM, HUNG, LAUNCH_ARGS, ROOT, run_cli

sys.path.insert(0, str(ROOT / "bench"))
from fleet import write_fleet  # noqa: E402



@pytest.fixture(scope="module")
def fleet_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    write_fleet(d / "runs", runs=200, layers=32, steps=20)
    res = run_cli("report", d / "runs", "-o", d / "report.html", "--baseline", "run000-lr0.001")  # a team's choice
    assert res.returncode == 0, res.stderr[-2000:]
    return d / "report.html"


def test_a_200_run_report_fits_in_10_mib(fleet_report):
    assert fleet_report.stat().st_size <= 10 * 2 ** 20


def test_a_200_run_report_opens_on_its_worst_run_and_a_click_or_a_filter_moves_every_chart(fleet_report):
    from playwright.sync_api import sync_playwright

    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: r.url.startswith(("file:", "data:")) or requests.append(r.url))
        page.goto(fleet_report.as_uri())
        page.wait_for_selector("body[data-ready=yes]", timeout=HUNG * 1000)
        lead = page.locator(".urgent")
        assert lead.bounding_box()["y"] < 400 and "critical: dead_growing" in lead.inner_text()  # first screen
        urgent_run = lead.locator("strong").nth(1).inner_text()
        assert page.eval_on_selector("#heatmaps select", "s => s.value") == urgent_run
        cells = page.locator("#overview svg g.mark-rect path")
        assert cells.count() >= 200  # every run has a row
        target = next(i for i in range(cells.count()) if "run007" in (cells.nth(i).get_attribute("aria-label") or ""))
        label = cells.nth(target).get_attribute("aria-label")
        run = label.split("run: ")[1].split(";")[0]
        cells.nth(target).click()
        page.wait_for_timeout(300)
        assert page.eval_on_selector("#heatmaps select", "s => s.value") == run
        assert page.eval_on_selector("#diff-run", "s => s.value") == run
        assert page.is_visible(f"pre.diff[data-run='{run}']")
        page.fill("#filter", "lr0.005")
        page.wait_for_timeout(300)
        shown_rows = page.eval_on_selector_all("table.runs tr[data-search]:not(.hidden)", "rs => rs.length")
        kept = page.locator("#overview svg g.mark-rect path").count()
        page.fill("#filter", "")
        browser.close()
    assert errors == [] and requests == []
    assert shown_rows == 40 and 40 <= kept < 200  # runs 4, 9, 14, … have lr 0.005
