"""Proposers of one run compared: builtin templates vs each LLM model."""

from __future__ import annotations

import dash
import plotly.graph_objects as go
from dash import Input, Output, State, callback, dcc, html
from plotly.subplots import make_subplots

from .. import components as ui
from ..data import NotFound

dash.register_page(__name__, path="/providers", name="Providers", title="kforge · providers")

COLUMNS = [
    ui.text("proposer", "proposer"), ui.count("candidates", "candidates"), ui.count("valid", "valid"),
    ui.count("slower", "slower"), ui.count("failed", "failed"), ui.fixed("failure_pct", "failure %", 1),
    ui.fixed("best_speedup", "best speedup"), ui.fixed("median_speedup", "median speedup (valid)"),
    ui.count("cards_won", "cards won"), ui.count("llm_calls", "LLM calls"), ui.count("failed_calls", "failed calls"),
    ui.count("tokens", "tokens"), ui.fixed("cost_usd", "cost ($)", 4), ui.fixed("cost_per_valid", "$ per valid", 4),
]


def layout(run: str | None = None, **_query: str) -> html.Div:
    if not run:
        return ui.missing("run")
    return html.Div([
        dcc.Store(id="providers-params", data={"run": run}),
        ui.live("providers-poll"),
        html.H2(["Providers of run ", html.Code(run)]),
        html.Div(id="providers-note"),
        ui.table("providers-table", COLUMNS, []),
        dcc.Graph(id="providers-graph", config={"displaylogo": False}),
    ])


@callback(Output("providers-table", "data"), Output("providers-graph", "figure"), Output("providers-note", "children"),
          Input("providers-poll", "n_intervals"), State("providers-params", "data"))
def refresh(_n: int, params: dict) -> tuple:
    cat = ui.catalog()
    try:
        rows, errors, run = cat.providers(params["run"]), cat.proposer_errors(params["run"]), cat.run(params["run"])
    except NotFound as e:
        return [], go.Figure(), ui.problem(e)
    data = [{**r, "failure_pct": None if r["failure_rate"] is None else 100 * r["failure_rate"]} for r in rows]
    names = [r["proposer"] for r in rows]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("best / median speedup", "outcomes", "LLM cost ($)"))
    fig.add_bar(x=names, y=[r["best_speedup"] or 0 for r in rows], name="best", marker_color="#1b5e20", row=1, col=1)
    fig.add_bar(x=names, y=[r["median_speedup"] or 0 for r in rows], name="median", marker_color="#81c784",
                row=1, col=1)
    for key, color in (("valid", ui.VERDICT_COLORS["valid"]), ("slower", ui.VERDICT_COLORS["slower"]),
                       ("failed", ui.VERDICT_COLORS["compile_error"])):
        fig.add_bar(x=names, y=[r[key] for r in rows], name=key, marker_color=color, row=1, col=2)
    fig.add_bar(x=names, y=[r["cost_usd"] for r in rows], name="cost", marker_color="#6366f1", row=1, col=3)
    fig.update_layout(barmode="group", height=340, template="plotly_white", margin={"l": 40, "r": 20, "t": 40, "b": 40},
                      legend={"orientation": "h", "y": -0.2})
    if rows:
        note = []
    elif run["kind"] == "captured":
        note = [html.P(f"No proposer has run yet: {run['next']}.", className="muted")]
    else:
        note = [html.P("No candidates yet." if not errors else "No candidates: every ask failed (below).",
                       className="muted")]
    if errors:
        note.append(ui.proposer_errors(errors, params["run"]))
    return data, fig, note
