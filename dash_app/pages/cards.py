"""Cards of one run, ranked by share of runtime, with search progress; updated live."""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html

from .. import components as ui
from .. import figures
from ..data import NotFound

dash.register_page(__name__, path="/cards", name="Cards", title="kforge · cards")

COLUMNS = [
    ui.text("card", "card", markdown=True), ui.text("family", "family"), ui.fixed("share", "share %", 1),
    ui.count("calls", "calls"), ui.num("eager_us", "eager µs"), ui.text("status", "status"),
    ui.fixed("best_speedup", "best speedup"), ui.num("best_us", "best µs"), ui.count("iterations", "iterations"),
    ui.count("n_candidates", "candidates"), ui.count("n_valid", "valid"), ui.fixed("cost_usd", "LLM cost ($)", 4),
    ui.num("floor_us", "floor µs"), ui.fixed("eager_floor_pct", "eager % of floor", 1),
    ui.fixed("best_floor_pct", "best % of floor", 1),
]


def layout(run: str | None = None, **_query: str) -> html.Div:
    if not run:
        return ui.missing("run")
    return html.Div([
        dcc.Store(id="cards-params", data={"run": run}),
        ui.live("cards-poll"),
        html.H2(["Cards of run ", html.Code(run)]),
        html.Div(id="cards-head"),
        dcc.Graph(id="cards-share", config={"displaylogo": False}),
        html.P(id="cards-floor-note", className="muted"),
        ui.table("cards-table", COLUMNS, [], page_size=50),
        html.H3("Recent events"),
        html.Div(id="cards-events", className="events panel"),
    ])


@callback(Output("cards-head", "children"), Output("cards-table", "data"), Output("cards-events", "children"),
          Output("cards-share", "figure"), Output("cards-floor-note", "children"),
          Input("cards-poll", "n_intervals"), State("cards-params", "data"))
def refresh(_n: int, params: dict) -> tuple:
    cat, run_id = ui.catalog(), params["run"]
    try:
        run, cards, events = cat.run(run_id), cat.cards(run_id), cat.events(run_id)
    except NotFound as e:
        return ui.problem(e), [], None, {}, None
    floor_note = (f"Floor % is the HBM floor of {run['device']} (bytes a kernel must move at its copy bandwidth) "
                  "over the latency: 100 % cannot be beaten." if run["kind"] == "search" else
                  "No HBM floor: no GPU ran this run, so there is no device to take one from.")
    head = html.Div([ui.next_step(run), html.Div([
        ui.stat("status", ui.badge(run["status"])), ui.stat("model", run["model"] or "—"),
        ui.stat("device", f"{run['device']} {run['arch']}".strip() or "—"),
        ui.stat("cards searched", f"{run['searched']} / {run['cards']}"),
        ui.stat("candidates", run["candidates"], id="cards-candidates"),
        ui.stat("est. model speedup", ui.fmt_x(run["est_speedup"])),
        ui.stat("LLM cost", ui.fmt_usd(run["cost_usd"])), ui.stat("started", ui.fmt_when(run["created"])),
    ], className="stats")])
    rows = [{
        **{k: c[k] for k in ("family", "calls", "eager_us", "best_speedup", "best_us", "iterations", "n_candidates",
                             "n_valid", "cost_usd", "floor_us", "eager_floor_pct", "best_floor_pct")},
        "card": ui.md_link(c["summary"], "card", run=run_id, card=c["card_id"]),
        "share": 100 * c["share"] if c["share"] is not None else None,
        "status": c["status"] + (f": {c['skip_reason']}" if c["skip_reason"] else ""),
    } for c in cards]
    log = [html.Div(f"{ui.fmt_when(e['created'])}  {e['level']:<7} {e['kind']:<14} {e['message']}",
                    className=e["level"]) for e in events] or html.Span("no events yet", className="muted")
    return head, rows, log, figures.share_figure(cards), floor_note
