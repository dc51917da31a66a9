"""Pieces every page uses: the catalog of the running app, links, number formats, verdict
colors, tables and syntax-highlighted code."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from typing import Any
from urllib.parse import urlencode

import dash
import flask
from dash import dash_table, dcc, html
from dash.dash_table.Format import Format, Scheme, Trim
from plotly.colors import sample_colorscale
from pygments import lex
from pygments.lexers import get_lexer_by_name
from pygments.token import STANDARD_TYPES

from .data import Catalog, NotFound

CATALOG_KEY = "kforge_catalog"
POLL_MS = 2000  # live views poll at about the catalog's cache TTL

VERDICT_COLORS = {
    "valid": "#2e7d32",
    "slower": "#78909c",
    "incorrect": "#ef6c00",
    "compile_error": "#c62828",
    "load_error": "#ad1457",
    "runtime_error": "#6a1b9a",
    "hang": "#283593",
    "untimed": "#bdbdbd",
}
STATUS_CLASSES = {"running": "live", "searching": "live", "done": "ok", "failed": "bad", "interrupted": "warn",
                  "skipped": "muted", "pending": "muted", "dispatched": "ok", "fallback": "warn"}


def catalog() -> Catalog:
    """The catalog of the app serving the current request."""
    return flask.current_app.extensions[CATALOG_KEY]


def href(page: str, **params: Any) -> str:
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return dash.get_relative_path(f"/{page}") + (f"?{query}" if query else "")


_MD_SPECIAL = re.compile(r"[\\`*_{}\[\]()<>#+!|~-]")


def md_link(text: Any, page: str, **params: Any) -> str:
    """A Markdown link for DataTable cells (columns with presentation='markdown'). The text is
    escaped: it comes from logs and packages, and must not add links or markup of its own."""
    escaped = _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), str(text))
    return f"[{escaped}]({href(page, **params)})"


# ---- formats ---------------------------------------------------------------------------

def fmt_us(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    return f"{v / 1000:.3g} ms" if v >= 1000 else f"{v:.3g} µs"


def fmt_x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def fmt_pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} %"


def fmt_usd(v: float | None) -> str:
    return "—" if not v else f"${v:.4f}" if v < 1 else f"${v:.2f}"


def fmt_when(t: float | None) -> str:
    return "—" if t is None else dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def speedup_color(speedup: float, top: float) -> str:
    """Greens, darker for faster: log-scaled so 1.1× and 1.2× are told apart as well as 3× and 6×."""
    span = math.log(max(top, 2.0))
    t = min(max(math.log(max(speedup, 1.0)) / span, 0.0), 1.0)
    return sample_colorscale("Greens", [0.4 + 0.6 * t])[0]


# ---- building blocks -------------------------------------------------------------------

def badge(text: str) -> html.Span:
    cls = STATUS_CLASSES.get(text, "verdict" if text in VERDICT_COLORS else "muted")
    style = {"backgroundColor": VERDICT_COLORS[text]} if text in VERDICT_COLORS else None
    return html.Span(text, className=f"badge {cls}", style=style)


def stat(label: str, value: Any, id: str | None = None) -> html.Div:
    kw = {"id": id} if id else {}
    return html.Div([html.Div(value, className="stat-value", **kw), html.Div(label, className="stat-label")],
                    className="stat")


def problem(err: Exception) -> html.Div:
    """What a page shows instead of its content when its run, card or candidate is missing."""
    return html.Div(str(err), className="problem")


def missing(*names: str) -> html.Div:
    return problem(NotFound(f"this page needs ?{'&'.join(f'{n}=…' for n in names)} in its URL; "
                            f"open it from the runs page"))


def proposer_errors(groups: list[dict], run_id: str) -> html.Div:
    """The proposer's failures (no candidate came of them), grouped: Failures and Providers show them."""
    rows = [html.Tr([html.Td(g["count"]), html.Td(html.Code(g["kind"])),
                     html.Td([html.Div(dcc.Link(summary, href=href("card", run=run_id, card=cid)))
                              for cid, summary in list(g["cards"].items())[:5]]
                             + ([html.Span(f"+{len(g['cards']) - 5} more", className="muted")]
                                if len(g["cards"]) > 5 else []))]) for g in groups]
    return html.Div([
        html.H3(f"Proposer errors ({sum(g['count'] for g in groups)})"),
        html.P("Asks that gave no candidate to evaluate: the endpoint failed, or its replies held no usable kernel.",
               className="muted"),
        html.Table([html.Thead(html.Tr([html.Th(h) for h in ("count", "error", "cards")])), html.Tbody(rows)],
                   className="failures panel"),
    ], id="proposer-errors")


def next_step(run: dict) -> html.Div | None:
    """What a captured-only or compile-only run needs next, as a banner."""
    return html.Div(run["next"], className="next-step", id="next-step") if run["next"] else None


def num(id: str, name: str, digits: int = 4) -> dict:
    """A numeric DataTable column: sorts as a number, shows `digits` significant digits."""
    return {"id": id, "name": name, "type": "numeric",
            "format": Format(precision=digits, scheme=Scheme.decimal, trim=Trim.yes)}


def fixed(id: str, name: str, digits: int = 2) -> dict:
    """A numeric column with `digits` decimals (speedups, percentages, dollars)."""
    return {"id": id, "name": name, "type": "numeric", "format": Format(precision=digits, scheme=Scheme.fixed)}


def sci(id: str, name: str) -> dict:
    """A numeric column in scientific notation (numerical errors span many decades)."""
    return {"id": id, "name": name, "type": "numeric", "format": Format(precision=2, scheme=Scheme.exponent)}


def count(id: str, name: str) -> dict:
    return {"id": id, "name": name, "type": "numeric"}


def text(id: str, name: str, markdown: bool = False) -> dict:
    col = {"id": id, "name": name, "type": "text"}
    if markdown:
        col["presentation"] = "markdown"
    return col


def table(id: str, columns: list[dict], data: list[dict], page_size: int = 25, **kw: Any) -> dash_table.DataTable:
    verdict_styles = [{"if": {"filter_query": f'{{verdict}} = "{v}"', "column_id": "verdict"},
                       "color": c, "fontWeight": "600"} for v, c in VERDICT_COLORS.items()]
    return dash_table.DataTable(
        id=id, columns=columns, data=data, page_size=page_size, sort_action="native", filter_action="native",
        markdown_options={"link_target": "_self"}, style_as_list_view=True,
        # Cells and headers wrap, so a wide table fits a 1400 px window instead of scrolling sideways.
        style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "inherit", "fontSize": "13px", "padding": "4px 6px", "textAlign": "left",
                    "maxWidth": "320px", "whiteSpace": "normal", "height": "auto", "overflowWrap": "anywhere"},
        style_header={"fontWeight": "600", "backgroundColor": "#f3f4f6", "whiteSpace": "normal",
                      "overflowWrap": "normal"},
        style_data_conditional=verdict_styles + kw.pop("style_data_conditional", []),
        **kw,
    )


def highlight(source: str, language: str) -> html.Pre:
    """Source highlighted on the server with Pygments, as spans (no raw HTML reaches the page).

    Dash's bundled highlight.js knows neither CUDA/C++ nor diffs; Pygments (a dependency of
    rich) knows both. Class names are Pygments' short ones, styled in assets/highlight.css."""
    spans: list[Any] = []
    run_cls, run_text = None, []
    for token, value in lex(source, get_lexer_by_name(language)):
        while token not in STANDARD_TYPES:
            token = token.parent
        cls = STANDARD_TYPES[token] or None
        if cls != run_cls and run_text:
            spans.append(html.Span("".join(run_text), className=run_cls) if run_cls else "".join(run_text))
            run_text = []
        run_cls = cls
        run_text.append(value)
    if run_text:
        spans.append(html.Span("".join(run_text), className=run_cls) if run_cls else "".join(run_text))
    return html.Pre(html.Code(spans), className="code hl")


def pretty_json(value: Any, inline_from: int = 3, _level: int = 0) -> str:
    """JSON indented down to `inline_from` levels; deeper values stay on one line, so a launch
    plan reads one kernel field per line instead of one number per line."""
    if _level >= inline_from or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value, default=str)
    pad, inner = "  " * _level, "  " * (_level + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {pretty_json(v, inline_from, _level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    items = [inner + pretty_json(v, inline_from, _level + 1) for v in value]
    return "[\n" + ",\n".join(items) + f"\n{pad}]"


def live(id: str) -> dcc.Interval:
    return dcc.Interval(id=id, interval=POLL_MS, n_intervals=0)
