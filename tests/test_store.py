"""kforge.store: the same write/read contract over SQLite and memory, today's run directories
read back, older and newer logs upgraded or refused in one line, and no SQL outside the store."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
from fakes import candidate, logged, toy_card

from kforge.cli import main
from kforge.store import SCHEMA_VERSION, MemoryStore, SQLiteStore
from kforge.verdict import EvalResult, Verdict

ROOT = Path(__file__).parent.parent
TODAY = Path(__file__).parent / "data" / "search_log_v2.sql"  # a log as kforge wrote it at schema version 2
TODAY_CARD = "3a711504b908f20c"
KNOBS = {"threads": 256, "vec": 4, "unroll": 1}


@pytest.fixture(params=["sqlite", "memory"])
def store(request, tmp_path):
    """Every contract test runs against both stores."""
    s = SQLiteStore(tmp_path) if request.param == "sqlite" else MemoryStore()
    yield s
    s.close()


def _card(store):
    card = toy_card()
    store.start_run("r", model="Toy", config={"iterations": 5}, device="cpu")
    store.upsert_card("r", card, floor_us=1.5)
    return card


def _add(store, card, verdict, speedup=None, iteration=0, unroll=1, **kw):
    res = EvalResult(verdict, "msg", eager_us=10.0 if speedup else None, kernel_us=10.0 / speedup if speedup else None,
                     evidence={"phase_s": {"compile": 0.25}}, flags=["over_10x"] if speedup else [])
    return store.add_candidate("r", card.id, candidate(dict(KNOBS, unroll=unroll)), res, parent_id=None,
                               iteration=iteration, **kw)


# ---- the contract, over both stores ----------------------------------------------------------

def test_runs_start_resume_and_change_status(store):
    store.start_run("a", model="Toy", config={"validated": False}, arch="sm_90")
    store.set_run_status("a", "interrupted")
    store.start_run("a")  # resuming marks it running again and keeps what it was started with
    run = store.run("a")
    assert (run.id, run.model, run.status, run.arch, run.config, run.validated) == (
        "a", "Toy", "running", "sm_90", {"validated": False}, False)
    assert store.run("missing") is None


def test_a_card_tracks_status_iterations_and_its_best(store):
    card = _card(store)
    slow = _add(store, card, Verdict.SLOWER, 0.8, iteration=0, reward=0.4)
    fast = _add(store, card, Verdict.VALID, 2.0, iteration=1, unroll=2, eval_s=1.5)
    _add(store, card, Verdict.VALID, 1.5, iteration=2, unroll=4)
    store.note_iteration("r", card.id, 7)
    store.note_iteration("r", card.id, 3)
    store.set_card_status("r", card.id, "done")
    rec = store.card("r", card.id)
    assert (rec.status, rec.best_candidate, rec.iterations, rec.floor_us, rec.op) == ("done", fast, 7, 1.5, card.op)
    assert rec.best_speedup == pytest.approx(2.0) and rec.card == json.loads(json.dumps(card.to_json()))
    assert store.card_iterations("r", card.id) == 7 and store.card_iterations("r", "no-such-card") == 0
    rows = store.candidates("r", card.id)
    assert [r.id for r in rows][0] == slow and rows[0].reward == 0.4 and rows[1].eval_s == 1.5


def test_a_candidate_comes_back_as_it_was_tried(store):
    card = _card(store)
    cand = candidate(dict(KNOBS, unroll=8), note="unrolled")
    result = EvalResult(Verdict.COMPILE_ERROR, "error: bad", compile_log="kernel.cu(3): error",
                        evidence={"cuda_error": "none"})
    cid = store.add_candidate("r", card.id, cand, result, parent_id=None, iteration=0, reward=0.0)
    (rec,) = store.candidates("r", card.id)
    tried = rec.tried()
    assert tried.id == cid and tried.candidate.digest() == cand.digest() == rec.digest
    assert tried.candidate.note == "unrolled" and tried.candidate.knobs == cand.knobs
    assert (tried.result.verdict, tried.result.message, tried.result.compile_log, tried.result.evidence) == (
        Verdict.COMPILE_ERROR, "error: bad", "kernel.cu(3): error", {"cuda_error": "none"})


def test_llm_calls_and_events_are_kept_per_run(store):
    card = _card(store)
    store.add_llm_call("r", card.id, "m", prompt_tokens=100, completion_tokens=20, cost_usd=0.01)
    store.add_llm_call("r", card.id, "m", prompt_tokens=50, completion_tokens=5, cost_usd=0.02, status="error")
    store.add_llm_call("other", card.id, "m", prompt_tokens=999, cost_usd=9.0)
    tokens, cost = store.llm_spend("r")
    assert tokens == 175 and cost == pytest.approx(0.03)
    assert [c.status for c in store.llm_calls("r")] == ["ok", "error"]
    store.event("r", "skip", "first", card_id=card.id)
    store.event("r", "resume", "second")
    store.event("r", "skip", "third", level="warning")
    assert [e.message for e in store.events("r", "skip")] == ["first", "third"]
    assert [(e.kind, e.card_id) for e in store.events("r")] == [("skip", card.id), ("resume", None), ("skip", None)]


def test_secrets_are_scrubbed_on_every_write(store, monkeypatch):
    secret = "s3cr3t-value-of-a-key"
    monkeypatch.setenv("MY_SERVICE_TOKEN", secret)
    card = _card(store)
    store.set_card_status("r", card.id, "skipped", f"declined: {secret}")
    store.event("r", "proposer_error", f"the reply said {secret}")
    store.add_llm_call("r", card.id, "m", status="error", error=f"401 for {secret}")
    store.add_candidate("r", card.id, candidate(KNOBS), EvalResult(Verdict.INCORRECT, evidence={"echo": secret}),
                        parent_id=None, iteration=0)
    texts = [store.card("r", card.id).skip_reason, store.events("r")[0].message, store.llm_calls("r")[0].error,
             json.dumps(store.candidates("r")[0].evidence)]
    assert all("***" in t and secret not in t for t in texts), texts


# ---- a run directory written by today's kforge ------------------------------------------------

@pytest.fixture
def today(tmp_path) -> Path:
    """A run directory whose log kforge wrote at schema version 2 (tests/data/search_log_v2.sql)."""
    conn = sqlite3.connect(tmp_path / "search.sqlite")
    conn.executescript(TODAY.read_text())
    conn.close()
    return tmp_path


def test_todays_run_directory_reads_back_whole(today):
    with SQLiteStore(today, readonly=True) as log:
        assert SCHEMA_VERSION == 2 and log.latest_run() == "r-today"
        run = log.run("r-today")
        (card,) = log.cards("r-today")
        cands = log.candidates("r-today", TODAY_CARD)
        listed = log.candidates("r-today", bodies=False)
        usage = log.llm_usage("r-today")
        events = log.events("r-today")
        newest = log.events("r-today", newest=1)
        activity = log.activity("r-today")
    assert (run.status, run.model, run.device, run.validated) == ("done", "Toy", "NVIDIA H200", True)
    assert (card.card_id, card.status, card.iterations, card.best_candidate) == (TODAY_CARD, "done", 2, 1)
    assert card.verdicts == {"compile_error": 1, "slower": 1, "valid": 1} and card.candidates == 3
    assert card.eval_s == pytest.approx(2.5) and card.best_us == 4.0 and card.cost_usd == pytest.approx(0.01)
    assert [(c.id, c.parent_id, c.repair_of, c.verdict) for c in cands] == [
        (1, None, None, "valid"), (2, 1, None, "compile_error"), (3, 1, 2, "slower")]
    assert cands[0].compile_us == 6.0 and cands[0].evidence == {"phase_s": {"compile": 0.5}}
    assert cands[1].compile_log == "kernel.cu(3): error" and cands[0].tried().result.speedup == pytest.approx(2.5)
    assert [c.source for c in listed] == [None] * 3 and [c.digest for c in listed] == [c.digest for c in cands]
    assert usage["gpt-x"].calls == 2 and usage["gpt-x"].failed_calls == 1 and usage["gpt-x"].tokens == 170
    assert [e.kind for e in events] == ["proposer_error", "search_done"] and newest[0].kind == "search_done"
    assert activity[0] == 3


def test_todays_run_directory_is_inspected_and_resumed(today, capsys):
    assert main(["inspect", str(today), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["id"] == "r-today" and out["run"]["config"]["iterations"] == 3
    assert out["llm"] == {"calls": 2, "failed_calls": 1, "tokens": 170, "cost_usd": pytest.approx(0.01)}
    assert out["proposer_errors"] == {"count": 1, "top": [{"message": "propose failed: ProposerError: no kernel",
                                                           "count": 1}]}
    (row,) = out["cards"]
    assert (row["note"], row["search_s"], row["best_us"]) == ("1 compile_error, 1 slower, 1 valid", 2.5, 4.0)
    with SQLiteStore(today) as writer:  # a writer opens it as it is: nothing to upgrade
        writer.event("r-today", "resume", "search continued from the log")
    assert logged(today, "SELECT value FROM meta WHERE key='schema_version'")[0][0] == "2"


# ---- older and newer logs ----------------------------------------------------------------------

def test_a_version_1_run_directory_reads_as_null_compile_times(today):
    logged(today, "ALTER TABLE candidates DROP COLUMN compile_us")
    logged(today, "UPDATE meta SET value='1' WHERE key='schema_version'")
    with SQLiteStore(today, readonly=True) as log:
        assert [c.compile_us for c in log.candidates("r-today")] == [None] * 3
        assert [c.compile_us for c in log.candidates("r-today", bodies=False)] == [None] * 3
    assert logged(today, "SELECT value FROM meta")[0][0] == "1"  # a reader never upgrades


@pytest.mark.parametrize("version, says", [
    ("0", "has log schema version '0', not 1 to 2"),
    (None, "has log schema version None, not 1 to 2"),  # a log from before versions were recorded
    (str(SCHEMA_VERSION + 1), f"was written by a newer kforge (log schema {SCHEMA_VERSION + 1})"),
])
def test_a_log_of_an_unknown_version_is_refused_in_one_line(today, capsys, monkeypatch, version, says):
    monkeypatch.setenv("COLUMNS", "400")  # an error line is never wrapped into two
    if version is None:
        logged(today, "DELETE FROM meta")
    else:
        logged(today, "UPDATE meta SET value=? WHERE key='schema_version'", (version,))
    rc = main(["inspect", str(today)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("error:") and says in line


# ---- no SQL outside the store ------------------------------------------------------------------

_SQL = re.compile(r"\bexecute(?:script|many)?\(|\.conn\b|\bsqlite3\b|\bSELECT\b.+\bFROM\b|\bINSERT INTO\b"
                  r"|\bUPDATE \w+ SET\b|\bDELETE FROM\b|\bCREATE (?:TABLE|INDEX|TEMP)\b|\bPRAGMA\b")
_STORE = ROOT / "python" / "kforge" / "store" / "sqlite"  # the SQLite store package


def test_only_the_store_holds_sql():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for top in ("python", "dash_app", "bench") for p in sorted((ROOT / top).rglob("*.py")) if _STORE not in p.parents
             for n, line in enumerate(p.read_text().splitlines(), 1) if _SQL.search(line)]
    assert not found, "SQL outside kforge.store (add a store query instead):\n" + "\n".join(found)
