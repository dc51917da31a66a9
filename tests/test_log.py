"""The search log: schema, candidate rows and the card's best, iteration count, spend, readers."""

from __future__ import annotations

import pytest
from fakes import candidate, logged, toy_card

from kforge.errors import KforgeError
from kforge.store import LOG_NAME, SCHEMA_VERSION, SQLiteStore, connect
from kforge.verdict import EvalResult, Verdict

KNOBS = {"threads": 256, "vec": 4, "unroll": 2}


def _log(tmp_path):
    log = SQLiteStore(tmp_path)
    log.start_run("r", model="Toy", config={"iterations": 5}, device="cpu")
    card = toy_card()
    log.upsert_card("r", card, floor_us=1.5)
    return log, card


def _add(log, card, verdict, speedup=None, iteration=0, unroll=1, **kw):
    res = EvalResult(verdict, eager_us=10.0 if speedup else None, kernel_us=10.0 / speedup if speedup else None)
    return log.add_candidate("r", card.id, candidate(dict(KNOBS, unroll=unroll)), res, parent_id=None,
                             iteration=iteration, **kw)


def test_schema_version_is_recorded_and_newer_logs_are_refused(tmp_path):
    log = SQLiteStore(tmp_path)
    assert logged(log, "SELECT value FROM meta WHERE key='schema_version'")[0][0] == str(SCHEMA_VERSION)
    logged(log, "UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    log.close()
    with pytest.raises(KforgeError, match="newer kforge"):  # the CLI prints it, no traceback
        SQLiteStore(tmp_path)


def _version_1_log(tmp_path) -> int:
    """A log as kforge wrote it at schema version 1 (no candidates.compile_us), with one candidate."""
    log, card = _log(tmp_path)
    cid = _add(log, card, Verdict.VALID, speedup=2.0)
    logged(log, "ALTER TABLE candidates DROP COLUMN compile_us")
    logged(log, "UPDATE meta SET value='1' WHERE key='schema_version'")
    log.close()
    return cid


def test_a_version_1_log_reads_as_null_compile_times_and_a_writer_upgrades_it(tmp_path):
    cid = _version_1_log(tmp_path)
    reader = connect(tmp_path, readonly=True)  # the dashboard's and inspect's way: it must not write
    assert dict(reader.execute("SELECT id, compile_us FROM candidates").fetchone()) == {"id": cid, "compile_us": None}
    reader.close()
    assert connect(tmp_path, readonly=True).execute("SELECT value FROM meta").fetchone()[0] == "1"
    log = SQLiteStore(tmp_path)
    assert logged(log, "SELECT value FROM meta WHERE key='schema_version'")[0][0] == str(SCHEMA_VERSION) == "2"
    card = toy_card()
    new = log.add_candidate("r", card.id, candidate(KNOBS), EvalResult(Verdict.VALID, eager_us=10.0, kernel_us=4.0,
                                                                       compile_us=6.0), parent_id=None, iteration=1)
    assert [(r.id, r.compile_us) for r in log.candidates("r", card.id)] == [(cid, None), (new, 6.0)]
    log.close()


def test_candidate_rows_keep_everything_and_the_card_tracks_its_best(tmp_path):
    log, card = _log(tmp_path)
    slow = _add(log, card, Verdict.SLOWER, 0.8, iteration=0, unroll=1, reward=0.4)
    fast = _add(log, card, Verdict.VALID, 2.0, iteration=1, unroll=2)
    _add(log, card, Verdict.VALID, 1.5, iteration=2, unroll=4)
    _add(log, card, Verdict.INCORRECT, None, iteration=3, unroll=8, repair_of=fast)
    row = logged(log, "SELECT * FROM cards WHERE card_id=?", (card.id,))[0]
    assert row["best_candidate"] == fast and row["best_speedup"] == pytest.approx(2.0)
    assert row["iterations"] == 4 and row["floor_us"] == 1.5
    rows = log.candidates("r", card.id)
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    assert rows[0].id == slow and rows[0].reward == 0.4 and rows[0].speedup == pytest.approx(0.8)
    assert rows[3].repair_of == fast and rows[3].verdict == "incorrect"


def test_note_iteration_only_moves_forward(tmp_path):
    log, card = _log(tmp_path)
    assert log.card_iterations("r", card.id) == 0
    log.note_iteration("r", card.id, 7)
    log.note_iteration("r", card.id, 3)
    assert log.card_iterations("r", card.id) == 7
    assert log.card_iterations("r", "no-such-card") == 0


def test_llm_spend_sums_the_run_only(tmp_path):
    log, card = _log(tmp_path)
    assert log.llm_spend("r") == (0, 0.0)
    log.add_llm_call("r", card.id, "m", prompt_tokens=100, completion_tokens=20, cost_usd=0.01)
    log.add_llm_call("r", card.id, "m", prompt_tokens=50, completion_tokens=5, cost_usd=0.02, status="error")
    log.add_llm_call("other", card.id, "m", prompt_tokens=999, cost_usd=9.0)
    tokens, cost = log.llm_spend("r")
    assert tokens == 175 and cost == pytest.approx(0.03)


def test_latest_run_and_status(tmp_path):
    log = SQLiteStore(tmp_path)
    assert log.latest_run() is None
    log.start_run("a")
    log.start_run("b")
    assert log.latest_run() == "b"
    log.set_run_status("b", "interrupted")
    log.start_run("b")  # resuming marks it running again and keeps its row
    assert [tuple(r) for r in logged(log, "SELECT id, status FROM runs ORDER BY id")] == [("a", "running"), ("b", "running")]


def test_readers_see_committed_rows_while_the_writer_is_open(tmp_path):
    log, card = _log(tmp_path)
    _add(log, card, Verdict.VALID, 1.2)
    reader = connect(tmp_path, readonly=True)
    assert (tmp_path / LOG_NAME).exists()
    assert reader.execute("SELECT COUNT(*) FROM candidates").fetchone()[0] == 1
    _add(log, card, Verdict.VALID, 1.3, unroll=4)
    assert reader.execute("SELECT COUNT(*) FROM candidates").fetchone()[0] == 2
    with pytest.raises(Exception, match="readonly"):
        reader.execute("DELETE FROM candidates")
    reader.close()
