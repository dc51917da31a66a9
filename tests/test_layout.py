"""The shape of the package: module imports form no cycle, no module grows past what one
reader can hold, and the environment is read in one place (kforge.env)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kforge

ROOT = Path(kforge.__file__).parent
MAX_LINES = 500
# Modules still over MAX_LINES, each with why; a module leaves this list when it is split,
# and nothing joins it.
TOO_LONG = {
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "dash_app":  # a link to the dashboard in development trees
            continue
        parts = ("kforge",) + rel.with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _top_level_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """kforge modules `name` imports when it is imported: module level, TYPE_CHECKING blocks
    and function bodies left out (a lazy import runs later, when the importer is complete)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in modules and m != name}


def test_the_import_graph_of_kforge_has_no_cycle():
    modules = _modules()
    graph = {name: _top_level_imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def walk(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules is no cycle
                continue
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                walk(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_is_longer_than_a_reader_can_hold():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert set(too_long) <= set(TOO_LONG), f"over {MAX_LINES} lines, split them: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(too_long.items()) if name not in TOO_LONG)
    assert set(TOO_LONG) <= set(too_long), "split now, take them off TOO_LONG: " + ", ".join(
        sorted(set(TOO_LONG) - set(too_long)))


def test_the_environment_is_read_in_kforge_env_only():
    read = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*["']KFORGE_""")
    readers = [str(p.relative_to(ROOT)) for p in _modules().values() if read.search(p.read_text())]
    assert readers == ["env.py"]


def test_no_dashboard_module_is_longer_than_a_reader_can_hold():
    dash = Path(__file__).resolve().parents[1] / "dash_app"
    lengths = {str(p.relative_to(dash)): len(p.read_text().splitlines()) for p in sorted(dash.rglob("*.py"))}
    assert lengths, f"no dashboard modules under {dash}"
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines, split them: " + ", ".join(f"{k} ({n})" for k, n in too_long.items())
