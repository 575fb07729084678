"""The report's HTML page: its template, its tables, and the few lines of script that tie the charts
together (a click on the overview opens that run in every chart, a filter narrows runs by name or
config). Every string from a trace is untrusted: tables escape it (`html.escape` of `shown` text) and
data reaches the script as JSON with `<` escaped, so no name can close an element or run code."""
from __future__ import annotations

import html
import json

from actrace.format.schema import shown

from .findings import Finding, group

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { margin-bottom: 0 } h2 { margin-top: 28px; border-bottom: 1px solid #ddd }
table { border-collapse: collapse; margin: 8px 0 } td, th { padding: 3px 8px; border-bottom: 1px solid #eee;
  text-align: left; vertical-align: top } th { background: #f4f4f4 }
tr.critical td:first-child { color: #b00020; font-weight: 600 } tr.warning td:first-child { color: #a65f00;
  font-weight: 600 } tr.chosen { background: #fff6d5 } tr.hidden { display: none }
.muted { color: #777 } .chart { margin: 12px 0 } .urgent { border-left: 4px solid #b00020; padding: 6px 12px;
  background: #fdf3f4 } .urgent.warning { border-color: #e08000; background: #fff8ee }
.urgent.clean { border-color: #2e7d32; background: #f1f8f1 }
#filter { font: inherit; padding: 3px 6px; width: 28em } pre.diff { white-space: pre-wrap; margin: 4px 0 }
"""

SCRIPT = """
const specs = %(specs)s;
const first = %(first)s;
const views = {};
function chooseRun(run) {
  for (const [id, view] of Object.entries(views)) {  // where the chart's own menu offers the run
    const offered = [...document.querySelectorAll('#' + id + ' select option')].some(o => o.textContent === run);
    for (const name of ['heatmap_run', 'recurrent_run']) { try { if (offered) view.signal(name, run); } catch (e) {} }
    view.runAsync();
  }
  const menu = document.getElementById('diff-run');
  if (menu && [...menu.options].some(o => o.value === run)) { menu.value = run; showDiff(run); }
  document.querySelectorAll('tr[data-run]').forEach(tr => tr.classList.toggle('chosen', tr.dataset.run === run));
}
function showDiff(run) {
  document.querySelectorAll('pre.diff').forEach(p => p.hidden = p.dataset.run !== run);
}
function filterRuns(text) {
  const t = text.toLowerCase();
  for (const view of Object.values(views)) { try { view.signal('run_filter', t); view.runAsync(); } catch (e) {} }
  document.querySelectorAll('tr[data-search]').forEach(tr =>
    tr.classList.toggle('hidden', !tr.dataset.search.toLowerCase().includes(t)));
}
Promise.all(Object.entries(specs).map(([id, spec]) =>
  vegaEmbed('#' + id, spec, {actions: false, renderer: 'svg'}).then(r => { views[id] = r.view; }).catch(e => {
    document.getElementById(id).textContent = 'chart failed: ' + e; console.error(e); })
)).then(() => {
  if (views.overview) views.overview.addEventListener('click', (event, item) => {
    if (item && item.datum && item.datum.run !== undefined) chooseRun(item.datum.run); });
  document.getElementById('filter').addEventListener('input', e => filterRuns(e.target.value));
  const menu = document.getElementById('diff-run');
  if (menu) menu.addEventListener('change', e => showDiff(e.target.value));
  if (first !== null) chooseRun(first);
  document.body.dataset.ready = 'yes';
});
"""


def _attrs(run: str, search: str = "") -> str:
    """The data-run / data-search attributes of a table row that the script reads."""
    out = f' data-run="{html.escape(run, quote=True)}"'
    return out + (f' data-search="{html.escape(search, quote=True)}"' if search else "")


def table(rows: list[dict], columns: list[str], cls: str = "", run_key: str | None = None,
          search: dict | None = None) -> str:
    """An HTML table of `rows`, every cell escaped; `run_key`: the column whose run a row belongs to."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        attrs = _attrs(str(r[run_key]), (search or {}).get(r[run_key], str(r[run_key]))) if run_key else ""
        cells = "".join(f"<td>{html.escape(shown(str(r.get(c, ''))))}</td>" for c in columns)
        body.append(f"<tr{attrs}>{cells}</tr>")
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def findings_table(found: list[Finding], search: dict) -> str:
    """One row per rule and run (its most urgent finding), the other layers behind a disclosure; a
    consequence right under its cause, said as one (its remedy is its cause's)."""
    if not found:
        return "<p>No findings: every rule stayed silent.</p>"
    rows = []
    for g in group(found):
        f = g.first
        layer = html.escape(shown(f.layer))
        if g.others:
            more = ", ".join(html.escape(shown(f"{o.layer} (step {o.step})")) for o in g.others)
            layer += f"<details><summary>+{len(g.others)} more layers</summary>{more}</details>"
        said = (f.severity, f.rule) if f.cause is None else ("↳ consequence", f"{f.rule}, because of {f.cause}")
        cells = [html.escape(shown(str(v))) for v in (*said, f.run)] + [layer] + \
                [html.escape(shown(str(v))) for v in (f.step if f.step >= 0 else "–", f.evidence,
                                                      f.advice if f.cause is None else "see its cause")]
        rows.append(f'<tr class="{f.severity if f.cause is None else "consequence"}"'
                    f'{_attrs(f.run, search.get(f.run, f.run))}>'
                    + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{c}</th>" for c in ("severity", "rule", "run", "layer", "since step", "evidence",
                                             "what people usually do"))
    return f"<table id='findings-table'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def urgent(found: list[Finding], n_runs: int) -> str:
    """The first screen's lead: the most urgent finding in words, or that every rule stayed silent."""
    if not found:
        return f"<p class='urgent clean'>Every rule stayed silent on the {n_runs} run(s).</p>"
    f = found[0]
    where = "" if f.step < 0 else f" since step {f.step}"
    return (f"<p class='urgent {f.severity}'><strong>{html.escape(f.severity)}: {html.escape(f.rule)}</strong> in run "
            f"<strong>{html.escape(shown(f.run))}</strong>, {html.escape(shown(f.layer))}{where}: "
            f"{html.escape(shown(f.evidence))}"
            f"<br><span class='muted'>{html.escape(f.advice)}</span></p>")


def diff_view(texts: dict[str, str], baseline: str, chosen: str | None) -> str:
    """A menu of runs, and `actrace diff`'s answer for the one chosen against the baseline."""
    if not texts:
        return ""
    options = "".join(f'<option value="{html.escape(r, quote=True)}"{" selected" if r == chosen else ""}>'
                      f"{html.escape(shown(r))}</option>" for r in texts)
    blocks = "".join(f'<pre class="diff"{_attrs(r)}{"" if r == chosen else " hidden"}>{html.escape(t)}</pre>'
                     for r, t in texts.items())
    return (f"<h2>Against the baseline</h2><p class='muted'>Where the chosen run parts from the baseline "
            f"{html.escape(shown(baseline))}, as <code>actrace diff</code> says: only differences outside the "
            f"baseline's own band.</p><label>run <select id='diff-run'>{options}</select></label>{blocks}")


def section(chart_id: str, title: str, note: str) -> str:
    return f"<h2>{html.escape(title)}</h2><p class='muted'>{note}</p><div id='{chart_id}' class='chart'></div>"


def page(*, bundle: str, subtitle: str, lead: str, overview: str, body: str, runs_table: str, specs: dict[str, str],
         first: str | None) -> str:
    """The whole page; `specs` are chart ids → Vega-Lite JSON (already escaped for a script element)."""
    script = SCRIPT % {"specs": "{" + ",".join(f'"{k}": {v}' for k, v in specs.items()) + "}",
                       "first": json.dumps(first).replace("<", "\\u003c")}
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="actrace report"><title>actrace report</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; img-src data:">
<style>{STYLE}</style>
<script>{bundle}</script></head>
<body>
<h1>actrace report</h1>
<p class="muted">{subtitle}</p>
<p><label>runs: <input id="filter" placeholder="filter by run name or config (lr=0.01, width…)"></label></p>
{lead}
{overview}
{body}
<h2>Runs</h2>
{runs_table}
<script>{script}</script>
</body></html>
"""
