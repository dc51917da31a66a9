"""The SQLite store: one search log file per run directory (WAL), written by the search and
read by the dashboard, `kforge inspect`, the packager and resume.

Only this package holds SQL. `logfile` checks a log before it is used (schema version,
tables, columns, JSON columns), upgrades an older schema (MIGRATIONS) or refuses it in one
line; `SQLiteStore` here writes and reads it, giving back the typed records of `records.py`.

Every evaluated candidate is one row, committed before the search moves on, so a run
killed with kill -9 resumes without losing or repeating an evaluated candidate. The MCTS
tree is the candidates' parent links; visit counts are rebuilt from the rows on resume.
API keys are never written here.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from ...redact import scrub
from ..records import CandidateRecord, CardRecord, EventRecord, LLMCallRecord, LLMUsage, RunRecord
from .logfile import JSON_COLUMNS, LOG_NAME, connect, log_path, translated

# The columns a candidate listing reads: all but the large ones (source, compile log, plan, evidence).
_LISTED = ("id, run_id, card_id, parent_id, repair_of, iteration, created, proposer, kind, digest, knobs_json, note, "
           "verdict, message, eager_us, kernel_us, dispatched_us, speedup, reward, max_abs_err, max_rel_err, "
           "flags_json, eval_s, compile_us")


class SQLiteStore:
    """A run directory's search log. A writer (one per process and thread) commits every
    write as its own transaction; a reader (`readonly=True`) never writes, so a search
    writing the same file is never blocked. Every sqlite3 error is a one-line LogError."""

    def __init__(self, run_dir: str | Path, readonly: bool = False):
        self.path = log_path(run_dir) if readonly else Path(run_dir) / LOG_NAME
        self.run_dir = self.path.parent
        self._conn = connect(self.path, readonly=readonly)

    def __enter__(self) -> "SQLiteStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; an sqlite3 error in it (a lock held too long, a full disk) is a LogError."""
        with translated(self.path), self._conn:
            yield self._conn

    def _rows(self, sql: str, params: Iterable = ()) -> list[sqlite3.Row]:
        with translated(self.path):
            return self._conn.execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        self._conn.close()

    # ---- runs -----------------------------------------------------------------------
    def start_run(self, run_id: str, model: str = "", config: dict | None = None, **info: Any) -> None:
        """A new run (or, for one the log holds, that it runs again)."""
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO runs (id, created, model, config_json, device, arch, torch, kforge) VALUES (?,?,?,?,?,?,?,?)",
                (run_id, time.time(), model, json.dumps(config or {}), info.get("device"), info.get("arch"),
                 info.get("torch"), info.get("kforge")),
            )
            db.execute("UPDATE runs SET status='running' WHERE id=?", (run_id,))

    def set_run_status(self, run_id: str, status: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE runs SET status=? WHERE id=?", (status, run_id))

    def latest_run(self) -> str | None:
        """The id of the most recently started run in this log, if any."""
        rows = self._rows("SELECT id FROM runs ORDER BY created DESC, rowid DESC LIMIT 1")
        return rows[0][0] if rows else None

    def runs(self) -> list[RunRecord]:
        """Every run of the log, newest first."""
        return [_run(r) for r in self._rows("SELECT * FROM runs ORDER BY created DESC, rowid DESC")]

    def run(self, run_id: str) -> RunRecord | None:
        rows = self._rows("SELECT * FROM runs WHERE id=?", (run_id,))
        return _run(rows[0]) if rows else None

    # ---- cards ----------------------------------------------------------------------
    def upsert_card(self, run_id: str, card, floor_us: float | None = None) -> None:
        with self._tx() as db:
            db.execute(
                """INSERT INTO cards (run_id, card_id, op, family, summary, calls, eager_us, share, floor_us, card_json)
                   VALUES (?,?,?,?,?,?,?,?,?,?)
                   ON CONFLICT (run_id, card_id) DO UPDATE SET calls=excluded.calls, eager_us=excluded.eager_us,
                     share=excluded.share, floor_us=COALESCE(excluded.floor_us, floor_us), card_json=excluded.card_json""",
                (run_id, card.id, card.op, card.family, card.summary(), card.calls, card.eager_us, card.share,
                 floor_us, json.dumps(card.to_json())),
            )

    def set_card_status(self, run_id: str, card_id: str, status: str, skip_reason: str | None = None) -> None:
        with self._tx() as db:
            db.execute("UPDATE cards SET status=?, skip_reason=? WHERE run_id=? AND card_id=?",
                       (status, scrub(skip_reason) if skip_reason else skip_reason, run_id, card_id))

    def note_iteration(self, run_id: str, card_id: str, iterations: int) -> None:
        """Record that `iterations` search iterations are done for a card. Iterations that
        evaluated nothing (a duplicate, a proposer error) count too, so resume continues the count."""
        with self._tx() as db:
            db.execute("UPDATE cards SET iterations = MAX(iterations, ?) WHERE run_id=? AND card_id=?",
                       (iterations, run_id, card_id))

    def card_iterations(self, run_id: str, card_id: str) -> int:
        rows = self._rows("SELECT iterations FROM cards WHERE run_id=? AND card_id=?", (run_id, card_id))
        return int(rows[0][0]) if rows else 0

    def cards(self, run_id: str, card_id: str | None = None) -> list[CardRecord]:
        """The run's cards (or the one named), largest share first, each with its candidates'
        verdict counts, evaluation time, best kernel time and LLM cost."""
        where, params = ("AND c.card_id=?", (run_id, card_id)) if card_id is not None else ("", (run_id,))
        rows = self._rows(
            f"""SELECT c.*, (SELECT kernel_us FROM candidates k WHERE k.id=c.best_candidate) AS best_us,
                  (SELECT COALESCE(SUM(cost_usd), 0) FROM llm_calls l WHERE l.run_id=c.run_id
                     AND l.card_id=c.card_id) AS cost_usd
                FROM cards c WHERE c.run_id=? {where} ORDER BY COALESCE(c.share, 0) DESC, c.card_id""", params)
        verdicts: dict[str, dict[str, int]] = {}
        spent: dict[str, float] = {}
        for r in self._rows(f"SELECT card_id, verdict, COUNT(*), COALESCE(SUM(eval_s), 0) FROM candidates c "
                            f"WHERE run_id=? {where} GROUP BY card_id, verdict ORDER BY COUNT(*) DESC, verdict",
                            params):
            verdicts.setdefault(r[0], {})[r[1]] = r[2]
            spent[r[0]] = spent.get(r[0], 0.0) + r[3]
        return [_card(r, verdicts.get(r["card_id"], {}), spent.get(r["card_id"], 0.0)) for r in rows]

    def card(self, run_id: str, card_id: str) -> CardRecord | None:
        rows = self.cards(run_id, card_id)
        return rows[0] if rows else None

    # ---- candidates -----------------------------------------------------------------
    def add_candidate(self, run_id: str, card_id: str, candidate, result, *, parent_id: int | None,
                      iteration: int, reward: float | None = None, repair_of: int | None = None,
                      eval_s: float | None = None) -> int:
        """Record one evaluated candidate and update the card's best; returns its id."""
        r = result
        with self._tx() as db:
            cur = db.execute(
                """INSERT INTO candidates (run_id, card_id, parent_id, repair_of, iteration, created, proposer, kind,
                   digest, source, plan_json, knobs_json, note, verdict, message, compile_log, evidence_json,
                   eager_us, kernel_us, dispatched_us, speedup, reward, max_abs_err, max_rel_err, flags_json, eval_s,
                   compile_us)
                   VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)""",
                (run_id, card_id, parent_id, repair_of, iteration, time.time(), candidate.proposer, candidate.kind,
                 candidate.digest(), candidate.source, candidate.plan.dumps(), json.dumps(candidate.knobs, default=str),
                 candidate.note, r.verdict.value, r.message, r.compile_log,
                 scrub(json.dumps(r.evidence, default=str), limit=None),
                 r.eager_us, r.kernel_us, r.dispatched_us, r.speedup, reward, r.max_abs_err, r.max_rel_err,
                 json.dumps(r.flags), eval_s, r.compile_us),
            )
            cid = cur.lastrowid
            db.execute(
                """UPDATE cards SET iterations = MAX(iterations, ?),
                     best_candidate = CASE WHEN ? = 'valid' AND ? > COALESCE(best_speedup, 0) THEN ? ELSE best_candidate END,
                     best_speedup = CASE WHEN ? = 'valid' AND ? > COALESCE(best_speedup, 0) THEN ? ELSE best_speedup END
                   WHERE run_id=? AND card_id=?""",
                (iteration + 1, r.verdict.value, r.speedup or 0, cid, r.verdict.value, r.speedup or 0, r.speedup,
                 run_id, card_id),
            )
        return cid

    def candidates(self, run_id: str, card_id: str | None = None, *, bodies: bool = True) -> list[CandidateRecord]:
        """The run's candidates (of one card, if named) in the order they were evaluated;
        `bodies=False` leaves out sources, compile logs, plans and evidence."""
        where, params = ("AND card_id=?", (run_id, card_id)) if card_id is not None else ("", (run_id,))
        columns = "*" if bodies else _LISTED
        return [_candidate(r) for r in self._rows(f"SELECT {columns} FROM candidates WHERE run_id=? {where} ORDER BY id",
                                                   params)]

    def candidate(self, run_id: str, candidate_id: int) -> CandidateRecord | None:
        rows = self._rows("SELECT * FROM candidates WHERE run_id=? AND id=?", (run_id, candidate_id))
        return _candidate(rows[0]) if rows else None

    def activity(self, run_id: str) -> tuple[int, float | None]:
        """(candidates evaluated, when the last one was) of a run."""
        (row,) = self._rows("SELECT COUNT(*), MAX(created) FROM candidates WHERE run_id=?", (run_id,))
        return int(row[0]), row[1]

    # ---- LLM calls and events ---------------------------------------------------------
    def add_llm_call(self, run_id: str, card_id: str | None, model: str, *, prompt_tokens: int = 0,
                     completion_tokens: int = 0, cost_usd: float = 0.0, duration_s: float = 0.0,
                     status: str = "ok", error: str | None = None, base_url: str | None = None,
                     candidate_id: int | None = None) -> int:
        with self._tx() as db:
            cur = db.execute(
                """INSERT INTO llm_calls (run_id, card_id, candidate_id, created, model, base_url, prompt_tokens,
                   completion_tokens, cost_usd, duration_s, status, error) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)""",
                (run_id, card_id, candidate_id, time.time(), model, base_url, prompt_tokens, completion_tokens,
                 cost_usd, duration_s, status, scrub(error) if error else error),
            )
        return cur.lastrowid

    def llm_calls(self, run_id: str) -> list[LLMCallRecord]:
        return [LLMCallRecord(**dict(r)) for r in self._rows("SELECT * FROM llm_calls WHERE run_id=? ORDER BY id",
                                                              (run_id,))]

    def llm_usage(self, run_id: str) -> dict[str, LLMUsage]:
        """What the run's LLM calls add up to, per model as logged."""
        rows = self._rows("SELECT model, COUNT(*), COALESCE(SUM(status != 'ok'), 0), "
                          "COALESCE(SUM(prompt_tokens), 0) + COALESCE(SUM(completion_tokens), 0), "
                          "COALESCE(SUM(cost_usd), 0.0) FROM llm_calls WHERE run_id=? GROUP BY model ORDER BY model",
                          (run_id,))
        return {r[0]: LLMUsage(int(r[1]), int(r[2]), int(r[3]), float(r[4])) for r in rows}

    def llm_spend(self, run_id: str) -> tuple[int, float]:
        """(tokens, cost in USD) the run's LLM calls have spent."""
        total = sum(self.llm_usage(run_id).values(), LLMUsage())
        return total.tokens, total.cost_usd

    def event(self, run_id: str, kind: str, message: str, level: str = "info", card_id: str | None = None) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO events (run_id, card_id, created, level, kind, message) VALUES (?,?,?,?,?,?)",
                       (run_id, card_id, time.time(), level, kind, scrub(message)))

    def events(self, run_id: str, kind: str | None = None, *, newest: int | None = None) -> list[EventRecord]:
        """The run's events (of one kind, if named) in the order logged; `newest`: only the
        last that many, newest first."""
        where, params = ("AND kind=?", (run_id, kind)) if kind is not None else ("", (run_id,))
        order = "ORDER BY id DESC LIMIT ?" if newest is not None else "ORDER BY id"
        params = params + (newest,) if newest is not None else params
        return [EventRecord(**dict(r)) for r in self._rows(f"SELECT * FROM events WHERE run_id=? {where} {order}", params)]


def _parsed(d: dict, table: str) -> dict:
    """A row with its JSON columns parsed (`plan_json` -> `plan`). A writer checked every one
    when it opened the log; a reader, which skips that scan, gets an empty value for a
    damaged one rather than a page that fails."""
    for column, kind in JSON_COLUMNS[table].items():
        if column in d:
            try:
                value = json.loads(d.pop(column))
            except (TypeError, ValueError):
                value = None
            d[column.removesuffix("_json")] = value if isinstance(value, kind) else kind()
    return d


def _run(r: sqlite3.Row) -> RunRecord:
    return RunRecord(**_parsed(dict(r), "runs"))


def _card(r: sqlite3.Row, verdicts: dict[str, int], eval_s: float) -> CardRecord:
    return CardRecord(**_parsed(dict(r), "cards"), verdicts=verdicts, eval_s=eval_s)


def _candidate(r: sqlite3.Row) -> CandidateRecord:
    return CandidateRecord(**_parsed(dict(r), "candidates"))
