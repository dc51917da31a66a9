"""kforge inspect (a run directory or a .cast) and kforge verify (a package's kernels on this GPU)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import warnings
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import KforgeError
from .output import card_json, cards_table_of, emit, results_table


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    path: Path = args.path
    if path.is_dir():
        return _inspect_run(path, console, args)
    if path.suffix == ".cast" and path.is_file():
        return _inspect_package(path, console, args)
    if not path.exists():
        raise KforgeError(f"{path} does not exist: give a run directory or a .cast package")
    raise KforgeError(f"{path} is neither a run directory nor a .cast package")


def _load_package(path: Path, trusted_keys: list[Path] | None):
    """(package, number of cards it dispatches as packaged, "N of M cards dispatched as
    packaged", fallback warnings). A package that is not intact raises PackageError. Loading on
    another GPU (or none) makes every card fall back here: the warnings are returned, to be
    shown as notes."""
    from ..package import PackageFallbackWarning, load

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PackageFallbackWarning)
        pkg = load(path, trusted_keys=trusted_keys)
    entries = pkg.manifest.get("cards", [])
    packaged = sum(e.get("decision") == "dispatched" for e in entries)
    return pkg, packaged, f"{packaged} of {len(entries)} cards dispatched as packaged", caught


def _notes(caught, console: Console) -> None:
    for w in caught:
        console.print(f"[yellow]on this machine:[/] {escape(str(w.message))}", soft_wrap=True)


_PACKAGE_CARD_KEYS = ("id", "op", "summary", "family", "calls", "share", "decision", "reason", "compile", "kind",
                      "timing", "error", "flags")


def _inspect_package(path: Path, console: Console, args: argparse.Namespace) -> int:
    pkg, _, summary, caught = _load_package(path, args.trusted_keys)
    if args.json:
        manifest = pkg.manifest
        return emit({"kind": "package", "path": str(path), "gpu": pkg.gpu, "arch": pkg.arch, "summary": summary,
                      "integrity": pkg.integrity,
                      **{k: manifest.get(k) for k in ("format", "kforge", "torch", "cuda", "run_id", "model_check")},
                      "cards": [{k: e.get(k) for k in _PACKAGE_CARD_KEYS} for e in manifest.get("cards", [])],
                      "notes": [str(w.message) for w in caught]})
    console.print(f"{escape(str(path))}: built for {escape(pkg.gpu)} ({pkg.arch}); {summary}; {pkg.integrity}")
    console.print(pkg.report(fmt="table"))
    console.print(escape(pkg.compile_verdict()))
    _notes(caught, console)
    return 0


def _proposer_errors(log, run_id: str, top: int = 3) -> tuple[int, list[dict]]:
    """(how many proposer errors the run logged, the most frequent messages with their counts;
    ties: the one logged first)."""
    counts = collections.Counter(e.message for e in log.events(run_id, "proposer_error"))
    return counts.total(), [{"message": m, "count": n} for m, n in counts.most_common(top)]


def _inspect_run(run_dir: Path, console: Console, args: argparse.Namespace) -> int:
    from ..card_files import load_cards
    from ..runner import card_results
    from ..store import LOG_NAME, LLMUsage, SQLiteStore

    if not (run_dir / LOG_NAME).exists():
        cards = load_cards(run_dir)
        if not cards:
            raise KforgeError(f"{run_dir} holds no cards and no search log: run `kforge capture` or `kforge run`")
        if args.json:
            return emit({"kind": "capture", "run_dir": str(run_dir), "cards": [card_json(c) for c in cards],
                          "next": f"kforge search {run_dir}"})
        console.print(cards_table_of(cards, args))
        console.print(f"{len(cards)} cards, not searched yet: `kforge search {run_dir}`")
        return 0
    with SQLiteStore(run_dir, readonly=True) as log:
        run_id = log.latest_run()
        if run_id is None:
            raise KforgeError(f"the search log in {run_dir} has no run yet")
        run = log.run(run_id)
        rows = card_results(log, run_id)
        llm = sum(log.llm_usage(run_id).values(), LLMUsage())
        n_errors, errors = _proposer_errors(log, run_id)
    resume = f"kforge search {run_dir}" if run.status in ("interrupted", "running") else None
    if args.json:
        info = {k: v for k, v in dataclasses.asdict(run).items() if k != "config"}
        return emit({"kind": "run", "run_dir": str(run_dir), "run": {**info, "config": run.config},
                     "cards": [dataclasses.asdict(r) for r in rows],
                     "llm": {"calls": llm.calls, "failed_calls": llm.failed_calls, "tokens": llm.tokens,
                             "cost_usd": llm.cost_usd},
                     "proposer_errors": {"count": n_errors, "top": errors}, "resume": resume})
    console.print(f"run [bold]{run.id}[/] ({run.status}) model {run.model or '-'} on "
                  f"{run.device or '-'} {run.arch or ''}, torch {run.torch or '-'}")
    console.print(results_table(rows, "cards", args, getattr(args, "all", False)))
    if llm.calls:
        console.print(f"LLM: {llm.calls} calls ({llm.failed_calls} failed), {llm.tokens} tokens, ${llm.cost_usd:.4f}")
    if n_errors:
        console.print(f"[red]{n_errors} proposer error(s)[/], the most frequent:")
        for e in errors:
            console.print(f"  {e['count']} x {escape(e['message'])}", soft_wrap=True, highlight=False)
    if resume:
        console.print(f"resume with: {resume}")
    return 0


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    """Re-validate every dispatched kernel of a package on this GPU; 1 if any fails."""
    pkg, packaged, summary, caught = _load_package(args.path, args.trusted_keys)
    if args.json:
        results = pkg.verify() if packaged else {}
        failed = [c for c, r in results.items() if r.verdict.failed]
        emit({"path": str(args.path), "summary": summary, "integrity": pkg.integrity,
               "notes": [str(w.message) for w in caught],
               "results": {c: {"verdict": r.verdict.value, "speedup": r.speedup, "message": r.message}
                           for c, r in results.items()}, "failed": failed})
        return 1 if failed else 0
    console.print(f"{escape(str(args.path))}: checksums and format ok; {summary}; {pkg.integrity}")
    _notes(caught, console)
    if not packaged:
        console.print("no kernel to re-run: every card falls back to PyTorch")
        return 0
    results = pkg.verify()
    failed = [c for c, r in results.items() if r.verdict.failed]
    t = Table(title=f"verify {args.path.name}", title_justify="left")
    for col in ("card", "verdict", "speedup", "message"):
        t.add_column(col, overflow="fold")
    for card_id, r in results.items():
        t.add_row(card_id, r.verdict.value, f"{r.speedup:.2f}x" if r.speedup else "-", escape(r.message))
    console.print(t)
    if failed:
        console.print(f"[red]{len(failed)} kernel(s) failed here and will fall back:[/] {', '.join(failed)}")
        return 1
    console.print(f"{len(results)} dispatched kernel(s) verified on this GPU")
    return 0
