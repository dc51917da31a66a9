"""Resume: the tree comes back from the log, and a search killed with kill -9 loses and repeats nothing."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from fakes import FAST_HW, FakeEvaluator, FakeProposer, toy_card

from kforge.store import SQLiteStore
from kforge.search import Budget, search_card
from kforge.search.tree import Tree

RUN = "run-1"
HERE = Path(__file__).parent

# The search a child process runs until it is killed: slow evaluations, each recorded.
CHILD = """
import sys
from fakes import FAST_HW, FakeEvaluator, FakeProposer, toy_card
from kforge.store import SQLiteStore
from kforge.search import Budget, search_card
run_dir, record, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
log = SQLiteStore(run_dir)
log.start_run("run-1")
search_card(toy_card(), FakeProposer(), FakeEvaluator(sleep_s=0.05, record=record), log, "run-1",
            budget=Budget(iterations=iterations), hardware=FAST_HW)
"""


def test_replaying_the_log_rebuilds_the_same_tree(tmp_path):
    log = SQLiteStore(tmp_path)
    log.start_run(RUN)
    outcome = search_card(toy_card(), FakeProposer(), FakeEvaluator(), log, RUN, budget=Budget(iterations=30),
                          hardware=FAST_HW)
    replayed = Tree.replay(log.candidates(RUN, outcome.card_id))
    assert replayed.to_json() == outcome.tree.to_json()
    assert replayed.digests == outcome.tree.digests
    assert replayed.best().id == outcome.best.id


def test_resume_continues_the_count_and_never_reevaluates(tmp_path):
    card = toy_card()
    log = SQLiteStore(tmp_path)
    log.start_run(RUN)
    first = search_card(card, FakeProposer(), FakeEvaluator(), log, RUN, budget=Budget(iterations=15), hardware=FAST_HW)
    before = log.candidates(RUN, card.id)
    again = FakeEvaluator()
    second = search_card(card, FakeProposer(), again, log, RUN, budget=Budget(iterations=30), hardware=FAST_HW)
    rows = log.candidates(RUN, card.id)
    assert rows[:len(before)] == before  # nothing rewritten
    assert first.iterations == 15 and second.iterations == 30
    assert not set(again.calls) & {r.digest for r in rows[:len(before)]}
    assert min(r.iteration for r in rows[len(before):]) >= 15
    # A finished card resumed with the same budget does nothing.
    idle = FakeEvaluator()
    third = search_card(card, FakeProposer(), idle, log, RUN, budget=Budget(iterations=30), hardware=FAST_HW)
    assert idle.calls == [] and third.stop_reason == "iterations" and third.evaluated == 0


def _candidate_count(db: Path) -> int:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT COUNT(*) FROM candidates").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_kill_9_mid_search_then_resume_loses_and_repeats_nothing(tmp_path):
    run_dir, record, iterations = tmp_path / "run", tmp_path / "evaluated.txt", 40
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "python"), str(HERE)]))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(record), str(iterations)], env=env)
    try:
        deadline = time.monotonic() + 60
        while _candidate_count(run_dir / "search.sqlite") < 8:
            assert child.poll() is None, "the search finished or died before it could be killed"
            assert time.monotonic() < deadline, "the child search made no progress"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL

    card = toy_card()
    log = SQLiteStore(run_dir)
    killed_rows = log.candidates(RUN, card.id)
    killed_digests = {r.digest for r in killed_rows}
    assert 8 <= len(killed_rows) and log.card_iterations(RUN, card.id) < iterations
    evaluated_before = record.read_text().split()

    resumed = FakeEvaluator(record=record)
    outcome = search_card(card, FakeProposer(), resumed, log, RUN, budget=Budget(iterations=iterations),
                          hardware=FAST_HW)
    rows = log.candidates(RUN, card.id)
    digests = [r.digest for r in rows]
    # Nothing lost: the killed session's rows are all there, unchanged, first.
    assert rows[:len(killed_rows)] == killed_rows
    # Nothing repeated: no candidate logged twice, and nothing logged before the kill re-evaluated.
    assert len(digests) == len(set(digests))
    assert not set(resumed.calls) & killed_digests
    # At most the one evaluation in flight at the kill was lost (it was never logged).
    assert len(set(evaluated_before) - killed_digests) <= 1
    # The budget is the budget: iteration numbers continue and stop exactly at it.
    assert outcome.iterations == iterations == log.card_iterations(RUN, card.id)
    assert all(0 <= r.iteration < iterations for r in rows)
    assert log.card(RUN, card.id).status == "done"
