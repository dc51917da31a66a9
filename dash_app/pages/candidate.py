"""One candidate: source, diff against the candidate it came from, launch plan, compiler
log, errors, numerical error and timing. A logged candidate never changes, so no polling."""

from __future__ import annotations

import difflib
import json
from typing import Any

import dash
import plotly.graph_objects as go
from dash import dcc, html

from .. import components as ui
from ..data import NotFound

dash.register_page(__name__, path="/candidate", name="Candidate", title="kforge · candidate")

# Evidence keys that hold timing samples (µs), as the evaluator may name them.
SAMPLE_KEYS = {"eager_samples_us": "eager", "kernel_samples_us": "kernel", "dispatched_samples_us": "dispatched",
               "eager_dispatched_samples_us": "eager dispatched"}


def layout(run: str | None = None, id: str | None = None, **_query: str) -> html.Div:
    if not run or not id or not id.isdigit():
        return ui.missing("run", "id")
    try:
        c = ui.catalog().candidate(run, int(id))
        card = ui.catalog().card(run, c["card_id"])
    except NotFound as e:
        return ui.problem(e)
    return html.Div([
        html.H2([f"Candidate #{c['id']} ", ui.badge(c["verdict"])], id="cand-title"),
        html.P(["of ", dcc.Link(card["summary"], href=ui.href("card", run=run, card=c["card_id"]), id="cand-card"),
                f" · {c['proposer']} · {c['kind']} · iteration {c['iteration']}"]),
        _facts(c),
        *_section("Message", html.Pre(c["message"], className="code") if c["message"] else None),
        *_section("Numerical error", _numerics(c)),
        *_section("Timing", _timing(c)),
        html.H3("Source"),
        ui.highlight(c["source"], "cuda"),
        *_section(f"Diff against #{c['base_id']}" + (" (the candidate it repairs)" if c["repair_of"] is not None else
                                                     " (its parent)"), _diff(c)),
        html.H3("Launch plan"),
        ui.highlight(ui.pretty_json(c["plan"]), "json"),
        *_section("Knobs", ui.highlight(ui.pretty_json(c["knobs"]), "json") if c["knobs"] else None),
        *_section("Compiler log", html.Pre(c["compile_log"], className="code") if c["compile_log"].strip() else None),
        *_section("Other evidence", _other_evidence(c["evidence"])),
    ])


def _section(title: str, body: Any) -> list:
    return [html.H3(title), body] if body is not None else []


def _facts(c: dict) -> html.Div:
    return html.Div([
        ui.stat("speedup", ui.fmt_x(c["speedup"])), ui.stat("kernel", ui.fmt_us(c["kernel_us"])),
        ui.stat("as dispatched", ui.fmt_us(c["dispatched_us"])), ui.stat("eager", ui.fmt_us(c["eager_us"])),
        ui.stat("reward", "—" if c["reward"] is None else f"{c['reward']:.3f}"),
        ui.stat("evaluated in", "—" if c["eval_s"] is None else f"{c['eval_s']:.2f} s"),
        ui.stat("flags", ", ".join(c["flags"]) or "none"), ui.stat("digest", html.Code(c["digest"])),
    ], className="stats")


def _diff(c: dict) -> html.Pre | None:
    if c["base_source"] is None:
        return None
    lines = difflib.unified_diff(c["base_source"].splitlines(), c["source"].splitlines(),
                                 f"#{c['base_id']}", f"#{c['id']}", lineterm="")
    text = "\n".join(lines)
    return ui.highlight(text, "diff") if text else html.P("identical source (only the launch plan differs)",
                                                           className="muted")


def _numerics(c: dict) -> html.Table | None:
    ev = c["evidence"]
    rows = [("max abs err", c["max_abs_err"]), ("max rel err", c["max_rel_err"])]
    rows += [(k.replace("_", " "), ev[k]) for k in ("tolerance", "atol", "rtol", "worst", "worst_element", "input_set")
             if k in ev]
    rows = [(k, v) for k, v in rows if v is not None]
    if not rows:
        return None
    return html.Table([html.Tr([html.Td(k), html.Td(_show(v))]) for k, v in rows], className="kv")


def _timing(c: dict) -> dcc.Graph | html.P | None:
    series = {name: c["evidence"][k] for k, name in SAMPLE_KEYS.items()
              if isinstance(c["evidence"].get(k), list) and c["evidence"][k]}
    if not series:
        if c["kernel_us"] is None:
            return None
        return html.P("medians only: this evaluation kept no timing samples", className="muted")
    fig = go.Figure([go.Box(x=v, name=name, boxpoints="outliers", orientation="h") for name, v in series.items()])
    fig.update_layout(height=80 + 60 * len(series), margin={"l": 110, "r": 20, "t": 10, "b": 40},
                      template="plotly_white", xaxis_title="µs per rep", showlegend=False)
    return dcc.Graph(figure=fig, id="cand-timing", config={"displaylogo": False})


def _other_evidence(ev: dict) -> html.Pre | None:
    shown = set(SAMPLE_KEYS) | {"tolerance", "atol", "rtol", "worst", "worst_element", "input_set"}
    rest = {k: v for k, v in ev.items() if k not in shown}
    return ui.highlight(ui.pretty_json(rest), "json") if rest else None


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)
