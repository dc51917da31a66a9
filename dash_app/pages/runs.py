"""Runs overview: every run the dashboard reads, newest first, updated live."""

from __future__ import annotations

import dash
from dash import Input, Output, callback, html

from .. import components as ui

dash.register_page(__name__, path="/", name="Runs", title="kforge · runs")

COLUMNS = [
    ui.text("run", "run", markdown=True), ui.text("model", "model"), ui.text("status", "status"),
    ui.text("device", "device"), ui.text("searched", "cards searched"), ui.text("best", "best speedups"),
    ui.fixed("est_speedup", "est. model speedup"), ui.count("candidates", "candidates"),
    ui.fixed("cost_usd", "LLM cost ($)", 4), ui.text("started", "started"), ui.text("updated", "last result"),
    ui.text("problem", "problem"),
]


def layout(**_query: str) -> html.Div:
    return html.Div([
        html.H2("Runs"),
        html.P("Each search log found in the run directories given to the dashboard. "
               "Est. model speedup applies the winners to their share of the captured runtime (Amdahl).",
               className="muted"),
        ui.live("runs-poll"),
        html.Div(id="runs-note"),
        ui.table("runs-table", COLUMNS, []),
    ])


@callback(Output("runs-table", "data"), Output("runs-note", "children"), Input("runs-poll", "n_intervals"))
def refresh(_n: int) -> tuple[list[dict], html.Div | None]:
    runs, unreadable = ui.catalog().runs(), ui.catalog().unreadable()
    if not runs and not unreadable:
        roots = ", ".join(map(str, ui.catalog().roots))
        return [], ui.problem(LookupError(f"no search log or capture found under {roots}; start one with "
                                          f"`kforge capture` or `kforge run`, or point the dashboard at a run directory"))
    rows = [{
        "run": ui.md_link(r["id"], "cards", run=r["id"]), "model": r["model"],
        "status": r["status"] + (" (compile-only)" if r["kind"] == "compile-only" else ""),
        "device": " ".join(x for x in (r["device"], r["arch"]) if x),
        "searched": f"{r['searched']} / {r['cards']} ({r['done']} done)",
        "best": ", ".join(f"{name} {ui.fmt_x(s)}" for name, s in r["best"]) or "—",
        "est_speedup": r["est_speedup"], "candidates": r["candidates"], "cost_usd": r["cost_usd"],
        "started": ui.fmt_when(r["created"]), "updated": ui.fmt_when(r["updated"]),
    } for r in runs]
    return rows + [_unreadable(r) for r in unreadable], None


def _unreadable(r: dict) -> dict:
    """A log that cannot be read, listed with its error so a broken run is never hidden. The
    path is a code span: the run column is Markdown, and paths hold `_` and `*`."""
    return {"run": f"`{r['log']}`", "status": "unreadable", "problem": r["error"],
            "started": ui.fmt_when(r["created"])}
