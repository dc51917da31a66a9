"""Fault injection on the search log and on bad input: every damaged, replaced or locked log
is a one-line error from `kforge inspect`, a resume and the dashboard (and is never written
to); Ctrl-C with several workers loses no evaluated candidate; bad model files, run
directories, ports and devices are one-line errors before any work. All on the CPU."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from fakes import FakeEvaluator, FakeProposer, candidate, toy_card

from kforge import cuda, runner
from kforge.card_files import save_card
from kforge.cli import main
from kforge.store import LOG_NAME, SQLiteStore, connect
from kforge.store import sqlite as store_sqlite
from kforge.verdict import EvalResult, Verdict


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # an error line is never wrapped into two


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with one card and an interrupted run of three candidates."""
    d = tmp_path / "run"
    card = toy_card()
    save_card(card, d)
    slog = SQLiteStore(d)
    slog.start_run("r1", model="Toy", config={"iterations": 3})
    slog.upsert_card("r1", card)
    for unroll in (1, 2, 4):
        slog.add_candidate("r1", card.id, candidate({"threads": 256, "vec": 2, "unroll": unroll}),
                           EvalResult(Verdict.VALID, eager_us=7.0, kernel_us=3.0), parent_id=None, iteration=unroll)
    slog.set_run_status("r1", "interrupted")
    slog.close()
    return d


def _sql(path, *statements):
    conn = sqlite3.connect(path)
    for s in statements:
        conn.execute(s)
    conn.commit()
    conn.close()


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _replace(p):
    p.unlink()
    _sql(p, "CREATE TABLE notes (text TEXT)", "INSERT INTO notes VALUES ('my own database')")


ATTACKS = {
    "truncated": (_truncate, "is truncated"),
    "garbage": (lambda p: p.write_bytes(random.Random(0).randbytes(8192)), "is not an SQLite file"),
    "replaced": (_replace, "is an SQLite file but not a kforge search log (its tables: notes)"),
    "empty": (lambda p: p.write_bytes(b""), "is empty"),
    "no candidates table": (lambda p: _sql(p, "DROP TABLE candidates"), "has no candidates table"),
    "bad config_json": (lambda p: _sql(p, "UPDATE runs SET config_json='{not json'"),
                        "runs.config_json that is not a JSON object"),
}


def _one_line_error(capsys, rc):
    """The one `error:` line on stderr (progress lines may come before it), no traceback."""
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    return line


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_damaged_log_is_one_line_from_inspect_resume_and_search_and_is_left_alone(run_dir, capsys, attack):
    damage, says = ATTACKS[attack]
    path = run_dir / LOG_NAME
    damage(path)
    before = path.read_bytes()
    assert says in _one_line_error(capsys, main(["inspect", str(run_dir)]))
    for argv in (["run", "--resume", "--run-dir", str(run_dir), "--no-progress"],
                 ["search", str(run_dir), "--no-progress"]):
        err = _one_line_error(capsys, main(argv))
        assert says in err and "move it away to start a new run" in err
        assert path.read_bytes() == before  # refused, not started over nor repaired


@pytest.mark.parametrize("attack", ATTACKS)
def test_the_dashboard_lists_a_damaged_log_with_its_error(run_dir, attack):
    pytest.importorskip("dash")
    from conftest_dash import import_dash_app

    import_dash_app()
    from dash_app.app import create_app

    damage, says = ATTACKS[attack]
    damage(run_dir / LOG_NAME)
    app = create_app([run_dir], ttl_s=0)
    client = app.server.test_client()
    assert client.get("/").status_code == 200
    reply = client.post("/_dash-update-component", json={
        "output": "..runs-table.data...runs-note.children..",
        "outputs": [{"id": "runs-table", "property": "data"}, {"id": "runs-note", "property": "children"}],
        "inputs": [{"id": "runs-poll", "property": "n_intervals", "value": 0}],
        "changedPropIds": ["runs-poll.n_intervals"], "state": []})
    assert reply.status_code == 200
    (row,) = reply.get_json()["response"]["runs-table"]["data"]
    assert row["status"] == "unreadable" and says in row["problem"] and str(run_dir) in row["run"]


def test_a_candidate_row_that_is_not_json_stops_the_resume_but_not_inspect(run_dir, capsys):
    _sql(run_dir / LOG_NAME, "UPDATE candidates SET plan_json='[1' WHERE id=2")
    assert main(["inspect", str(run_dir)]) == 0  # nothing it shows reads the plan
    capsys.readouterr()
    err = _one_line_error(capsys, main(["search", str(run_dir), "--no-progress"]))
    assert "candidates.plan_json that is not a JSON object (id 2)" in err


def test_what_kforge_writes_is_never_refused_nan_in_evidence_included(tmp_path):
    slog = SQLiteStore(tmp_path)
    slog.start_run("r")
    card = toy_card()
    slog.upsert_card("r", card)
    slog.add_candidate("r", card.id, candidate({"threads": 64, "vec": 1, "unroll": 1}),
                       EvalResult(Verdict.INCORRECT, "nan out", evidence={"max_abs_err": float("nan"),
                                                                          "ratio": float("inf")}),
                       parent_id=None, iteration=0)
    slog.close()
    SQLiteStore(tmp_path).close()  # the writer's full check parses every JSON column as kforge reads it
    assert list(tmp_path.glob(".*")) == []  # the log was made beside its name, and nothing is left there


def test_a_log_locked_by_another_process_is_waited_for_briefly_then_named(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(store_sqlite.logfile, "LOCK_WAIT_S", 0.5)
    with subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import sqlite3, sys, time
            conn = sqlite3.connect(sys.argv[1])
            conn.execute("BEGIN EXCLUSIVE")
            conn.execute("UPDATE runs SET model = 'held'")
            print("locked", flush=True)
            time.sleep(60)
        """), str(run_dir / LOG_NAME)], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout.readline().strip() == "locked"
            assert main(["inspect", str(run_dir)]) == 0  # a reader is never blocked by a writer
            capsys.readouterr()
            started = time.monotonic()
            err = _one_line_error(capsys, main(["search", str(run_dir), "--no-progress"]))
            assert time.monotonic() - started < 5
            assert f"is locked by process {holder.pid}" in err and "waited 0.5 s" in err
        finally:
            holder.kill()


class _Tally:
    """What the workers' evaluators did, seen from outside the runner (not through Thread,
    whose join() is what fails): candidates evaluated, evaluations in flight."""

    def __init__(self):
        self.lock = threading.Lock()
        self.evaluated: list[tuple[str, str]] = []
        self.in_flight = 0
        self.started = threading.Event()

    def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until no evaluation is in flight (a worker the run left behind finishes its own)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)


class _Recording(FakeEvaluator):
    """Counts a candidate as evaluated once its evaluation is over, which is when it must
    reach the log. GPU 0 is slow, so it is mid-candidate whenever the Ctrl-C comes."""

    def __init__(self, device, tally):
        super().__init__(sleep_s=0.1 if device == 0 else 0.002)
        self.tally = tally

    def evaluate(self, card, cand):
        with self.tally.lock:
            self.tally.in_flight += 1
        try:
            return super().evaluate(card, cand)
        finally:
            with self.tally.lock:
                self.tally.in_flight -= 1
                self.tally.evaluated.append((card.id, cand.digest()))
            self.tally.started.set()


@pytest.fixture(autouse=True)
def _terminal_sigint():
    """Ctrl-C as a terminal's Python sees it (KeyboardInterrupt), whatever SIGINT disposition
    the process has. In two full-suite runs the Ctrl-C below was lost (a run went to its end, the
    next hung), as it is with SIGINT ignored; which earlier test causes it is not known: none
    changes Python's handler (checked after every test), and ray.init leaves the OS one as it was."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _ctrl_c(started: threading.Event, delay: float) -> None:
    """SIGINT to the main thread, as a terminal's Ctrl-C: once the workers are searching, it
    lands while the runner waits for them."""
    started.wait(10)
    time.sleep(delay)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def test_ctrl_c_with_two_workers_loses_no_evaluated_candidate(tmp_path, monkeypatch):
    """Lost: evaluated but not in the log when the run returned; a candidate still being
    evaluated then counts too, since the process exits right after (kforge's CLI does)."""
    rng = random.Random(19)
    monkeypatch.setattr(runner, "gpu_devices", lambda requested: [0, 1])
    lost = []
    for trial in range(20):
        d = tmp_path / f"run{trial}"
        for n in range(4):
            save_card(toy_card(n=1024 + n, share=0.25), d)
        tally = _Tally()
        monkeypatch.setattr(runner, "default_evaluator", lambda run_dir, device: _Recording(device, tally))
        interrupter = threading.Thread(target=_ctrl_c, args=(tally.started, rng.uniform(0.0, 0.05)))
        interrupter.start()
        with pytest.raises(runner.RunInterrupted):
            runner.search_run(d, proposer=FakeProposer, iterations=1000, progress=False)
        conn = connect(d, readonly=True)
        logged = {(r[0], r[1]) for r in conn.execute("SELECT card_id, digest FROM candidates")}
        conn.close()
        interrupter.join()
        tally.settle()
        lost.append(len(set(tally.evaluated) - logged))
    assert lost == [0] * 20


def test_a_second_ctrl_c_stops_waiting_and_marks_the_candidate_in_flight_lost(tmp_path, monkeypatch):
    release = threading.Event()
    started = threading.Event()

    class Stuck(FakeEvaluator):
        """GPU 0 never finishes its first candidate (until the test ends); GPU 1 is quick."""

        def __init__(self, device):
            super().__init__(sleep_s=0.002)
            self.device = device

        def evaluate(self, card, cand):
            started.set()
            if self.device == 0:
                release.wait(30)
            return super().evaluate(card, cand)

    save_card(toy_card(share=0.5), tmp_path / "run")
    save_card(toy_card(n=4096, share=0.5), tmp_path / "run")
    monkeypatch.setattr(runner, "gpu_devices", lambda requested: [0, 1])
    monkeypatch.setattr(runner, "default_evaluator", lambda run_dir, device: Stuck(device))

    def ctrl_c_twice():
        _ctrl_c(started, 0.05)
        time.sleep(0.2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    interrupter = threading.Thread(target=ctrl_c_twice)
    interrupter.start()
    try:
        started_at = time.monotonic()
        with pytest.raises(runner.RunInterrupted):
            runner.search_run(tmp_path / "run", proposer=FakeProposer, iterations=1000, progress=False)
        assert time.monotonic() - started_at < 5
        conn = connect(tmp_path / "run", readonly=True)
        (lost,) = conn.execute("SELECT card_id, message FROM events WHERE kind='lost'").fetchall()
        (busy,) = conn.execute("SELECT card_id FROM cards WHERE card_id NOT IN "
                               "(SELECT card_id FROM candidates)").fetchall()
        conn.close()
        assert lost[0] == busy[0] and "worker on GPU 0" in lost[1] and "not in the log" in lost[1]
    finally:
        release.set()
        interrupter.join()


MODEL = """
import torch

def get_model():
    {body}

def get_inputs():
    return (torch.randn(4, 8),)
"""


def _model(tmp_path, body):
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(body=body))
    return path


def test_get_model_returning_a_function_is_one_line(tmp_path, capsys):
    spec = _model(tmp_path, "return lambda x: x.relu()")
    err = _one_line_error(capsys, main(["capture", str(spec), "--run-dir", str(tmp_path / "run")]))
    assert "get_model() returned a function, not a torch.nn.Module" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where, says", [
    ("proc", "cannot write run directory"),
    ("under a file", "which is a file"),
])
def test_a_run_dir_that_cannot_be_written_is_refused_before_the_model_is_built(tmp_path, capsys, where, says):
    if where == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    (tmp_path / "a-file").write_text("")
    run_dir = "/proc/kforge-run" if where == "proc" else str(tmp_path / "a-file" / "run")
    spec = _model(tmp_path, "raise RuntimeError('the model was built before the run directory was checked')")
    for command in ("capture", "run"):
        err = _one_line_error(capsys, main([command, str(spec), "--run-dir", run_dir]))
        assert says in err and run_dir in err


def test_a_port_out_of_range_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["dash", "--port", "99999"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "from 1 to 65535, like 8050 (got '99999')" in err and "Traceback" not in err


def test_devices_without_a_gpu_are_an_error_before_the_capture(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cuda, "available", lambda: False)
    spec = _model(tmp_path, "return torch.nn.ReLU()")
    err = _one_line_error(capsys, main(["run", str(spec), "--run-dir", str(tmp_path / "run"), "--devices", "7"]))
    assert "GPU 7 asked for (--devices), but no CUDA GPU is usable here" in err
    assert not (tmp_path / "run").exists()
