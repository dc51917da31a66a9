"""The Ray backend on a Ray cluster this module starts on this machine: a head without GPUs,
two nodes with two simulated GPUs each, and a node whose GPU is an sm_80 (a custom resource
makes it one, tests/ray_fakes.py). Evaluators are fakes with fixed latencies (sleeps, not CPU
work, so the timings hold on a loaded 2-core machine)."""

from __future__ import annotations

import functools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray backend's tests need ray: pip install 'kforge[ray]'")

import ray_fakes  # noqa: E402
import torch  # noqa: E402
from fakes import FakeProposer, candidate, toy_card  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from kforge import cli, runner  # noqa: E402
from kforge.card_files import save_card, save_sample  # noqa: E402
from kforge.cluster import nodes  # noqa: E402
from kforge.cluster.ray_pool import RayPool  # noqa: E402
from kforge.store import SQLiteStore  # noqa: E402

HERE = Path(__file__).parent
GOOD_GPUS = 4  # two nodes of two
LATENCY_S = 0.25
SECRET = "sk-kforge-test-never-sent-7f3a"


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:
        # Every Ray worker imports these tests' fakes (actors get them by reference).
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE.parent / "python"), str(HERE),
                                                              os.environ.get("PYTHONPATH")])))
        mp.setattr(nodes, "node_facts", ray_fakes.fake_facts)
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
        for _ in range(2):
            c.add_node(num_cpus=1, num_gpus=2)
        c.add_node(num_cpus=1, num_gpus=1, resources={"kforge_test_sm80": 1})
        ray.init(address=c.address, log_to_driver=False)
        mp.setenv("RAY_ADDRESS", c.address)
        try:
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


def make_run(run_dir: Path, count: int) -> list:
    """`count` cards with one stored sample each."""
    cards = []
    for i in range(count):
        card = replace(toy_card(eager_us=5.0 + i, n=256 * (i + 1)), samples=1)
        save_card(card, run_dir)
        x = torch.randn(256 * (i + 1))
        save_sample(card, run_dir, 0, [x], [torch.relu(x)])
        cards.append(card)
    return cards


KNOBS = [{"threads": t, "vec": v, "unroll": 1} for t in (64, 128, 256, 512) for v in (1, 2)]


class TestPool:
    """One pool for these tests, given back after them (its actors hold every GPU)."""

    @pytest.fixture(scope="class")
    def pool(self, cluster, tmp_path_factory):
        """A pool over the simulated cluster, with everything the driver hands Ray recorded."""
        run_dir = tmp_path_factory.mktemp("pool-run")
        cards = make_run(run_dir, 2)
        sent: list = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KFORGE_LLM_API_KEY", SECRET)  # what the driver holds; none of it may travel
            put, method, create = ray.put, ray.actor.ActorMethod._remote, ray.actor.ActorClass._remote

            def recording_put(value, *a, **kw):
                sent.append(value)
                return put(value, *a, **kw)

            def recording_method(self, args=None, kwargs=None, **options):
                sent.append((args, kwargs))
                return method(self, args, kwargs, **options)

            def recording_create(self, args=None, kwargs=None, **options):
                sent.append((args, kwargs, options.get("runtime_env")))
                return create(self, args, kwargs, **options)

            mp.setattr(ray, "put", recording_put)
            mp.setattr(ray.actor.ActorMethod, "_remote", recording_method)
            mp.setattr(ray.actor.ActorClass, "_remote", recording_create)
            p = RayPool("auto", "ray", run_dir, cards, functools.partial(ray_fakes.latency_evaluator, sleep_s=LATENCY_S))
            try:
                for slot in range(len(p.slots)):  # started: what is timed below is evaluation, not start-up
                    p.evaluator(slot).evaluate(cards[0], candidate(KNOBS[slot]))
                yield p, cards, sent
            finally:
                p.close()

    def test_one_actor_per_matching_gpu_and_the_mismatched_node_refused(self, pool):
        p, _, _ = pool
        assert len(p.slots) == GOOD_GPUS and len(p.actors) == GOOD_GPUS
        assert len({s.split("(")[1] for s in p.slots}) == 2  # two nodes
        (note,) = p.notes
        assert "refused: it has GPU arch sm_80 (the cards are for sm_90)" in note
        assert p.validated and p.hardware.arch == "sm_90" and p.config["cluster"] == "ray"

    @staticmethod
    def _throughput(p, cards, slots: int, per_slot: int) -> float:
        """Candidates per second with `slots` search threads, one per actor."""
        def work(slot: int) -> None:
            ev = p.evaluator(slot)
            for i in range(per_slot):
                ev.evaluate(cards[slot % len(cards)], candidate(KNOBS[i % len(KNOBS)], note=f"{slot}-{i}"))

        threads = [threading.Thread(target=work, args=(s,)) for s in range(slots)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return slots * per_slot / (time.monotonic() - t0)

    def test_four_actors_evaluate_at_least_3_2_times_as_fast_as_one(self, pool):
        p, cards, _ = pool
        one = self._throughput(p, cards, 1, 8)
        four = self._throughput(p, cards, GOOD_GPUS, 8)
        assert four >= 3.2 * one, f"{four:.2f}/s with four actors, {one:.2f}/s with one"
        assert one <= 1 / LATENCY_S  # the latency is the fake's: nothing was skipped

    def test_samples_travel_once_per_card_and_node(self, pool):
        p, cards, sent = pool
        bundles = [v for v in sent if isinstance(v, dict) and any(k.startswith("sample") for k in v)]
        assert len(bundles) == len({c.id for c in cards}) == len(p._samples)  # one object per card
        fetched: dict[str, list] = {}
        for stats in ray.get([a.stats.remote() for a in p.actors]):
            fetched.setdefault(stats["node_id"], []).extend(stats["fetched"])
        # Both cards were evaluated on both nodes above; each node fetched each card once.
        assert {n: sorted(f) for n, f in fetched.items()} == {n: sorted(c.id for c in cards) for n in fetched}
        assert len(fetched) == 2

    def test_the_api_key_is_in_nothing_sent_to_the_cluster(self, pool):
        _, cards, sent = pool
        payload = ray.cloudpickle.dumps(sent)
        assert cards[0].id.encode() in payload and b"extern" in payload  # cards and candidates were recorded...
        assert SECRET.encode() not in payload  # ...the key was not
        assert all(options is None for *_, options in (s for s in sent if isinstance(s, tuple) and len(s) == 3))


def test_doctor_reports_the_cluster_and_the_node_it_refuses(cluster, capsys):
    assert cli.main(["doctor", "--cluster", "ray", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["cluster"]
    rows = sorted(report["nodes"], key=lambda n: n["gpus"])
    assert [n["gpus"] for n in rows] == [0, 1, 2, 2]
    assert all(n["kforge"] and n["torch"] == torch.__version__ for n in rows)
    assert "GPU arch sm_80" in rows[1]["refused"] and rows[2]["refused"] is None is rows[3]["refused"]
    assert "refused" not in rows[0]  # the head has no GPU: not used, not refused
    assert cli.main(["doctor", "--cluster", "ray"]) == 0
    table = capsys.readouterr().out
    assert "Ray cluster at" in table and "no GPU: not used" in table
    assert table.count("refused: it has GPU arch sm_80") == 1


# The driver a test kills: a search over the simulated cluster, evaluations recorded.
DRIVER = """
import functools, sys
import ray_fakes
from fakes import FakeProposer
from kforge import runner
from kforge.cluster import nodes
nodes.node_facts = ray_fakes.fake_facts
run_dir, record, busy, iterations = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
runner.search_run(run_dir, proposer=FakeProposer, iterations=iterations, progress=False, cluster="ray", resume=True,
                  evaluator_factory=functools.partial(ray_fakes.fake_evaluator, sleep_s=0.3, record=record,
                                                      busy_dir=busy))
"""


def _candidates(run_dir: Path) -> list[tuple]:
    path = run_dir / "search.sqlite"
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute("SELECT card_id, digest, verdict, message FROM candidates ORDER BY id").fetchall()
    except sqlite3.OperationalError:  # the schema is not there yet
        return []
    finally:
        conn.close()


def _evaluated(record: Path) -> list[tuple[str, str, str]]:
    """(card id, digest, sample shipped) of every evaluation the actors started, in order."""
    return [tuple(line.split()) for line in record.read_text().splitlines()] if record.exists() else []


def _wait(what: str, cond, child, timeout_s: float = 600.0) -> None:
    """Until cond(); generous: the driver starts Python, Ray and an actor per GPU first."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert child.poll() is None, f"the driver ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.05)


def test_a_killed_actor_is_a_fault_and_a_killed_driver_resumes_losing_and_repeating_nothing(cluster, tmp_path):
    run_dir, record, busy, iterations = tmp_path / "run", tmp_path / "evaluated.txt", tmp_path / "busy", 12
    busy.mkdir()
    cards = make_run(run_dir, GOOD_GPUS)
    child = subprocess.Popen([sys.executable, "-c", DRIVER, str(run_dir), str(record), str(busy), str(iterations)],
                             env=dict(os.environ))
    try:
        _wait("first candidates", lambda: len(_candidates(run_dir)) >= 4, child)
        _wait("a busy actor", lambda: any(busy.glob("pid*")), child)
        victim = int(next(busy.glob("pid*")).name.removeprefix("pid"))
        os.kill(victim, signal.SIGKILL)  # mid-candidate: the file is there while it evaluates
        _wait("the fault", lambda: any("died" in r[3] for r in _candidates(run_dir)), child)
        after_fault = len(_candidates(run_dir))
        _wait("the search going on", lambda: len(_candidates(run_dir)) >= after_fault + 4, child)
    finally:
        child.kill()  # SIGKILL, mid-search (and never left running by a failed wait)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    killed = _candidates(run_dir)
    (fault,) = [r for r in killed if "died" in r[3]]
    assert fault[2] == "runtime_error" and "Ray restarted it" in fault[3]
    time.sleep(1.0)  # the dead driver's actors are gone before the evaluations are counted
    evaluated_before = _evaluated(record)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "package_run", lambda *a: None)
        result = runner.search_run(run_dir, proposer=FakeProposer, iterations=iterations, progress=False,
                                   cluster="ray", resume=True, evaluator_factory=functools.partial(
                                       ray_fakes.fake_evaluator, sleep_s=0.01, record=str(record), busy_dir=str(busy)))
    rows = _candidates(run_dir)
    evaluated_after = _evaluated(record)[len(evaluated_before):]
    logged_before = {(r[0], r[1]) for r in killed}
    assert rows[:len(killed)] == killed  # nothing lost: the killed driver's rows, unchanged, first
    assert len({(r[0], r[1]) for r in rows}) == len(rows)  # nothing repeated: no candidate of a card logged twice,
    assert not {(c, d) for c, d, _ in evaluated_after} & logged_before  # nor evaluated again after the resume,
    # and at most the candidates in flight at the driver's kill (one per actor) never reached the log.
    assert len({(c, d) for c, d, _ in evaluated_before} - logged_before) <= GOOD_GPUS
    with SQLiteStore(run_dir) as log:
        assert all(log.card_iterations(result.run_id, c.id) == iterations for c in cards)
        events = [e.message for e in log.events(result.run_id, "cluster")]  # one run: the resumed one
    assert events and all("sm_80" in m for m in events)  # the refused node, in the log of both sessions
    assert all(shipped == "True" for *_, shipped in _evaluated(record))  # every card's sample reached its node

