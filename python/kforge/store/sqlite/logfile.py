"""The search log's file: its schema (SCHEMA, SCHEMA_VERSION, MIGRATIONS), opening it checked
(version, tables, columns, JSON columns; an older schema upgraded, anything else refused in one
line), and who holds its lock. `SQLiteStore` (this package) reads and writes through it."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import sqlite3
import struct
import sys
from pathlib import Path
from typing import Iterator

from ...errors import LogError

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
