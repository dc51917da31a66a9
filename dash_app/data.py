"""Read-only queries over search logs and .cast packages, for the dashboard.

The dashboard never writes: every query opens its log as a read-only `kforge.store.SQLiteStore`
and closes it again, so a search writing the same file (WAL) is never blocked and a log
that appears while the dashboard runs is picked up. Results are cached for `ttl_s`
(about the polling period of the live views), so many browser tabs polling the same run
cost one query per period. Cached values are shared: callers must not mutate them.

A path given to `Catalog` may be a run dir holding `search.sqlite`, the SQLite file itself,
a folder whose immediate subfolders are run dirs (`kforge dash runs/`), or a .cast package
(matched to its run by the manifest's run_id; packages in or next to a run dir are found
without being named). A run dir that `kforge capture` wrote and nothing searched yet (cards
and capture.json, no log) is shown as a run of status "captured", named after its folder:
its cards go, with SQLiteStore, into a log in the catalog's own scratch folder (never into the
run dir), so every page reads it like any other run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import statistics
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

from kforge.errors import KforgeError, LogError, PackageError
from kforge.store import LOG_NAME, CardRecord, LLMUsage, SQLiteStore
from kforge.manifest import read_manifest

from .rows import (CORRECT, NOT_FAILED, estimated_speedup, failure_kind, first_line, flatten, loads, manifest_row,
                   pct_of_floor, proposer_of_call, record_dict, scrubbed)

TTL_S = 1.5

CAPTURED = "captured"  # the status of a run dir that holds cards and no search log
CAPTURE_FILE = "capture.json"


class NotFound(LookupError):
    """A run, card or candidate the URL names is not in any log the dashboard reads."""


def _ttl(method: Callable) -> Callable:
    """Cache a Catalog method's result per argument tuple for the catalog's TTL."""

    @functools.wraps(method)
    def wrapper(self: "Catalog", *args: Any) -> Any:
        return self._cached((method.__name__, args), lambda: method(self, *args))

    return wrapper


class Catalog:
    """The search logs and packages behind one dashboard."""

    def __init__(self, run_dirs: Iterable[str | Path], ttl_s: float = TTL_S):
        self.roots = [Path(p).expanduser().resolve() for p in run_dirs]
        self.ttl_s = ttl_s
        self._cache: dict[tuple, tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self._scratch: Path | None = None  # logs of capture-only run dirs, removed with the catalog
        self._capture_lock = threading.Lock()

    def _cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        value = compute()
        with self._lock:
            self._cache[key] = (now, value)
        return value

    # ---- where the logs are ----------------------------------------------------------
    def log_paths(self) -> list[Path]:
        paths: list[Path] = []
        for root in self.roots:
            if root.suffix == ".cast":
                continue  # a package, matched to its run by package()
            if root.is_file():
                paths.append(root)
            elif (root / LOG_NAME).is_file():
                paths.append(root / LOG_NAME)
            elif root.is_dir():
                paths += sorted(root.glob(f"*/{LOG_NAME}"))
        return paths

    def capture_dirs(self) -> list[Path]:
        """Run dirs that `kforge capture` wrote and no search has logged into yet."""
        dirs: list[Path] = []
        for root in self.roots:
            if not root.is_dir() or (root / LOG_NAME).exists():
                continue
            dirs += [root] if (root / CAPTURE_FILE).is_file() else [
                p.parent for p in sorted(root.glob(f"*/{CAPTURE_FILE}")) if not (p.parent / LOG_NAME).exists()]
        return dirs

    def _capture_log(self, run_dir: Path) -> Path:
        """A log of the captured cards of `run_dir` (status "captured"), in the scratch folder;
        written again when the capture is."""
        stamp = (run_dir / CAPTURE_FILE).stat().st_mtime_ns
        with self._lock:
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="kforge-dash-"))
                weakref.finalize(self, shutil.rmtree, self._scratch, True)
        where = self._scratch / f"{abs(hash(str(run_dir))):x}-{stamp}"
        with self._capture_lock:  # one writer, so no request reads a half-written log
            if (where / LOG_NAME).is_file():
                return where / LOG_NAME
            self._write_capture_log(run_dir, where)
        return where / LOG_NAME

    @staticmethod
    def _write_capture_log(run_dir: Path, where: Path) -> None:
        from kforge.cardtable import skip_reason
        from kforge.card_files import load_cards

        info = loads((run_dir / CAPTURE_FILE).read_text(), {})
        cards = load_cards(run_dir)
        with SQLiteStore(where) as log:
            log.start_run(run_dir.name, config={"captured_only": True, "run_dir": str(run_dir)},
                          device=info.get("device"), arch=cards[0].arch if cards else None)
            for card in cards:
                log.upsert_card(run_dir.name, card)
                why = skip_reason(card)
                if why:
                    log.set_card_status(run_dir.name, card.id, "skipped", why)
            log.set_run_status(run_dir.name, CAPTURED)

    @_ttl
    def _scan(self) -> tuple[dict[str, Path], dict[Path, str]]:
        """(run id -> its log, unreadable log -> why). A run id seen in two logs is read from
        the first one given."""
        index: dict[str, Path] = {}
        unreadable: dict[Path, str] = {}
        for path in self.log_paths():
            try:
                for run in self._read(path, lambda log: log.runs()):
                    index.setdefault(run.id, path)
            except NotFound as e:  # listed with its error on the runs page, never hidden
                unreadable[path] = str(e)
        for run_dir in self.capture_dirs():
            try:
                index.setdefault(run_dir.name, self._capture_log(run_dir))
            except (OSError, ValueError, KforgeError):  # a capture being written, or a broken card
                continue
        return index, unreadable

    def _run_index(self) -> dict[str, Path]:
        return self._scan()[0]

    def _log_of(self, run_id: str) -> Path:
        path = self._run_index().get(run_id)
        if path is None:
            raise NotFound(f"no run {run_id!r} in {', '.join(map(str, self.roots)) or 'the given run dirs'}; "
                           f"pick one on the runs page")
        return path

    @staticmethod
    def _read(path: Path, query: Callable[[SQLiteStore], Any]) -> Any:
        """What `query` reads from the log at `path`, opened read-only for it alone."""
        try:
            with SQLiteStore(path, readonly=True) as log:
                return query(log)
        except LogError as e:
            raise NotFound(str(e)) from e

    def _q(self, run_id: str, query: Callable[[SQLiteStore], Any]) -> Any:
        return self._read(self._log_of(run_id), query)

    # ---- runs ----------------------------------------------------------------------
    @_ttl
    def runs(self) -> list[dict]:
        """Every run, newest first, with what the overview shows."""
        return self._overview()[0]

    def unreadable(self) -> list[dict]:
        """The logs that cannot be read, newest first: each its `log`, `error` and `created` (mtime)."""
        return self._overview()[1]

    @_ttl
    def _overview(self) -> tuple[list[dict], list[dict]]:
        index, unreadable = self._scan()
        broken = [{"log": str(path), "error": error, "created": _mtime(path)} for path, error in unreadable.items()]
        out = []
        for run_id, path in index.items():
            try:
                run, spend, (n, last) = self._read(path, lambda log: (
                    record_dict(log.run(run_id)), sum(log.llm_usage(run_id).values(), LLMUsage()), log.activity(run_id)))
                cards = self.cards(run_id)
            except NotFound as e:  # damaged past what opening it checks
                broken.append({"log": str(path), "error": str(e), "created": _mtime(path)})
                continue
            winners = sorted((c for c in cards if c["best_speedup"]), key=lambda c: -c["best_speedup"])
            config = run["config"]
            kind = (CAPTURED if run["status"] == CAPTURED else "search" if config.get("validated", True)
                    else "compile-only")
            run_dir = Path(config.get("run_dir") or path.parent)
            out.append({
                "kind": kind, "run_dir": str(run_dir), "next": _next_step(kind, run_dir),
                "id": run_id, "model": run["model"] or "", "status": run["status"], "device": run["device"] or "",
                "arch": run["arch"] or "", "torch": run["torch"] or "", "kforge": run["kforge"] or "",
                "created": run["created"], "updated": last or run["created"],
                "cards": len(cards), "searched": sum(c["status"] not in ("pending", "skipped") for c in cards),
                "done": sum(c["status"] == "done" for c in cards), "candidates": n,
                "best": [(c["op_name"], c["best_speedup"]) for c in winners[:3]],
                "est_speedup": estimated_speedup(cards),
                "cost_usd": spend.cost_usd, "llm_calls": spend.calls, "tokens": spend.tokens,
                "log": str(path),
            })
        return sorted(out, key=lambda r: -r["created"]), sorted(broken, key=lambda r: -r["created"])

    def run(self, run_id: str) -> dict:
        for r in self.runs():
            if r["id"] == run_id:
                return r
        raise NotFound(f"no run {run_id!r}; pick one on the runs page")

    def compare(self, a: str, b: str) -> list[dict]:
        """Two runs' cards side by side, matched by op and argument summary (card ids differ
        between devices), largest share in either run first."""
        def keyed(run_id: str) -> dict[tuple[str, int], dict]:
            seen: dict[str, int] = {}
            out = {}
            for c in self.cards(run_id):
                n = seen[c["summary"]] = seen.get(c["summary"], -1) + 1
                out[(c["summary"], n)] = c
            return out

        ca, cb = keyed(a), keyed(b)
        rows = []
        for key in dict.fromkeys([*ca, *cb]):
            x, y = ca.get(key, {}), cb.get(key, {})
            rows.append({"summary": key[0], "card_a": x.get("card_id"), "card_b": y.get("card_id"),
                         **{f"{k}_{side}": c.get(k) for side, c in (("a", x), ("b", y))
                            for k in ("share", "status", "eager_us", "best_us", "best_speedup")}})
        return sorted(rows, key=lambda r: -max(r["share_a"] or 0, r["share_b"] or 0))

    @_ttl
    def run_config(self, run_id: str) -> dict:
        return scrubbed(self._q(run_id, lambda log: log.run(run_id)).config)

    # ---- cards ---------------------------------------------------------------------
    _CARD_KEYS = ("card_id", "op", "family", "summary", "calls", "eager_us", "share", "status", "skip_reason",
                  "best_candidate", "best_speedup", "iterations", "floor_us", "best_us", "cost_usd")

    @classmethod
    def _card_of(cls, record: CardRecord) -> dict:
        row = record_dict(record, *cls._CARD_KEYS)
        row.update(top_calls=record.card.get("top_calls"), n_candidates=record.candidates,
                   n_valid=record.verdicts.get("valid", 0))
        return row

    @staticmethod
    def _card_row(row: dict) -> dict:
        row["op_name"] = row["op"].removeprefix("aten::").removesuffix(".default")
        # Floor % = how close to the HBM floor a latency is (100 % = moves its bytes at copy bandwidth).
        row["eager_floor_pct"] = pct_of_floor(row["floor_us"], row["eager_us"])
        row["best_floor_pct"] = pct_of_floor(row["floor_us"], row["best_us"])
        return row

    def _timed(self, run_id: str) -> bool:
        """Whether a GPU timed this run. Without one the search still sets an HBM floor, of the
        GPU it compiled for; the run's own device has none, so none is shown."""
        return bool(self.run_config(run_id).get("validated", True)) and not self.run_config(run_id).get("captured_only")

    def _card_rows(self, run_id: str, rows: list[dict]) -> list[dict]:
        if not self._timed(run_id):
            for r in rows:
                r["floor_us"] = None
        return [self._card_row(r) for r in rows]

    @_ttl
    def cards(self, run_id: str) -> list[dict]:
        """Cards of a run ranked by share of runtime."""
        return self._card_rows(run_id, [self._card_of(c) for c in self._q(run_id, lambda log: log.cards(run_id))])

    @_ttl
    def card(self, run_id: str, card_id: str) -> dict:
        record = self._q(run_id, lambda log: log.card(run_id, card_id))
        if record is None:
            raise NotFound(f"run {run_id!r} has no card {card_id!r}; pick one on the run's cards page")
        (row,) = self._card_rows(run_id, [self._card_of(record)])
        card = scrubbed(record.card)
        row["module_paths"] = card.get("module_paths", [])
        row["arch"] = card.get("arch", "")
        return row

    # ---- candidates ----------------------------------------------------------------
    _LIST_KEYS = ("id", "card_id", "parent_id", "repair_of", "iteration", "created", "proposer", "kind", "verdict",
                  "message", "eager_us", "kernel_us", "dispatched_us", "speedup", "reward", "max_abs_err", "max_rel_err",
                  "eval_s", "flags")

    @_ttl
    def candidates(self, run_id: str, card_id: str) -> list[dict]:
        """Every candidate of a card in the order it was evaluated (no sources: they are large)."""
        rows = [record_dict(c, *self._LIST_KEYS) for c in self._q(run_id, lambda log: log.candidates(run_id, card_id,
                                                                                                  bodies=False))]
        for r in rows:
            r["summary"] = first_line(r["message"])
        return rows

    @_ttl
    def candidate(self, run_id: str, cand_id: int) -> dict:
        """One candidate with its parsed plan, knobs, evidence and the source it was derived from.

        The diff base is the candidate it repairs if it is a repair, else its tree parent."""
        record = self._q(run_id, lambda log: log.candidate(run_id, cand_id))
        if record is None:
            raise NotFound(f"run {run_id!r} has no candidate #{cand_id}; pick one on its card's page")
        c = record_dict(record)
        base_id = c["repair_of"] if c["repair_of"] is not None else c["parent_id"]
        c["base_id"], c["base_source"] = base_id, None
        if base_id is not None:
            base = self._q(run_id, lambda log: log.candidate(run_id, base_id))
            c["base_source"] = scrubbed(base.source) if base else None
        return c

    def tree_edges(self, run_id: str, card_id: str) -> list[dict]:
        """Edges of the search tree: `source` None is the root (eager). A repair hangs off the
        failed candidate it repairs, so repair chains read top to bottom."""
        edges = []
        for c in self.candidates(run_id, card_id):
            if c["repair_of"] is not None:
                edges.append({"source": c["repair_of"], "target": c["id"], "kind": "repair"})
            else:
                edges.append({"source": c["parent_id"], "target": c["id"], "kind": "child"})
        return edges

    def latency_history(self, run_id: str, card_id: str) -> list[dict]:
        """Per evaluated candidate, in order: its latency and the best correct latency so far."""
        best = math.inf
        out = []
        for c in self.candidates(run_id, card_id):
            if c["verdict"] in CORRECT and c["kernel_us"]:
                best = min(best, c["kernel_us"])
            out.append({"id": c["id"], "iteration": c["iteration"], "verdict": c["verdict"],
                        "kernel_us": c["kernel_us"], "best_us": best if math.isfinite(best) else None})
        return out

    @_ttl
    def timeline(self, run_id: str) -> list[dict]:
        """Every candidate of the run in the order it was evaluated: card, time, verdict, speedup."""
        rows = self._q(run_id, lambda log: log.candidates(run_id, bodies=False))
        return [record_dict(c, "id", "card_id", "created", "verdict", "speedup")
                for c in sorted(rows, key=lambda c: (c.created, c.id))]

    # ---- failures, events, providers ------------------------------------------------------
    @_ttl
    def failures(self, run_id: str) -> list[dict]:
        """Failed candidates grouped by verdict and the first line of their message, biggest group first."""
        summaries = self._summaries(run_id)
        rows = [dict(record_dict(c, "id", "card_id", "verdict", "message"), summary=summaries.get(c.card_id))
                for c in self._q(run_id, lambda log: log.candidates(run_id, bodies=False))
                if c.verdict not in NOT_FAILED]
        groups: dict[tuple[str, str], dict] = {}
        for r in rows:
            key = (r["verdict"], failure_kind(r["message"]))
            g = groups.setdefault(key, {"verdict": key[0], "kind": key[1], "example": first_line(r["message"]),
                                        "count": 0, "cards": {}, "candidates": []})
            g["count"] += 1
            g["cards"].setdefault(r["card_id"], r["summary"] or r["card_id"])
            g["candidates"].append((r["card_id"], r["id"]))
        return sorted(groups.values(), key=lambda g: (-g["count"], g["verdict"], g["kind"]))

    @_ttl
    def proposer_errors(self, run_id: str) -> list[dict]:
        """What the proposer failed to deliver (an unreachable endpoint, replies without a usable
        kernel: the search's "proposer_error" events), grouped like failures, biggest first."""
        summaries = self._summaries(run_id)
        rows = [dict(record_dict(e, "card_id", "message"), summary=summaries.get(e.card_id))
                for e in self._q(run_id, lambda log: log.events(run_id, "proposer_error"))]
        groups: dict[str, dict] = {}
        for r in rows:
            kind = failure_kind(r["message"])
            g = groups.setdefault(kind, {"kind": kind, "example": first_line(r["message"]), "count": 0, "cards": {}})
            g["count"] += 1
            if r["card_id"]:
                g["cards"].setdefault(r["card_id"], r["summary"] or r["card_id"])
        return sorted(groups.values(), key=lambda g: (-g["count"], g["kind"]))

    def _summaries(self, run_id: str) -> dict[str, str]:
        """card id -> its summary (what a failure or an error is shown under)."""
        return {c["card_id"]: c["summary"] for c in self.cards(run_id)}

    @_ttl
    def events(self, run_id: str, limit: int = 30) -> list[dict]:
        return [record_dict(e, "created", "level", "kind", "card_id", "message")
                for e in self._q(run_id, lambda log: log.events(run_id, newest=limit))]

    @_ttl
    def providers(self, run_id: str) -> list[dict]:
        """Each proposer (builtin, llm:<model>) compared: outcomes, speedups, cards won, LLM spend."""
        cands, usage = self._q(run_id, lambda log: (
            [record_dict(c, "card_id", "id", "proposer", "verdict", "speedup") for c in log.candidates(run_id, bodies=False)],
            log.llm_usage(run_id)))
        winners = {r["best_candidate"] for r in self.cards(run_id) if r["best_candidate"] is not None}
        totals: dict[str, LLMUsage] = {}
        for model, u in usage.items():
            totals[proposer_of_call(model)] = totals.get(proposer_of_call(model), LLMUsage()) + u
        spend = {p: dataclasses.asdict(u) for p, u in totals.items()}
        by: dict[str, list[dict]] = {}
        for c in cands:
            by.setdefault(c["proposer"], []).append(c)
        for proposer in spend:  # a model whose calls produced nothing parseable still cost money
            by.setdefault(proposer, [])
        out = []
        for proposer, cs in by.items():
            speedups = [c["speedup"] for c in cs if c["verdict"] == "valid" and c["speedup"]]
            valid, slower = len(speedups), sum(c["verdict"] == "slower" for c in cs)
            failed = len(cs) - valid - slower
            s = spend.get(proposer, {})
            cost = s.get("cost_usd", 0.0)
            out.append({
                "proposer": proposer, "candidates": len(cs), "valid": valid, "slower": slower, "failed": failed,
                "failure_rate": failed / len(cs) if cs else None,
                "best_speedup": max(speedups, default=None),
                "median_speedup": statistics.median(speedups) if speedups else None,
                "cards_won": sum(c["id"] in winners for c in cs),
                "llm_calls": s.get("calls", 0), "failed_calls": s.get("failed_calls", 0) or 0,
                "tokens": s.get("tokens", 0), "cost_usd": cost,
                "cost_per_valid": cost / valid if valid and cost else None,
            })
        return sorted(out, key=lambda r: (r["proposer"] != "builtin", r["proposer"]))

    # ---- packages ---------------------------------------------------------------------
    def _package_files(self, run_id: str) -> list[Path]:
        """Where a run's .cast may be, most likely first: .cast files given to the catalog, the
        `out` of the run's config, then *.cast in the run dir and next to it (newest first)."""
        run_dir = self._log_of(run_id).parent
        given = [r for r in self.roots if r.suffix == ".cast"]
        out = self.run_config(run_id).get("out")
        configured = [(run_dir / Path(out).expanduser())] if isinstance(out, str) and out.endswith(".cast") else []
        nearby = sorted((p for d in (run_dir, run_dir.parent) for p in d.glob("*.cast")),
                        key=lambda p: -p.stat().st_mtime)
        return list(dict.fromkeys(p for p in given + configured + nearby if p.is_file()))

    @_ttl
    def package(self, run_id: str) -> dict:
        """The run's package manifest as rows (the first .cast found whose manifest names this
        run), or why there is none to show, and the run's model check (level and message) if
        it had one."""
        view: dict[str, Any] = {"path": None, "error": None, "header": {}, "cards": [], "model_check": None}
        # The run's model checks (kforge.modelcheck, logged by `kforge run` as "PACKAGE: message").
        checks = [record_dict(e, "level", "message")
                  for e in reversed(self._q(run_id, lambda log: log.events(run_id, "model-check")))]
        problems = []
        for path in self._package_files(run_id):
            try:  # within the loader's size limits, every field checked: a package is untrusted
                manifest = read_manifest(path).manifest
            except PackageError as e:
                problems.append(f"cannot read {path.name}: {e}")
                continue
            if manifest.get("run_id", run_id) != run_id:
                continue
            view["path"] = str(path)
            view["model_check"] = _model_check_of(checks, path)
            view["header"] = flatten(manifest, skip=("cards",))
            view["cards"] = [manifest_row(e) for e in manifest.get("cards", []) if isinstance(e, dict)]
            return view
        run = self.run(run_id)
        view["error"] = "; ".join(problems) or run["next"] or (
            f"no package for this run yet: `kforge package {run['run_dir']} --out model.cast` writes "
            "one (on the GPU that searched it); give its path to the dashboard if it is elsewhere")
        return view


def _next_step(kind: str, run_dir: Path) -> str:
    """What the user can do next with a run of this kind, in one sentence."""
    if kind == CAPTURED:
        return (f"captured only: nothing searched yet. Search it with `kforge search {run_dir}` on a machine with "
                "an NVIDIA GPU (without one, kforge compiles candidates but times nothing)")
    if kind == "compile-only":
        return (f"compile-only: nothing timed; run on a GPU. `kforge search {run_dir}` on a machine with an NVIDIA "
                "GPU validates and times kernels, then `kforge package` writes the winners")
    return ""


def _model_check_of(checks: list[dict], package: Path) -> dict | None:
    """The latest model check logged for this package file (level, message without the
    "RESOLVED_PATH: " prefix `kforge run` gives it), or None: a check of an earlier
    package of the run does not describe this one."""
    prefix = f"{package.resolve()}: "
    return next(({"level": c["level"], "message": c["message"][len(prefix):]} for c in checks
                 if c["message"].startswith(prefix)), None)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
