"""Pure functions from catalog rows to plotly figures and cytoscape elements."""

from __future__ import annotations

import plotly.graph_objects as go

from .components import VERDICT_COLORS, fmt_us, fmt_x, speedup_color
from .rows import CORRECT

ROOT = "root"

TREE_STYLE = [
    {"selector": "node", "style": {"background-color": "data(color)", "label": "data(label)", "font-size": "10px",
                                   "text-valign": "bottom", "text-margin-y": "3px", "width": 18, "height": 18}},
    {"selector": f"#{ROOT}", "style": {"shape": "round-rectangle", "width": 64, "height": 22, "text-valign": "center",
                                       "color": "#fff", "text-margin-y": 0}},
    {"selector": "node:selected", "style": {"border-width": 3, "border-color": "#f59e0b"}},
    {"selector": "edge", "style": {"curve-style": "bezier", "target-arrow-shape": "triangle", "width": 1.5,
                                   "line-color": "#cbd5e1", "target-arrow-color": "#cbd5e1"}},
    {"selector": "edge.repair", "style": {"line-style": "dashed", "line-color": "#ef9a9a",
                                          "target-arrow-color": "#ef9a9a"}},
]
TREE_LAYOUT = {"name": "breadthfirst", "roots": f"#{ROOT}", "directed": True, "spacingFactor": 1.0,
               "animate": False}


def node_id(cand_id: int) -> str:
    return f"c{cand_id}"


def tree_elements(card: dict, candidates: list[dict], edges: list[dict]) -> list[dict]:
    """The MCTS tree: eager at the root, failures colored by verdict, valid ones by speedup."""
    top = max((c["speedup"] for c in candidates if c["verdict"] == "valid" and c["speedup"]), default=2.0)
    elements = [{"data": {"id": ROOT, "label": f"eager {fmt_us(card['eager_us'])}", "color": "#111827"}}]
    for c in candidates:
        valid = c["verdict"] == "valid" and c["speedup"]
        label = f"#{c['id']}" + (f" {fmt_x(c['speedup'])}" if valid else "")
        color = speedup_color(c["speedup"], top) if valid else VERDICT_COLORS.get(c["verdict"], "#9ca3af")
        elements.append({"data": {"id": node_id(c["id"]), "cid": c["id"], "label": label, "color": color,
                                  "verdict": c["verdict"]}})
    known = {c["id"] for c in candidates}
    for e in edges:
        source = node_id(e["source"]) if e["source"] in known else ROOT
        elements.append({"data": {"source": source, "target": node_id(e["target"])}, "classes": e["kind"]})
    return elements


def latency_figure(card: dict, history: list[dict]) -> go.Figure:
    """Each correct candidate's latency and the best so far, against eager and the HBM floor."""
    fig = go.Figure()
    for verdict in CORRECT:
        pts = [h for h in history if h["verdict"] == verdict and h["kernel_us"]]
        if pts:
            fig.add_scatter(x=[h["iteration"] for h in pts], y=[h["kernel_us"] for h in pts], mode="markers",
                            name=verdict, marker={"color": VERDICT_COLORS[verdict], "size": 7},
                            customdata=[h["id"] for h in pts],
                            hovertemplate="#%{customdata}: %{y:.3g} µs<extra>" + verdict + "</extra>")
    best = [h for h in history if h["best_us"] is not None]
    if best:
        fig.add_scatter(x=[h["iteration"] for h in best], y=[h["best_us"] for h in best], mode="lines",
                        line={"shape": "hv", "color": "#1b5e20", "width": 2}, name="best so far",
                        hovertemplate="best %{y:.3g} µs<extra></extra>")
    # Reference levels as line traces, not add_hline: hline annotations misplace log axes' ranges.
    xs = [h["iteration"] for h in history] or [0]
    span = [min(xs), max(max(xs), min(xs) + 1)]
    for value, name, color in ((card["eager_us"], "eager", "#111827"), (card["floor_us"], "HBM floor", "#b91c1c")):
        if value:
            fig.add_scatter(x=span, y=[value, value], mode="lines", name=f"{name} {fmt_us(value)}",
                            line={"dash": "dash", "color": color, "width": 1}, hoverinfo="skip")
    fig.update_layout(margin={"l": 50, "r": 20, "t": 30, "b": 40}, height=320, template="plotly_white",
                      xaxis_title="iteration", yaxis_title="latency (µs)", legend={"orientation": "h", "y": 1.12},
                      uirevision="keep")  # keep the user's zoom across live updates
    fig.update_yaxes(type="log")
    return fig


SHARE_BARS = 15  # cards in the share chart; the table lists them all


def share_figure(cards: list[dict]) -> go.Figure:
    """The cards' shares of the captured runtime, largest first, colored by what the search did:
    with a winner (best speedup), searched, waiting, or skipped (view ops, vendor libraries)."""
    top = sorted((c for c in cards if c["share"]), key=lambda c: -c["share"])[:SHARE_BARS]

    def color(c: dict) -> str:
        if c["best_speedup"] and c["best_speedup"] > 1:
            return "#2e7d32"
        return {"skipped": "#cbd5e1", "pending": "#93c5fd"}.get(c["status"], "#6366f1")

    fig = go.Figure(go.Bar(
        x=[100 * c["share"] for c in top], y=[f"{c['op_name']} · {c['card_id'][:6]}" for c in top], orientation="h",
        marker_color=[color(c) for c in top], customdata=[c["summary"] for c in top],
        hovertemplate="%{customdata}<br>%{x:.1f} % of runtime<extra></extra>"))
    fig.update_layout(height=max(160, 22 * len(top) + 60), margin={"l": 10, "r": 20, "t": 30, "b": 30},
                      template="plotly_white", title={"text": "share of captured runtime (%)", "font": {"size": 13}},
                      yaxis={"autorange": "reversed", "automargin": True}, uirevision="keep")
    return fig


def _empty(fig: go.Figure, why: str) -> go.Figure:
    """A figure that says why it has nothing to draw, instead of empty axes."""
    fig.add_annotation(text=why, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5, font={"size": 13})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    fig.update_layout(height=320, template="plotly_white", margin={"l": 50, "r": 20, "t": 40, "b": 40},
                      title={"text": title, "font": {"size": 13}}, uirevision="keep", **kw)
    return fig


def best_over_time_figure(run: dict, cards: list[dict], timeline: list[dict], empty_why: str) -> go.Figure:
    """Per card, the best speedup of a valid kernel so far against minutes since the run started."""
    fig = _layout(go.Figure(), "best speedup per card over time", xaxis_title="minutes since start",
                  yaxis_title="best speedup (×)", legend={"orientation": "h", "y": -0.25})
    names = {c["card_id"]: f"{c['op_name']} · {c['card_id'][:6]}" for c in cards}
    best: dict[str, list[tuple[float, float]]] = {}
    for t in timeline:
        if t["verdict"] == "valid" and t["speedup"]:
            points = best.setdefault(t["card_id"], [])
            if not points or t["speedup"] > points[-1][1]:
                points.append(((t["created"] - run["created"]) / 60, t["speedup"]))
    if not best:
        return _empty(fig, empty_why)
    end = max((t["created"] - run["created"]) / 60 for t in timeline)
    for card_id, points in best.items():
        xs, ys = [p[0] for p in points] + [end], [p[1] for p in points] + [points[-1][1]]
        fig.add_scatter(x=xs, y=ys, mode="lines+markers", line={"shape": "hv"}, name=names.get(card_id, card_id),
                        hovertemplate="%{y:.2f}× at %{x:.1f} min<extra>%{fullData.name}</extra>")
    return fig


def rate_figure(run: dict, timeline: list[dict], empty_why: str) -> go.Figure:
    """Candidates evaluated per minute of the run, stacked by verdict."""
    fig = _layout(go.Figure(), "candidates per minute", xaxis_title="minute since start", yaxis_title="candidates",
                  barmode="stack", legend={"orientation": "h", "y": -0.25})
    if not timeline:
        return _empty(fig, empty_why)
    counts: dict[str, dict[int, int]] = {}
    for t in timeline:
        minute = int((t["created"] - run["created"]) // 60)
        per = counts.setdefault(t["verdict"], {})
        per[minute] = per.get(minute, 0) + 1
    for verdict, per in counts.items():
        fig.add_bar(x=list(per), y=list(per.values()), name=verdict, marker_color=VERDICT_COLORS.get(verdict))
    return fig


def share_before_after_figure(cards: list[dict], top: int = 8) -> go.Figure:
    """The captured runtime eager and with every card's best kernel (Amdahl), per card: what the
    winners would save, in % of the eager runtime. Cards whose calls all run inside another
    card's (top_calls 0) are left out: their time is in that card's share already."""
    fig = _layout(go.Figure(), "runtime share before / after the winners (% of eager runtime)", barmode="stack",
                  xaxis_title="% of eager runtime", legend={"orientation": "h", "y": -0.25})
    timed = sorted((c for c in cards if c["share"] and c["top_calls"] != 0), key=lambda c: -c["share"])
    if not timed:
        return _empty(fig, "no card has a measured share of the runtime")
    shown, rest = timed[:top], timed[top:]
    for c in shown:
        after = c["share"] / c["best_speedup"] if c["best_speedup"] and c["best_speedup"] > 1 else c["share"]
        fig.add_bar(y=["eager", "with winners"], x=[100 * c["share"], 100 * after], orientation="h",
                    name=f"{c['op_name']} · {c['card_id'][:6]}", hovertemplate="%{x:.1f} %<extra>%{fullData.name}</extra>")
    if rest:
        before = sum(c["share"] for c in rest)
        after = sum(c["share"] / c["best_speedup"] if c["best_speedup"] and c["best_speedup"] > 1 else c["share"]
                    for c in rest)
        fig.add_bar(y=["eager", "with winners"], x=[100 * before, 100 * after], orientation="h",
                    name=f"{len(rest)} more cards", marker_color="#cbd5e1")
    fig.update_layout(height=260)
    return fig
