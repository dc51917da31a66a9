"""What the commands print: consoles (stdout for results, stderr for the rest), --json, progress
lines, and the tables of results and cards."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.markup import escape

from .parser import PIPE_WIDTH, TOP_CARDS


def out_console() -> Console:
    """stdout for people. Piped or redirected it is as wide as a row needs: a table then has
    one line per row instead of wrapping at 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)


def err_console() -> Console:
    console = Console(stderr=True)
    return console if console.is_terminal else Console(stderr=True, width=PIPE_WIDTH)


def emit(data: Any) -> int:
    """The one JSON document a --json command prints on stdout."""
    sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")
    return 0


def progress_lines(args: argparse.Namespace, err: Console, what: str) -> Callable[[str], None]:
    """Progress of a long step as plain lines on stderr (a log file stays readable); nothing
    with -q or --no-progress."""
    if args.quiet or getattr(args, "no_progress", False):
        return lambda line: None
    return lambda line: err.print(f"{what}: {line}", highlight=False, markup=False, soft_wrap=True)


@contextlib.contextmanager
def capture_progress(args: argparse.Namespace, err: Console) -> Iterator[Callable[[str], None]]:
    """The capture's stages on stderr: a live status line on a terminal, plain lines and the
    time it took otherwise, nothing with -q."""
    t0 = time.monotonic()
    if args.quiet or not err.is_terminal:
        yield progress_lines(args, err, "capture")
    else:
        with err.status("capture") as status:
            yield lambda line: status.update(f"capture: {escape(line)}")
    if not args.quiet:
        err.print(f"capture: done in {time.monotonic() - t0:.1f} s", highlight=False, markup=False)


def _table_limit(args: argparse.Namespace) -> dict:
    return {} if getattr(args, "all", False) else {"limit": TOP_CARDS}


def _result_json(result) -> dict:
    check = result.model_check
    return {"run_id": result.run_id, "run_dir": str(result.run_dir), "validated": result.validated,
            "package": str(result.package_path) if result.package_path else None, "message": result.message,
            "cards": [dataclasses.asdict(r) for r in result.table], "stop_reasons": result.stop_reasons,
            "model_check": {"verdict": check.verdict, "message": check.message(),
                            "compile": check.compile_record()} if check is not None else None,
            "model_check_error": result.model_check_error or None}


def report_result(result, console: Console, args: argparse.Namespace) -> int:
    if getattr(args, "json", False):
        return emit(_result_json(result))
    everything = getattr(args, "all", False)
    console.print(results_table(result.table, f"run {result.run_id}", args, everything))
    if result.message:
        console.print(f"[yellow]{escape(result.message)}[/]", soft_wrap=True)
    if result.package_path:
        console.print(f"package: [bold]{result.package_path}[/]")
    check = result.model_check
    if check is not None:
        colour = {"faster": "green", "slower": "red", "unused": "red"}.get(check.verdict, "yellow")
        console.print(f"[{colour}]{escape(check.message())}[/]", soft_wrap=True)
    elif result.model_check_error:
        console.print(f"[yellow]the model check did not complete: {escape(result.model_check_error)}[/]", soft_wrap=True)
    console.print(f"run directory: {result.run_dir}")
    return 0


def results_table(rows, title: str, args: argparse.Namespace, everything: bool):
    from ..run_report import results_table

    return results_table(rows, title, searched_only=not everything, **({} if everything else {"limit": TOP_CARDS}))


def card_json(card) -> dict:
    from ..cardtable import skip_reason

    return {"id": card.id, "op": card.op, "summary": card.summary(), "family": card.family, "calls": card.calls,
            "eager_us": card.eager_us, "share": card.share, "module_paths": card.module_paths,
            "searchable": skip_reason(card) is None, "skip_reason": skip_reason(card)}


def cards_table_of(cards, args: argparse.Namespace):
    from ..cardtable import cards_table

    everything = getattr(args, "all", False)
    return cards_table(cards, searchable_only=not everything, **({} if everything else {"limit": TOP_CARDS}))
