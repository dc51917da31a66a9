"""The run's .cast package: per card, dispatched or fallback and why, in eager dispatch and in
kforge.compile's graphs (against the card compiled alone by torch.compile), custom or vendor
wrapper, and eager vs kernel latency, both as GPU time and as dispatched (guard and launch
included); above them, the run's model check (the whole model eager and with the package)."""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html

from .. import components as ui
from ..data import NotFound

dash.register_page(__name__, path="/package", name="Package", title="kforge · package")

COLUMNS = [
    ui.text("card", "card", markdown=True), ui.text("decision", "decision"), ui.text("reason", "why"),
    ui.text("compile_decision", "compiled graphs"),  # why and torch.compile's time: its tooltip
    ui.text("kind", "kind"), ui.text("winner", "kernel", markdown=True), ui.num("eager_us", "eager µs"),
    ui.num("kernel_us", "kernel µs"), ui.fixed("speedup", "speedup"),
    ui.num("eager_dispatched_us", "eager as dispatched µs"), ui.num("dispatched_us", "kernel as dispatched µs"),
    ui.sci("max_abs_err", "max abs err"), ui.text("tolerance", "tolerance"),
]
DECISION_STYLES = [{"if": {"filter_query": f'{{{col}}} = "{d}"', "column_id": col}, "color": color, "fontWeight": "600"}
                   for col in ("decision", "compile_decision")
                   for d, color in (("dispatched", "#2e7d32"), ("fallback", "#b45309"))]


def layout(run: str | None = None, **_query: str) -> html.Div:
    if not run:
        return ui.missing("run")
    return html.Div([
        dcc.Store(id="package-params", data={"run": run}),
        ui.live("package-poll"),
        html.H2(["Package of run ", html.Code(run)]),
        html.Div(id="package-head"),
        ui.table("package-table", COLUMNS, [], page_size=50, style_data_conditional=DECISION_STYLES),
    ])


@callback(Output("package-head", "children"), Output("package-table", "data"), Output("package-table", "tooltip_data"),
          Input("package-poll", "n_intervals"), State("package-params", "data"))
def refresh(_n: int, params: dict) -> tuple:
    run_id = params["run"]
    try:
        view = ui.catalog().package(run_id)
    except NotFound as e:
        return ui.problem(e), [], []
    head = [html.P(["file ", html.Code(view["path"] or "—")])]
    if view["model_check"]:  # the whole model eager and with this package, from `kforge run`
        check = view["model_check"]
        head.append(html.P(["model check: ", check["message"]], id="package-model-check",
                           className=f"model-check {check['level']}"))
    if view["error"]:
        return head + [ui.problem(LookupError(view["error"]))], [], []
    rows = view["cards"]
    head.append(html.Div([ui.stat("dispatched", sum(r["decision"] == "dispatched" for r in rows)),
                          ui.stat("fallback", sum(r["decision"] != "dispatched" for r in rows)),
                          ui.stat("vendor wrappers", sum(r["kind"] == "vendor" for r in rows))]
                         + [ui.stat(k.replace("_", " "), str(v)) for k, v in view["header"].items()],
                         className="stats"))
    data = [{**r, "card": ui.md_link(r["summary"] or r["op"] or r["card_id"], "card", run=run_id, card=r["card_id"]),
             "winner": ui.md_link(f"#{r['candidate']}", "candidate", run=run_id, id=r["candidate"])
             if r["candidate"] is not None else ""} for r in rows]
    # The compiled graphs' decision has no room for its reason in a 1400 px table: on hover.
    tips = [{"compile_decision": {"value": r["compile_reason"] + (f" (torch.compile {r['compile_us']:.2f} µs)"
                                                                   if r["compile_us"] is not None else ""),
                                  "type": "text"}} for r in rows]
    return head, data, tips
