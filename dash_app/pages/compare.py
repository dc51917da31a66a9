"""Two runs side by side: what each run is, then their cards matched by op and arguments."""

from __future__ import annotations

import dash
from dash import Input, Output, callback, dcc, html

from .. import components as ui
from ..data import NotFound

dash.register_page(__name__, path="/compare", name="Compare", title="kforge · compare")

FACTS = (("model", "model"), ("kind", "kind"), ("status", "status"), ("device", "device"), ("arch", "arch"),
         ("cards", "cards"), ("searched", "cards searched"), ("candidates", "candidates"),
         ("est_speedup", "est. model speedup"), ("cost_usd", "LLM cost"), ("created", "started"))

COLUMNS = [
    ui.text("card", "card"), ui.fixed("share_a", "share % A", 1), ui.text("status_a", "status A"),
    ui.num("eager_us_a", "eager µs A"), ui.fixed("best_speedup_a", "best speedup A"),
    ui.fixed("share_b", "share % B", 1), ui.text("status_b", "status B"), ui.num("eager_us_b", "eager µs B"),
    ui.fixed("best_speedup_b", "best speedup B"),
]


def _fact(run: dict, key: str) -> str:
    value = run[key]
    if key == "est_speedup":
        return ui.fmt_x(value)
    if key == "cost_usd":
        return ui.fmt_usd(value)
    if key == "created":
        return ui.fmt_when(value)
    return str(value) if value not in (None, "") else "—"


def layout(a: str | None = None, b: str | None = None, **_query: str) -> html.Div:
    runs = ui.catalog().runs()
    options = [{"label": f"{r['id']} · {r['model'] or r['kind']}", "value": r["id"]} for r in runs]
    ids = [r["id"] for r in runs]
    a = a or (ids[1] if len(ids) > 1 else ids[0] if ids else None)
    b = b or (ids[0] if ids else None)
    return html.Div([
        html.H2("Compare two runs"),
        html.Div([dcc.Dropdown(options, a, id="compare-a", clearable=False, className="grow"),
                  dcc.Dropdown(options, b, id="compare-b", clearable=False, className="grow")], className="row"),
        html.Div(id="compare-facts"),
        ui.table("compare-table", COLUMNS, [], page_size=50),
    ])


@callback(Output("compare-facts", "children"), Output("compare-table", "data"),
          Input("compare-a", "value"), Input("compare-b", "value"))
def refresh(a: str | None, b: str | None) -> tuple:
    if not a or not b:
        return ui.problem(NotFound("pick two runs to compare")), []
    cat = ui.catalog()
    try:
        ra, rb, rows = cat.run(a), cat.run(b), cat.compare(a, b)
    except NotFound as e:
        return ui.problem(e), []
    facts = html.Table([html.Thead(html.Tr([html.Th(""), html.Th(html.Code(a)), html.Th(html.Code(b))]))]
                       + [html.Tr([html.Td(label), html.Td(_fact(ra, key)), html.Td(_fact(rb, key))])
                          for key, label in FACTS], className="kv panel", id="compare-kv")
    data = [{**r, "card": r["summary"],
             "share_a": 100 * r["share_a"] if r["share_a"] is not None else None,
             "share_b": 100 * r["share_b"] if r["share_b"] is not None else None} for r in rows]
    return facts, data
