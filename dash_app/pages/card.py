"""One card: best latency over iterations, the MCTS tree, and every candidate; updated live.

Clicking a tree node shows that candidate in the side panel, with a link to its page."""

from __future__ import annotations

import dash
import dash_cytoscape as cyto
from dash import Input, Output, State, callback, dcc, html
from dash.exceptions import PreventUpdate

from .. import components as ui
from .. import figures
from ..data import NotFound

dash.register_page(__name__, path="/card", name="Card", title="kforge · card")

COLUMNS = [
    ui.text("cand", "id", markdown=True), ui.count("iteration", "iter"), ui.count("parent_id", "parent"),
    ui.count("repair_of", "repairs"), ui.text("proposer", "proposer"), ui.text("kind", "kind"),
    ui.text("verdict", "verdict"), ui.fixed("speedup", "speedup"), ui.num("kernel_us", "kernel µs"),
    ui.num("dispatched_us", "dispatched µs"), ui.num("eager_us", "eager µs"), ui.sci("max_abs_err", "max abs err"),
    ui.text("summary", "message"),
]


def layout(run: str | None = None, card: str | None = None, **_query: str) -> html.Div:
    if not run or not card:
        return ui.missing("run", "card")
    return html.Div([
        dcc.Store(id="card-params", data={"run": run, "card": card}),
        dcc.Store(id="card-version"),
        ui.live("card-poll"),
        html.H2(id="card-title"),
        html.Div(id="card-head"),
        dcc.Graph(id="card-latency", config={"displaylogo": False}),
        html.H3("Search tree"),
        html.Div([html.Span([html.Span(className="swatch", style={"background": c}), v])
                  for v, c in ui.VERDICT_COLORS.items()] + [html.Span("dashed: repair")], className="legend"),
        html.Div([
            cyto.Cytoscape(id="card-tree", elements=[], layout=figures.TREE_LAYOUT, stylesheet=figures.TREE_STYLE,
                           className="tree grow", minZoom=0.2, maxZoom=3, style={}),
            html.Div(html.Span("Click a node to see its candidate.", className="muted"), id="card-node",
                     className="panel node-panel"),
        ], className="row"),
        html.H3("Candidates"),
        ui.table("card-table", COLUMNS, []),
    ])


@callback(Output("card-title", "children"), Output("card-head", "children"), Output("card-latency", "figure"),
          Output("card-tree", "elements"), Output("card-table", "data"), Output("card-version", "data"),
          Input("card-poll", "n_intervals"), State("card-params", "data"), State("card-version", "data"))
def refresh(_n: int, params: dict, version: list | None) -> tuple:
    cat, run_id, card_id = ui.catalog(), params["run"], params["card"]
    try:
        card = cat.card(run_id, card_id)
        cands = cat.candidates(run_id, card_id)
    except NotFound as e:
        return ui.problem(e), None, {}, [], [], None
    # Re-rendering the tree re-runs its layout; only do it when something changed.
    now = [len(cands), cands[-1]["id"] if cands else None, card["status"], card["best_candidate"]]
    if now == version:
        raise PreventUpdate
    title = [html.Code(card["summary"]), " ", ui.badge(card["status"])]
    head = html.Div([
        ui.stat("family", card["family"]), ui.stat("share of runtime", ui.fmt_pct(100 * (card["share"] or 0))),
        ui.stat("calls", card["calls"] or 0), ui.stat("eager", ui.fmt_us(card["eager_us"])),
        ui.stat("best", ui.fmt_us(card["best_us"])), ui.stat("best speedup", ui.fmt_x(card["best_speedup"])),
        ui.stat("HBM floor", ui.fmt_us(card["floor_us"])),
        ui.stat("best % of floor", ui.fmt_pct(card["best_floor_pct"])),
        ui.stat("candidates", len(cands), id="card-count"), ui.stat("LLM cost", ui.fmt_usd(card["cost_usd"])),
        ui.stat("seen in", ", ".join(card["module_paths"][:3]) or "—"),
    ], className="stats")
    rows = [{**{k: c[k] for k in ("iteration", "parent_id", "repair_of", "proposer", "kind", "verdict", "speedup",
                                  "kernel_us", "dispatched_us", "eager_us", "max_abs_err", "summary")},
             "cand": ui.md_link(f"#{c['id']}", "candidate", run=run_id, id=c["id"])} for c in reversed(cands)]
    return (title, head, figures.latency_figure(card, cat.latency_history(run_id, card_id)),
            figures.tree_elements(card, cands, cat.tree_edges(run_id, card_id)), rows, now)


@callback(Output("card-node", "children"), Input("card-tree", "tapNodeData"), State("card-params", "data"),
          prevent_initial_call=True)
def show_node(node: dict | None, params: dict) -> html.Div:
    if not node or "cid" not in node:
        return html.Span("The root is eager PyTorch: every candidate is measured against it.", className="muted")
    try:
        c = ui.catalog().candidate(params["run"], int(node["cid"]))
    except NotFound as e:
        return ui.problem(e)
    facts = [("verdict", ui.badge(c["verdict"])), ("proposer", c["proposer"]), ("kind", c["kind"]),
             ("iteration", c["iteration"]), ("speedup", ui.fmt_x(c["speedup"])),
             ("kernel", ui.fmt_us(c["kernel_us"])), ("eager", ui.fmt_us(c["eager_us"])),
             ("parent", f"#{c['parent_id']}" if c["parent_id"] is not None else "root"),
             ("knobs", ", ".join(f"{k}={v}" for k, v in c["knobs"].items()) or "—")]
    if c["repair_of"] is not None:
        facts.append(("repairs", f"#{c['repair_of']}"))
    return html.Div([
        html.H3(f"Candidate #{c['id']}", id="card-node-title", style={"marginTop": 0}),
        html.Table([html.Tr([html.Td(k), html.Td(v)]) for k, v in facts], className="kv"),
        html.P(c["message"].splitlines()[0] if c["message"] else "", className="muted"),
        dcc.Link("Open candidate →", href=ui.href("candidate", run=params["run"], id=c["id"]), id="card-node-open"),
    ])
