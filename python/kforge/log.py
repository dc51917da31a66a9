"""The search log: one SQLite file per run directory (WAL), written by the search and
read by the dashboard, `kforge inspect` and resume.

Every evaluated candidate is one row, committed before the search moves on, so a run
killed with kill -9 resumes without losing or repeating an evaluated candidate. The MCTS
tree is the candidates' parent links; visit counts are rebuilt from the rows on resume.
API keys are never written here.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable

from .errors import KforgeError
from .redact import scrub

SCHEMA_VERSION = 1
LOG_NAME = "search.sqlite"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
  id TEXT PRIMARY KEY,
  created REAL NOT NULL,
  model TEXT,
  status TEXT NOT NULL DEFAULT 'running',   -- running | done | interrupted | failed
  device TEXT, arch TEXT, torch TEXT, kforge TEXT,
  config_json TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS cards (
  run_id TEXT NOT NULL,
  card_id TEXT NOT NULL,
  op TEXT NOT NULL,
  family TEXT NOT NULL,
  summary TEXT NOT NULL,
  calls INTEGER, eager_us REAL, share REAL,
  status TEXT NOT NULL DEFAULT 'pending',   -- pending | searching | done | skipped | failed
  skip_reason TEXT,
  best_candidate INTEGER, best_speedup REAL,
  iterations INTEGER NOT NULL DEFAULT 0,
  floor_us REAL,
  card_json TEXT NOT NULL,
  PRIMARY KEY (run_id, card_id)
);
CREATE TABLE IF NOT EXISTS candidates (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL,
  card_id TEXT NOT NULL,
  parent_id INTEGER,            -- MCTS parent (NULL: child of the root)
  repair_of INTEGER,            -- set when this is a repair attempt of a failed candidate
  iteration INTEGER NOT NULL,   -- search iteration that produced it
  created REAL NOT NULL,
  proposer TEXT NOT NULL,       -- builtin | llm:<model>
  kind TEXT NOT NULL,           -- custom | vendor
  digest TEXT NOT NULL,
  source TEXT NOT NULL,
  plan_json TEXT NOT NULL,
  knobs_json TEXT NOT NULL DEFAULT '{}',
  note TEXT NOT NULL DEFAULT '',
  verdict TEXT NOT NULL,
  message TEXT NOT NULL DEFAULT '',
  compile_log TEXT NOT NULL DEFAULT '',
  evidence_json TEXT NOT NULL DEFAULT '{}',
  eager_us REAL, kernel_us REAL, dispatched_us REAL, speedup REAL, reward REAL,
  max_abs_err REAL, max_rel_err REAL,
  flags_json TEXT NOT NULL DEFAULT '[]',
  eval_s REAL
);
CREATE INDEX IF NOT EXISTS candidates_card ON candidates (run_id, card_id, id);
CREATE TABLE IF NOT EXISTS llm_calls (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL, card_id TEXT, candidate_id INTEGER,
  created REAL NOT NULL,
  model TEXT NOT NULL, base_url TEXT,
  prompt_tokens INTEGER, completion_tokens INTEGER, cost_usd REAL, duration_s REAL,
  status TEXT NOT NULL,         -- ok | error | retry
  error TEXT
);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL, card_id TEXT,
  created REAL NOT NULL,
  level TEXT NOT NULL,          -- info | warning | error
  kind TEXT NOT NULL,
  message TEXT NOT NULL
);
"""


def connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    path = Path(path)
    if path.is_dir():
        path = path / LOG_NAME
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, check_same_thread=False)
    else:
        conn = sqlite3.connect(str(path), timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
    conn.row_factory = sqlite3.Row
    return conn


class SearchLog:
    """Writer side of the log. One per process; every write is its own transaction."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.conn = connect(self.run_dir / LOG_NAME)
        with self.conn:
            self.conn.executescript(SCHEMA)
            row = self.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self.conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise KforgeError(f"{self.run_dir} was written by a newer kforge (log schema {row[0]}); upgrade kforge")

    def close(self) -> None:
        self.conn.close()

    # ---- runs -----------------------------------------------------------------------
    def start_run(self, run_id: str, model: str = "", config: dict | None = None, **info: Any) -> None:
        with self.conn:
            self.conn.execute(
                "INSERT OR IGNORE INTO runs (id, created, model, config_json, device, arch, torch, kforge) VALUES (?,?,?,?,?,?,?,?)",
                (run_id, time.time(), model, json.dumps(config or {}), info.get("device"), info.get("arch"),
                 info.get("torch"), info.get("kforge")),
            )
            self.conn.execute("UPDATE runs SET status='running' WHERE id=?", (run_id,))

    def set_run_status(self, run_id: str, status: str) -> None:
        with self.conn:
            self.conn.execute("UPDATE runs SET status=? WHERE id=?", (status, run_id))

    # ---- cards ----------------------------------------------------------------------
    def upsert_card(self, run_id: str, card, floor_us: float | None = None) -> None:
        with self.conn:
            self.conn.execute(
                """INSERT INTO cards (run_id, card_id, op, family, summary, calls, eager_us, share, floor_us, card_json)
                   VALUES (?,?,?,?,?,?,?,?,?,?)
                   ON CONFLICT (run_id, card_id) DO UPDATE SET calls=excluded.calls, eager_us=excluded.eager_us,
                     share=excluded.share, floor_us=COALESCE(excluded.floor_us, floor_us), card_json=excluded.card_json""",
                (run_id, card.id, card.op, card.family, card.summary(), card.calls, card.eager_us, card.share,
                 floor_us, json.dumps(card.to_json())),
            )

    def set_card_status(self, run_id: str, card_id: str, status: str, skip_reason: str | None = None) -> None:
        with self.conn:
            self.conn.execute("UPDATE cards SET status=?, skip_reason=? WHERE run_id=? AND card_id=?",
                              (status, scrub(skip_reason) if skip_reason else skip_reason, run_id, card_id))

    # ---- candidates -----------------------------------------------------------------
    def add_candidate(self, run_id: str, card_id: str, candidate, result, *, parent_id: int | None,
                      iteration: int, reward: float | None = None, repair_of: int | None = None,
                      eval_s: float | None = None) -> int:
        """Record one evaluated candidate and update the card's best; returns its id."""
        r = result
        with self.conn:
            cur = self.conn.execute(
                """INSERT INTO candidates (run_id, card_id, parent_id, repair_of, iteration, created, proposer, kind,
                   digest, source, plan_json, knobs_json, note, verdict, message, compile_log, evidence_json,
                   eager_us, kernel_us, dispatched_us, speedup, reward, max_abs_err, max_rel_err, flags_json, eval_s)
                   VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)""",
                (run_id, card_id, parent_id, repair_of, iteration, time.time(), candidate.proposer, candidate.kind,
                 candidate.digest(), candidate.source, candidate.plan.dumps(), json.dumps(candidate.knobs, default=str),
                 candidate.note, r.verdict.value, r.message, r.compile_log,
                 scrub(json.dumps(r.evidence, default=str), limit=None),
                 r.eager_us, r.kernel_us, r.dispatched_us, r.speedup, reward, r.max_abs_err, r.max_rel_err,
                 json.dumps(r.flags), eval_s),
            )
            cid = cur.lastrowid
            self.conn.execute(
                """UPDATE cards SET iterations = MAX(iterations, ?),
                     best_candidate = CASE WHEN ? = 'valid' AND ? > COALESCE(best_speedup, 0) THEN ? ELSE best_candidate END,
                     best_speedup = CASE WHEN ? = 'valid' AND ? > COALESCE(best_speedup, 0) THEN ? ELSE best_speedup END
                   WHERE run_id=? AND card_id=?""",
                (iteration + 1, r.verdict.value, r.speedup or 0, cid, r.verdict.value, r.speedup or 0, r.speedup,
                 run_id, card_id),
            )
        return cid

    # ---- LLM calls and events ---------------------------------------------------------
    def add_llm_call(self, run_id: str, card_id: str | None, model: str, *, prompt_tokens: int = 0,
                     completion_tokens: int = 0, cost_usd: float = 0.0, duration_s: float = 0.0,
                     status: str = "ok", error: str | None = None, base_url: str | None = None,
                     candidate_id: int | None = None) -> int:
        with self.conn:
            cur = self.conn.execute(
                """INSERT INTO llm_calls (run_id, card_id, candidate_id, created, model, base_url, prompt_tokens,
                   completion_tokens, cost_usd, duration_s, status, error) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)""",
                (run_id, card_id, candidate_id, time.time(), model, base_url, prompt_tokens, completion_tokens,
                 cost_usd, duration_s, status, scrub(error) if error else error),
            )
        return cur.lastrowid

    def event(self, run_id: str, kind: str, message: str, level: str = "info", card_id: str | None = None) -> None:
        with self.conn:
            self.conn.execute("INSERT INTO events (run_id, card_id, created, level, kind, message) VALUES (?,?,?,?,?,?)",
                              (run_id, card_id, time.time(), level, kind, scrub(message)))

    def note_iteration(self, run_id: str, card_id: str, iterations: int) -> None:
        """Record that `iterations` search iterations are done for a card. Iterations that
        evaluated nothing (a duplicate, a proposer error) count too, so resume continues the count."""
        with self.conn:
            self.conn.execute("UPDATE cards SET iterations = MAX(iterations, ?) WHERE run_id=? AND card_id=?",
                              (iterations, run_id, card_id))

    # ---- reads used by the search itself --------------------------------------------------
    def candidates(self, run_id: str, card_id: str) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM candidates WHERE run_id=? AND card_id=? ORDER BY id",
                                 (run_id, card_id)).fetchall()

    def card_iterations(self, run_id: str, card_id: str) -> int:
        row = self.conn.execute("SELECT iterations FROM cards WHERE run_id=? AND card_id=?", (run_id, card_id)).fetchone()
        return int(row[0]) if row else 0

    def latest_run(self) -> str | None:
        """The id of the most recently started run in this log, if any."""
        row = self.conn.execute("SELECT id FROM runs ORDER BY created DESC, rowid DESC LIMIT 1").fetchone()
        return row[0] if row else None

    def llm_spend(self, run_id: str) -> tuple[int, float]:
        """(tokens, cost in USD) the run's LLM calls have spent."""
        row = self.conn.execute(
            "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0), COALESCE(SUM(cost_usd), 0.0) "
            "FROM llm_calls WHERE run_id=?", (run_id,)).fetchone()
        return int(row[0]), float(row[1])

    def rows(self, sql: str, params: Iterable = ()) -> list[sqlite3.Row]:
        return self.conn.execute(sql, tuple(params)).fetchall()
