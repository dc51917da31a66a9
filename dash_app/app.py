"""The kforge dashboard: a read-only Dash app over search logs and .cast packages.

    from kforge.dash_app import serve
    serve(["runs/resnet"])          # http://127.0.0.1:8050

Pages live in pages/ (one view each, registered with dash.register_page); the app finds
them next to this file, so it works when imported as `kforge.dash_app` from any cwd.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs

import dash
from dash import Input, Output, dcc, html

from .components import CATALOG_KEY, href
from .data import TTL_S, Catalog

HERE = Path(__file__).resolve().parent

# Pages that belong to one run; the nav bar links them when the URL names a run.
RUN_PAGES = (("cards", "Cards"), ("timeline", "Timeline"), ("failures", "Failures"), ("providers", "Providers"),
             ("package", "Package"))


def create_app(run_dirs: list[str | Path], ttl_s: float = TTL_S) -> dash.Dash:
    """A Dash app reading the search logs found in `run_dirs` (see data.Catalog)."""
    app = dash.Dash(
        __package__,  # a package name, so Dash imports pages as <package>.pages.<name> (relative imports work)
        use_pages=True,
        pages_folder=str(HERE / "pages"),
        assets_folder=str(HERE / "assets"),
        title="kforge",
        suppress_callback_exceptions=True,  # each page's callbacks target components only that page has
    )
    app.server.extensions[CATALOG_KEY] = Catalog(run_dirs, ttl_s=ttl_s)
    app.layout = html.Div([
        dcc.Location(id="nav-url"),
        html.Div(id="nav", className="nav"),
        html.Div(dash.page_container, className="page"),
    ])

    @app.callback(Output("nav", "children"), Input("nav-url", "search"))
    def nav(search: str | None) -> list:
        run = (parse_qs((search or "").lstrip("?")).get("run") or [None])[0]
        links = [dcc.Link("kforge", href=href(""), className="brand"), dcc.Link("Runs", href=href(""), id="nav-runs"),
                 dcc.Link("Compare", href=href("compare"), id="nav-compare")]
        if run:
            links += [dcc.Link(label, href=href(page, run=run), id=f"nav-{page}") for page, label in RUN_PAGES]
            links.append(html.Span(f"run {run}", className="context"))
        return links

    return app


def serve(run_dirs: list[str | Path], host: str = "127.0.0.1", port: int = 8050, debug: bool = False) -> None:
    """Serve the dashboard until interrupted. Bind to 127.0.0.1 unless you mean to share it:
    the logs hold kernel sources and model shapes."""
    create_app(run_dirs).run(host=host, port=port, debug=debug)
