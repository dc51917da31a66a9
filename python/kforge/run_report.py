"""What a run returns and how it is shown: a result per card, the results table, and the live
progress rows of the search."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from .cards import Card
from .search.mcts import SearchProgress


@dataclass
class CardResult:
    card_id: str
    op: str
    family: str
    summary: str
    status: str  # done | skipped | searching (interrupted) | pending
    iterations: int
    eager_us: float | None
    best_us: float | None
    speedup: float | None
    note: str  # why it was skipped, or what its candidates' verdicts were
    search_s: float = 0.0  # evaluation wall time spent on the card (sum over its candidates)
    calls: int | None = None
    share: float | None = None  # of the captured runtime
    module: str = ""  # where in the model it ran (capture.module_path)


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    table: list[CardResult]
    package_path: Path | None
    validated: bool  # a GPU validated and timed the candidates
    message: str = ""
    stop_reasons: dict[str, str] = field(default_factory=dict)  # card id -> why its search stopped
    model_check: Any = None  # kforge.modelcheck.ModelCheck: the model eager and with the package, or None
    model_check_error: str = ""  # why the model check did not complete

    def rich_table(self) -> Table:
        return results_table(self.table, f"run {self.run_id}")


def results_table(rows: list[CardResult], title: str, limit: int | None = None, searched_only: bool = False) -> Table:
    """Cards ranked by share with their search results; with `searched_only`, the skipped ones
    are left out, and `limit` keeps the first rows (the caption says how many are not shown)."""
    t = Table(title=title, title_justify="left")
    t.add_column("op", overflow="fold", ratio=3)
    t.add_column("family")
    t.add_column("status")
    for col in ("iters", "time", "eager µs", "best µs", "speedup"):
        t.add_column(col, justify="right")
    t.add_column("note", overflow="fold", ratio=2)
    for col, justify in (("calls", "right"), ("share", "right"), ("card", "left"), ("module", "left")):
        t.add_column(col, justify=justify, overflow="fold")
    picked = [r for r in rows if r.status != "skipped"] if searched_only else rows
    shown = picked[:limit] if limit is not None else picked
    for r in shown:  # Text cells: notes come from the log (compile errors, LLM text), never rich markup
        t.add_row(*map(Text, (r.summary, r.family, r.status, str(r.iterations),
                              f"{r.search_s:.0f} s" if r.search_s else "-", _us(r.eager_us), _us(r.best_us),
                              _speedup(r.speedup), r.note, str(r.calls) if r.calls is not None else "-",
                              f"{r.share:.1%}" if r.share is not None else "-", r.card_id, r.module or "-")))
    if len(shown) < len(rows):
        t.caption = f"{len(rows) - len(shown)} more cards not shown (skipped ones and the smallest; --all lists them)"
    return t


def _us(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


class ProgressView:
    """A rich Progress with one row per card: iterations, best speedup so far, ETA."""

    def __init__(self, console: Console | None, enabled: bool):
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("best {task.fields[best]}"), TimeRemainingColumn(),
            console=console, disable=not enabled, transient=False,
        )
        self.tasks: dict[str, Any] = {}

    def add(self, card: Card, total: int, done: int, best: float | None) -> None:
        self.tasks[card.id] = self.progress.add_task(card.summary()[:60], total=total, completed=min(done, total),
                                                     best=_speedup(best))

    def update(self, p: SearchProgress) -> None:
        self.progress.update(self.tasks[p.card_id], completed=min(p.iteration, p.iterations),
                             best=_speedup(p.best_speedup))

    def finish(self, card_id: str) -> None:
        task = self.tasks[card_id]
        self.progress.update(task, total=self.progress.tasks[task].completed)


def _speedup(s: float | None) -> str:
    return f"{s:.2f}x" if s else "-"
