"""Failures of one run grouped by kind (verdict + first line of the message), biggest first."""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html

from .. import components as ui
from ..data import NotFound

dash.register_page(__name__, path="/failures", name="Failures", title="kforge · failures")

EXAMPLES = 8  # candidate links per group; the count says how many there are


def layout(run: str | None = None, **_query: str) -> html.Div:
    if not run:
        return ui.missing("run")
    return html.Div([
        dcc.Store(id="failures-params", data={"run": run}),
        ui.live("failures-poll"),
        html.H2(["Failures of run ", html.Code(run)]),
        html.P("Numbers and addresses in messages are replaced by N to group alike failures.", className="muted"),
        html.Div(id="failures-body"),
    ])


@callback(Output("failures-body", "children"), Input("failures-poll", "n_intervals"), State("failures-params", "data"))
def refresh(_n: int, params: dict) -> html.Div:
    run_id = params["run"]
    cat = ui.catalog()
    try:
        groups, proposer, run = cat.failures(run_id), cat.proposer_errors(run_id), cat.run(run_id)
    except NotFound as e:
        return ui.problem(e)
    parts = [ui.proposer_errors(proposer, run_id)] if proposer else []
    if not groups:
        why = run["next"] or ("the proposer gave no candidate to evaluate" if proposer else
                              "no candidate has failed" if run["candidates"] else "nothing evaluated yet")
        return html.Div(parts + [html.P(f"No failed candidates: {why}.", className="muted", id="failures-empty")])
    header = html.Tr([html.Th(h) for h in ("count", "verdict", "kind", "cards", "candidates")])
    body = [html.Tr([
        html.Td(g["count"]), html.Td(ui.badge(g["verdict"])),
        html.Td([html.Code(g["kind"]),
                 html.Div(g["example"], className="muted") if g["example"] != g["kind"] else None]),
        html.Td([html.Div(dcc.Link(summary, href=ui.href("card", run=run_id, card=cid)))
                 for cid, summary in g["cards"].items()]),
        html.Td([dcc.Link(f"#{i} ", href=ui.href("candidate", run=run_id, id=i)) for _, i in g["candidates"][:EXAMPLES]]
                + ([html.Span(f"+{len(g['candidates']) - EXAMPLES} more", className="muted")]
                   if len(g["candidates"]) > EXAMPLES else [])),
    ], className="failure-group") for g in groups]
    return html.Div(parts + [html.H3("Failed candidates"),
                             html.Table([html.Thead(header), html.Tbody(body)], className="failures panel")])
