"""One run over time: best speedup per card, candidates per minute, and the runtime share
eager and with the winners; updated live."""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html

from .. import components as ui
from .. import figures
from ..data import NotFound

dash.register_page(__name__, path="/timeline", name="Timeline", title="kforge · timeline")


def layout(run: str | None = None, **_query: str) -> html.Div:
    if not run:
        return ui.missing("run")
    graph = {"config": {"displaylogo": False}}
    return html.Div([
        dcc.Store(id="timeline-params", data={"run": run}),
        ui.live("timeline-poll"),
        html.H2(["Timeline of run ", html.Code(run)]),
        html.Div(id="timeline-head"),
        html.Div([dcc.Graph(id="timeline-best", className="grow", **graph),
                  dcc.Graph(id="timeline-rate", className="grow", **graph)], className="row"),
        dcc.Graph(id="timeline-share", **graph),
    ])


@callback(Output("timeline-head", "children"), Output("timeline-best", "figure"), Output("timeline-rate", "figure"),
          Output("timeline-share", "figure"), Input("timeline-poll", "n_intervals"), State("timeline-params", "data"))
def refresh(_n: int, params: dict) -> tuple:
    cat, run_id = ui.catalog(), params["run"]
    try:
        run, cards, timeline = cat.run(run_id), cat.cards(run_id), cat.timeline(run_id)
    except NotFound as e:
        return ui.problem(e), {}, {}, {}
    nothing = run["next"] or "no candidate evaluated yet"
    no_speedup = run["next"] or ("no valid kernel yet" if timeline else nothing)
    return (ui.next_step(run), figures.best_over_time_figure(run, cards, timeline, no_speedup),
            figures.rate_figure(run, timeline, nothing), figures.share_before_after_figure(cards))
