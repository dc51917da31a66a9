"""The SQLite store: one search log file per run directory (WAL), written by the search and
read by the dashboard, `kforge inspect`, the packager and resume.

Only this module holds SQL. It checks a log before using it (schema version, tables,
columns, JSON columns), upgrades an older schema (MIGRATIONS) or refuses it in one line,
and gives back the typed records of `records.py`.

Every evaluated candidate is one row, committed before the search moves on, so a run
killed with kill -9 resumes without losing or repeating an evaluated candidate. The MCTS
tree is the candidates' parent links; visit counts are rebuilt from the rows on resume.
API keys are never written here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import sqlite3
import struct
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..errors import LogError
from ..redact import scrub
from .records import CandidateRecord, CardRecord, EventRecord, LLMCallRecord, LLMUsage, RunRecord

SCHEMA_VERSION = 2
LOG_NAME = "search.sqlite"

# What each schema version adds to the one before, (table, column, type): columns only, so a
# log of an older version opens. A writer adds them (one transaction) and records the new
# version; a reader, which must not write, sees them as NULL through temporary views.
MIGRATIONS: dict[int, list[tuple[str, str, str]]] = {
    2: [("candidates", "compile_us", "REAL")],  # the card's reference under torch.compile, GPU time
}

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
  eval_s REAL,
  compile_us REAL
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


# The JSON columns and the type each must parse to. Resume rebuilds every search tree from
# them, so a writer checks every row; runs.config_json is checked by every reader too.
JSON_COLUMNS: dict[str, dict[str, type]] = {
    "runs": {"config_json": dict},
    "cards": {"card_json": dict},
    "candidates": {"plan_json": dict, "knobs_json": dict, "evidence_json": dict, "flags_json": list},
}

# How long an open or a write waits for a log another process holds, before saying who holds it.
LOCK_WAIT_S = 5.0

_SQLITE_MAGIC = b"SQLite format 3\x00"


def log_path(path: str | Path) -> Path:
    """The log file of a run directory (or the file itself)."""
    path = Path(path)
    return path / LOG_NAME if path.is_dir() else path


def connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    """Open a search log (a run directory or the file) after checking it: the one way the
    search, resume, `kforge inspect` and the dashboard open one.

    Checked: it is a whole SQLite file (not empty, garbage or truncated), of this kforge's
    schema version, with every table and column of SCHEMA, and runs.config_json parses.
    A writer also runs SQLite's quick_check and parses every JSON column of every row,
    since resume rebuilds the search from them; readers (the dashboard polls) skip those
    scans. A writer creates a missing log. Every problem, and any sqlite3 error on the way,
    raises a one-line LogError that says what to do; a log another process holds is waited
    for LOCK_WAIT_S seconds first.
    """
    path = log_path(path)
    with translated(path):
        if not path.exists():
            if readonly:
                raise LogError(f"no search log at {path}: run `kforge search {path.parent}` (or `kforge run`) first")
            try:
                _create(path)
            except OSError as e:
                raise LogError(f"cannot create {path} ({e.strerror or e}): give a run directory you can "
                               f"write") from None
        try:
            _check_file(path)
        except OSError as e:
            raise LogError(f"cannot read {path} ({e.strerror or e}): check its permissions") from None
        if readonly:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=LOCK_WAIT_S, check_same_thread=False)
        else:
            conn = sqlite3.connect(str(path), timeout=LOCK_WAIT_S)
        try:
            conn.row_factory = sqlite3.Row
            _upgrade(conn, _check_schema(conn, path), readonly)
            _check_json(conn, path, ["runs"] if readonly else list(JSON_COLUMNS))
            if not readonly:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                problem = conn.execute("PRAGMA quick_check(1)").fetchone()[0]
                if problem != "ok":
                    raise LogError(_broken(path, f"is damaged (SQLite quick_check: {problem})"))
        except BaseException:
            conn.close()
            raise
    return conn


@contextlib.contextmanager
def translated(path: Path) -> Iterator[None]:
    """sqlite3 errors inside become a one-line LogError about `path`."""
    try:
        yield
    except sqlite3.Error as e:
        raise LogError(_sqlite_problem(path, e)) from None


def _broken(path: Path, what: str) -> str:
    return (f"{path} {what}; restore it from a copy, or move it away to start a new run in {path.parent} "
            f"(its cards are kept)")


def _sqlite_problem(path: Path, e: sqlite3.Error) -> str:
    text = str(e)
    if "locked" in text or "busy" in text:
        return (f"{path} is locked by {_lock_holder(path)}; waited {LOCK_WAIT_S:g} s. Let it finish or stop it, "
                f"then retry")
    if "disk is full" in text:
        return f"no space left to write {path} ({text}): free some space, then resume the run"
    if "readonly" in text or "unable to open" in text:
        return f"cannot open {path} for what kforge needs ({text}): check its permissions and its directory's"
    if isinstance(e, sqlite3.DatabaseError) and not isinstance(e, sqlite3.OperationalError):
        return _broken(path, f"is damaged or not a kforge search log (SQLite: {text})")
    return f"{path}: SQLite failed: {text}"


def _create(path: Path) -> None:
    """A new log with its schema, built beside the final name and linked into place, so a log
    file that exists is always complete (an empty one is damage, never a log being made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        conn = sqlite3.connect(str(tmp))
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            with conn:
                conn.executescript(SCHEMA)
                conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        finally:
            conn.close()
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process created it first: that one is used
    finally:
        tmp.unlink(missing_ok=True)


def _check_file(path: Path) -> None:
    """Not empty, an SQLite file, and (unless a WAL holds newer pages) as long as its header says."""
    with open(path, "rb") as f:
        header = f.read(100)
    size = path.stat().st_size
    if not header:
        raise LogError(_broken(path, "is empty (0 bytes): its content was lost"))
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        raise LogError(_broken(path, "is not an SQLite file (garbage, or replaced by another file)"))
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    valid = header[92:96] == header[24:28]  # SQLite's own rule for trusting the in-header size
    wal = path.with_name(path.name + "-wal")
    if valid and size < pages * page_size and not (wal.exists() and wal.stat().st_size):
        raise LogError(_broken(path, f"is truncated ({size} of {pages * page_size} bytes)"))


@functools.cache
def _expected_columns() -> dict[str, list[str]]:
    """table -> columns, from SCHEMA itself (one definition of the schema)."""
    mem = sqlite3.connect(":memory:")
    try:
        mem.executescript(SCHEMA)
        return _columns(mem)
    finally:
        mem.close()


def _columns(conn: sqlite3.Connection) -> dict[str, list[str]]:
    rows = conn.execute("SELECT m.name, p.name FROM sqlite_master m JOIN pragma_table_info(m.name) p "
                        "WHERE m.type = 'table' ORDER BY m.name, p.cid").fetchall()
    out: dict[str, list[str]] = {}
    for table, column in rows:
        out.setdefault(table, []).append(column)
    return out


def _added_after(version: int) -> dict[str, list[tuple[str, str]]]:
    """table -> (column, type) that schema versions after `version` added."""
    out: dict[str, list[tuple[str, str]]] = {}
    for v in range(version + 1, SCHEMA_VERSION + 1):
        for table, column, kind in MIGRATIONS.get(v, ()):
            out.setdefault(table, []).append((column, kind))
    return out


def _check_schema(conn: sqlite3.Connection, path: Path) -> int:
    """The log's schema version (SCHEMA_VERSION or an older one MIGRATIONS upgrades), after
    checking it has every table and column of that version."""
    found, expected = _columns(conn), _expected_columns()
    if not found.keys() & expected.keys():
        raise LogError(_broken(path, f"is an SQLite file but not a kforge search log (its tables: "
                                     f"{', '.join(found) or 'none'})"))
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() if "meta" in found else None
    version = row[0] if row else None
    if version is not None and str(version).isdigit() and int(version) > SCHEMA_VERSION:  # before its tables
        raise LogError(f"{path} was written by a newer kforge (log schema {version}); upgrade kforge to read it")
    known = version is not None and str(version).isdigit() and 1 <= int(version) <= SCHEMA_VERSION
    later = _added_after(int(version)) if known else {}
    for table, columns in expected.items():
        if table not in found:
            raise LogError(_broken(path, f"has no {table} table: it is not a complete kforge search log"))
        newer = {c for c, _ in later.get(table, ())}
        missing = [c for c in columns if c not in found[table] and c not in newer]
        if missing:
            raise LogError(_broken(path, f"lacks column(s) {', '.join(missing)} of table {table}: it was written "
                                         f"by another kforge version or edited"))
    if not known:
        raise LogError(_broken(path, f"has log schema version {version!r}, not 1 to {SCHEMA_VERSION}"))
    return int(version)


def _upgrade(conn: sqlite3.Connection, version: int, readonly: bool) -> None:
    """Bring a log of an older schema version to this one: a writer adds the columns for good,
    a reader shadows each table with a temporary view that adds them as NULL."""
    later = _added_after(version)
    if not later:
        return
    if readonly:
        for table, columns in later.items():
            added = ", ".join(f"NULL AS {c}" for c, _ in columns)
            conn.execute(f"CREATE TEMP VIEW {table} AS SELECT *, {added} FROM main.{table}")
        return
    with conn:
        conn.execute("BEGIN IMMEDIATE")  # two writers opening one old log: the second sees it upgraded
        (now,) = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        for table, columns in _added_after(int(now)).items():
            for column, kind in columns:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


def _check_json(conn: sqlite3.Connection, path: Path, tables: list[str]) -> None:
    for table in tables:
        columns = JSON_COLUMNS[table]
        key = "id" if table != "cards" else "card_id"
        for row in conn.execute(f"SELECT {key}, {', '.join(columns)} FROM {table}"):
            for column, kind in columns.items():
                try:
                    ok = isinstance(json.loads(row[column]), kind)
                except (TypeError, ValueError):
                    ok = False
                if not ok:
                    what = "object" if kind is dict else "array"
                    raise LogError(_broken(path, f"has a {table}.{column} that is not a JSON {what} "
                                                 f"({key} {row[0]}): it was damaged or edited"))


def _lock_holder(path: Path) -> str:
    """Who holds the log: 'kforge process 123', 'process 123 (sqlite3)' or 'another process'.
    Asked of the kernel (fcntl F_GETLK) on the lock bytes SQLite uses: the WAL write lock in
    the -shm file, then the database file's lock range (an exclusive-mode holder)."""
    for file, start, length in ((path.with_name(path.name + "-shm"), 120, 1), (path, 0x40000000, 512)):
        pid = _posix_lock_pid(file, start, length)
        if pid:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                return f"process {pid}"
            if any(b"kforge" in a for a in argv):
                return f"kforge process {pid}"
            return f"process {pid} ({Path(argv[0].decode(errors='replace')).name})"
    return "another process"


def _posix_lock_pid(file: Path, start: int, length: int) -> int | None:
    if sys.platform != "linux":  # struct flock below is Linux's (64-bit off_t)
        return None
    import fcntl

    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return None
    try:
        query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
        l_type, _, _, _, pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, query))
    except OSError:
        return None
    finally:
        os.close(fd)
    return pid if l_type != fcntl.F_UNLCK else None


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
