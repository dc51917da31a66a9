"""The main job over a run directory: choosing cards, one worker per GPU, packaging, compile-only
machines, Ctrl-C and resume. GPU-side modules are replaced through runner's three seams."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from fakes import FakeEvaluator, FakeProposer, toy_card

from kforge import cardtable, runner
from kforge.capturing import capture
from kforge.card_files import save_card
from kforge.errors import CardError, KforgeError
from kforge.store import SQLiteStore, connect

CARDS = [
    toy_card(op="aten::relu.default", share=0.5),
    toy_card(op="aten::exp.default", n=4096, share=0.3),
    toy_card(op="aten::view.default", family="view", share=0.1),
    toy_card(op="aten::mm.default", family="vendor", share=0.1),
]
BY_OP = {c.op: c for c in CARDS}


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    for c in CARDS:
        save_card(c, d)
    return d


class GPU:
    """Stands in for the GPU side: devices, one fake evaluator per worker, the packager."""

    def __init__(self, monkeypatch, devices, evaluator=FakeEvaluator):
        self.evaluators: list[FakeEvaluator] = []
        self.packaged: list[tuple] = []
        self.lock = threading.Lock()
        self.make = evaluator
        monkeypatch.setattr(runner, "gpu_devices", lambda requested: list(devices))
        monkeypatch.setattr(runner, "default_evaluator", self.evaluator)
        monkeypatch.setattr(runner, "package_run", self.package)

    def evaluator(self, run_dir, device):
        ev = self.make()
        ev.device = device
        with self.lock:
            self.evaluators.append(ev)
        return ev

    def package(self, run_dir, out, run_id):
        self.packaged.append((run_dir, out, run_id))
        out.write_text("{}")
        return out

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(card id, digest) of every evaluation, over all workers."""
        return [p for ev in self.evaluators for p in ev.pairs]


def _rows(result):
    return {r.op: r for r in result.table}


def test_searches_the_chosen_cards_and_packages_the_winners(run_dir, monkeypatch, tmp_path):
    gpu = GPU(monkeypatch, [0])
    result = runner.search_run(run_dir, out=tmp_path / "m.cast", proposer=FakeProposer, iterations=8, progress=False)
    rows = _rows(result)
    assert result.validated and result.package_path == tmp_path / "m.cast" and result.message == ""
    assert gpu.packaged == [(run_dir, tmp_path / "m.cast", result.run_id)]
    for op in ("aten::relu.default", "aten::exp.default"):
        assert rows[op].status == "done" and rows[op].iterations == 8
        assert rows[op].speedup > 1 and rows[op].best_us == pytest.approx(rows[op].eager_us / rows[op].speedup)
        assert result.stop_reasons[BY_OP[op].id] == "iterations"
    assert rows["aten::view.default"].status == "skipped" and "view" in rows["aten::view.default"].note
    assert rows["aten::mm.default"].status == "skipped" and "include_vendor" in rows["aten::mm.default"].note
    assert all(ev.closed for ev in gpu.evaluators)
    assert [str(c.header) for c in result.rich_table().columns][3:8] == ["iters", "time", "eager µs", "best µs", "speedup"]


def test_vendor_cards_min_share_and_proposer_declines(run_dir, monkeypatch):
    GPU(monkeypatch, [0])

    def decline_exp():
        return FakeProposer(decline=lambda c: "no template for exp" if c.op == "aten::exp.default" else None)

    rows = _rows(runner.search_run(run_dir, proposer=decline_exp, iterations=3, include_vendor=True, progress=False))
    assert rows["aten::mm.default"].status == "done"
    assert rows["aten::exp.default"].status == "skipped"
    assert rows["aten::exp.default"].note == "proposer fake declines: no template for exp"

    rows = _rows(runner.search_run(run_dir, proposer=FakeProposer, iterations=3, min_share=0.4, progress=False))
    assert rows["aten::exp.default"].status == "skipped" and "below min_share" in rows["aten::exp.default"].note


def test_ops_selects_cards_by_op_name(run_dir, monkeypatch):
    GPU(monkeypatch, [0])
    rows = _rows(runner.search_run(run_dir, proposer=FakeProposer, iterations=2, ops=["exp"], progress=False))
    assert rows["aten::exp.default"].status == "done"
    others = [r for op, r in rows.items() if op != "aten::exp.default"]
    assert others and all(r.status == "skipped" and r.note == "not among the ops asked for (exp)" for r in others)


def test_one_worker_per_gpu_searches_each_card_once(run_dir, monkeypatch):
    gpu = GPU(monkeypatch, [0, 1])
    result = runner.search_run(run_dir, proposer=FakeProposer, iterations=6, include_vendor=True, progress=False)
    assert sorted(ev.device for ev in gpu.evaluators) == [0, 1]
    assert len(gpu.calls) == len(set(gpu.calls))
    searched = [r for r in result.table if r.status == "done"]
    assert len(searched) == 3 and all(r.iterations == 6 for r in searched)
    conn = connect(run_dir, readonly=True)
    per_card = dict(conn.execute("SELECT card_id, COUNT(DISTINCT iteration) FROM candidates GROUP BY card_id").fetchall())
    assert set(per_card) == {BY_OP[op].id for op in ("aten::relu.default", "aten::exp.default", "aten::mm.default")}


def test_without_a_gpu_it_compiles_a_few_versions_and_says_what_needs_one(run_dir, monkeypatch, tmp_path):
    gpu = GPU(monkeypatch, [], evaluator=lambda: FakeEvaluator(untimed=True))
    result = runner.search_run(run_dir, out=tmp_path / "m.cast", proposer=FakeProposer, iterations=50, progress=False)
    assert not result.validated and result.package_path is None and gpu.packaged == []
    assert "Validation, timing and packaging need a GPU" in result.message
    conn = connect(run_dir, readonly=True)
    total, untimed = conn.execute("SELECT COUNT(*), SUM(verdict = 'untimed') FROM candidates").fetchone()
    assert total >= 2 * runner.COMPILE_ONLY_ITERATIONS - 1  # relu and exp (a duplicate may skip one)
    assert f"{total} candidate(s) for 2 card(s) were generated and {untimed} compiled" in result.message
    assert [ev.device for ev in gpu.evaluators] == [None]
    rows = _rows(result)
    assert rows["aten::relu.default"].iterations == runner.COMPILE_ONLY_ITERATIONS
    assert "untimed" in rows["aten::relu.default"].note and rows["aten::relu.default"].speedup is None

    fresh = tmp_path / "fresh"
    save_card(CARDS[0], fresh)
    declined = runner.search_run(fresh, proposer=lambda: FakeProposer(decline=lambda c: "CUDA memory only"),
                                 progress=False)
    assert "no card could be searched here" in declined.message

    # On a GPU later, the compile-only run is not continued: its candidates get measured for real.
    gpu = GPU(monkeypatch, [0])
    later = runner.search_run(run_dir, proposer=FakeProposer, iterations=5, progress=False)
    assert later.run_id != result.run_id and later.validated
    assert _rows(later)["aten::relu.default"].speedup > 1


def test_ctrl_c_marks_the_run_interrupted_and_resume_finishes_it(run_dir, monkeypatch):
    class Interrupting(FakeEvaluator):
        def evaluate(self, card, cand):
            if len(self.pairs) == 4:
                raise KeyboardInterrupt
            return super().evaluate(card, cand)

    gpu = GPU(monkeypatch, [0], evaluator=Interrupting)
    with pytest.raises(runner.RunInterrupted) as info:
        runner.search_run(run_dir, proposer=FakeProposer, iterations=10, progress=False)
    run_id = info.value.run_id
    assert isinstance(info.value, KeyboardInterrupt) and info.value.run_dir == run_dir
    log = SQLiteStore(run_dir)
    assert log.run(run_id).status == "interrupted"
    logged = {(r.card_id, r.digest) for r in log.candidates(run_id)}
    assert len(logged) == 4
    log.close()

    gpu = GPU(monkeypatch, [0])
    result = runner.search_run(run_dir, proposer=FakeProposer, iterations=10, progress=False)
    assert result.run_id == run_id
    assert not set(gpu.calls) & logged
    assert all(r.iterations == 10 for r in result.table if r.status == "done")
    conn = connect(run_dir, readonly=True)
    assert conn.execute("SELECT status FROM runs WHERE id=?", (run_id,)).fetchone()[0] == "done"


def test_worker_errors_fail_the_run_loudly(run_dir, monkeypatch):
    def broken(run_dir, device):
        raise RuntimeError("worker could not start")

    GPU(monkeypatch, [0, 1])
    monkeypatch.setattr(runner, "default_evaluator", broken)
    with pytest.raises(RuntimeError, match="could not start"):
        runner.search_run(run_dir, proposer=FakeProposer, iterations=3, progress=False)
    conn = connect(run_dir, readonly=True)
    assert conn.execute("SELECT status FROM runs").fetchone()[0] == "failed"


def test_bad_run_dirs_and_card_ids_say_what_to_do(run_dir, tmp_path, monkeypatch):
    GPU(monkeypatch, [0])
    with pytest.raises(CardError, match="kforge capture"):
        runner.search_run(tmp_path / "empty", proposer=FakeProposer)
    with pytest.raises(CardError, match="kforge inspect"):
        runner.search_run(run_dir, proposer=FakeProposer, cards=["nope"])
    only = runner.search_run(run_dir, proposer=FakeProposer, cards=[BY_OP["aten::exp.default"].id], iterations=2,
                             progress=False)
    assert [r.op for r in only.table] == ["aten::exp.default"]


def test_run_config_is_recorded_without_secrets(run_dir, monkeypatch):
    GPU(monkeypatch, [0])
    result = runner.search_run(run_dir, proposer=FakeProposer, iterations=2, progress=False, wall_time_s=60,
                               proposer_options={"api_key": "sk-secret"})
    conn = connect(run_dir, readonly=True)
    config = json.loads(conn.execute("SELECT config_json FROM runs WHERE id=?", (result.run_id,)).fetchone()[0])
    assert config["iterations"] == 2 and config["wall_time_s"] == 60 and config["validated"] is True
    dump = "\n".join(str(tuple(r)) for t in ("runs", "events") for r in conn.execute(f"SELECT * FROM {t}"))
    assert "sk-secret" not in dump


def test_resume_continues_the_latest_run_and_a_fresh_search_starts_a_new_one(run_dir, monkeypatch):
    GPU(monkeypatch, [0])
    first = runner.search_run(run_dir, proposer=FakeProposer, iterations=2, progress=False)
    again = runner.search_run(run_dir, proposer=FakeProposer, iterations=4, progress=False)
    fresh = runner.search_run(run_dir, proposer=FakeProposer, iterations=2, progress=False, resume=False)
    assert again.run_id == first.run_id and fresh.run_id != first.run_id
    assert f"Run {first.run_id} had finished; it was continued" in again.message and not first.message
    assert not fresh.message
    assert all(r.iterations == 4 for r in again.table if r.status == "done")
    assert all(r.iterations == 2 for r in fresh.table if r.status == "done")
    with pytest.raises(KforgeError, match="run_dir"):
        runner.run(resume=True)
    with pytest.raises(KforgeError, match="needs a model"):
        runner.run(run_dir=run_dir)


def test_cpu_only_run_generates_and_compiles_real_kernels_for_the_cuda_twin(tmp_path, monkeypatch):
    """No fakes: a CPU model, the builtin proposer and NVRTC. The CPU cards are retargeted to
    the GPU they would run on, so kernels are generated and compiled; nothing is packaged."""
    from kforge import cuda

    monkeypatch.setattr(cuda, "available", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Softmax(-1))
    result = runner.run(model, (torch.randn(8, 32),), out=tmp_path / "m.cast", iterations=2,
                        run_dir=tmp_path / "run", progress=False)
    assert not result.validated and result.package_path is None
    assert "need a GPU" in result.message
    rows = connect(tmp_path / "run", readonly=True).execute(
        "SELECT c.op, x.verdict FROM candidates x JOIN cards c ON c.card_id = x.card_id").fetchall()
    ops = {op for op, verdict in rows if verdict == "untimed"}
    assert {"aten::_softmax.default", "aten::native_layer_norm.default"} <= ops
    assert all(v in ("untimed", "compile_error") for _, v in rows)
    cards = connect(tmp_path / "run", readonly=True).execute("SELECT card_json FROM cards").fetchall()
    assert all('"device": "cuda"' in c[0] for c in cards)


def test_devices_are_checked_against_the_visible_gpus(monkeypatch):
    from kforge import cuda

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert runner.gpu_devices(None) == [0, 1]
    assert runner.gpu_devices([1, 1, 0]) == [1, 0]  # never two workers timing on one GPU
    with pytest.raises(KforgeError, match="no GPU 2 here: 2 visible.*--devices"):
        runner.gpu_devices([0, 2])


def test_region_cards_are_searched_before_single_op_cards(tmp_path):
    """With a deadline, the cards kforge.optimize and kforge.compile replace whole come first: a
    region card with a smaller share than a single-op card is still searched before it."""
    from test_regions import BasicBlock

    model = BasicBlock().eval()
    cards = capture(model, torch.randn(2, 4, 8, 8), tmp_path / "cap", regions=True, time_cards=False).cards
    regions = [c for c in cards if c.region is not None]
    ops = [c for c in cards if c.region is None]
    assert regions and ops
    for c in regions:
        c.share = 0.01
    for c in ops:
        c.share = 0.2
    order = cardtable.search_order(regions[:1] + ops + regions[1:])
    assert [c.region is not None for c in order] == [True] * len(regions) + [False] * len(ops)


def test_cards_are_searched_by_the_time_a_kernel_at_the_memory_floor_would_save(tmp_path):
    """Given the GPU, a card's rank is its share times the part of its eager time above its bytes'
    floor: a slow pooling with a smaller share goes before an add that runs at the floor."""
    from kforge.hardware import H200

    cards = capture(_AddThenPool(), (torch.randn(8, 16, 32, 32),) * 2, tmp_path / "cap", time_cards=False).cards
    add, pool = (next(c for c in cards if name in c.op) for name in ("add.Tensor", "avg_pool2d"))
    add = add.retarget("cuda", "sm_90")
    pool = pool.retarget("cuda", "sm_90")
    add.share, pool.share = 0.3, 0.1
    add.eager_us = 1.1 * H200.floor_us(add.io_bytes())  # 9 % above its floor
    pool.eager_us = 4.0 * H200.floor_us(pool.io_bytes())
    assert cardtable.search_order([add, pool]) == [add, pool]  # by share alone
    assert cardtable.search_order([add, pool], H200) == [pool, add]
    assert cardtable.headroom(add, H200) == pytest.approx(0.3 * cardtable.HEADROOM_MIN)
    assert cardtable.headroom(pool, H200) == pytest.approx(0.1 * 0.75)


class _PoolBesideNorm(torch.nn.Module):
    """A batch norm and ReLU (a region), and a pooling of the same input alone."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(4).eval()

    def forward(self, x):
        return torch.relu(self.bn(x)), torch.nn.functional.avg_pool2d(x, 2)


def test_op_cards_the_traced_graphs_call_outside_regions_are_searched_beside_the_regions(tmp_path):
    from kforge.region_capture import alone_op_cards

    """capture records them (regions.json "alone"): the pooling is one, the ReLU inside the region
    and eager's own batch norm call are not; they go after the region cards, the pooling among them."""
    cards = capture(_PoolBesideNorm().eval(), torch.randn(2, 4, 8, 8), tmp_path / "cap", regions=True,
                    time_cards=False).cards
    alone = alone_op_cards(tmp_path / "cap")
    pool, relu = (next(c for c in cards if c.region is None and name in c.op) for name in ("avg_pool2d", "relu"))
    (region,) = [c for c in cards if c.region is not None]
    assert pool.id in alone and relu.id not in alone
    assert not any(c.id in alone for c in cards if "batch_norm" in c.op)
    pool.share, relu.share, region.share = 0.2, 0.5, 0.1
    assert cardtable.search_order([relu, region, pool], alone=alone) == [pool, region, relu]
    assert cardtable.search_order([relu, region, pool]) == [region, relu, pool]  # a capture without it
    assert alone_op_cards(tmp_path / "nowhere") == set()


class _AddThenPool(torch.nn.Module):
    def forward(self, x, y):
        return torch.nn.functional.avg_pool2d(x + y, 2)


def test_a_card_whose_calls_all_run_inside_another_chosen_card_is_searched_last(tmp_path, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True)).eval()
    captured = {c.op: c for c in capture(model, torch.randn(4, 8), tmp_path / "cap", time_cards=False).cards}
    inner, outer, other = (captured[op] for op in ("aten::clamp_min_.default", "aten::relu_.default",
                                                    "aten::copy_.default"))
    inner.share, outer.share, other.share = 0.5, 0.3, 0.2  # the inner call ranks first by share
    assert [c.op for c in cardtable.search_order([inner, outer, other])] == [
        "aten::relu_.default", "aten::copy_.default", "aten::clamp_min_.default"]
    # copy_ runs inside addmm, which the search leaves alone, and without relu_ chosen clamp_min_'s
    # calls are its own to replace: both keep their places by share
    assert cardtable.search_order([other, inner]) == [inner, other]
    run_dir = tmp_path / "run"
    saved = {}
    for c in (inner, outer):
        c = c.retarget("cuda", "sm_90")
        save_card(c, run_dir)
        saved[c.id] = c.op
    gpu = GPU(monkeypatch, [0])
    runner.search_run(run_dir, proposer=FakeProposer, iterations=1, progress=False)
    assert [saved[card_id] for card_id, _ in gpu.calls] == ["aten::relu_.default", "aten::clamp_min_.default"]


def test_a_run_deadline_is_shared_fairly_between_the_cards_left():
    from kforge.search.mcts import Budget

    now = time.monotonic()
    b = Budget(deadline=now + 100.0)
    assert runner.fair_share(b, cards_left=4, workers=1).wall_time_s == pytest.approx(25.0, abs=0.5)
    assert runner.fair_share(b, cards_left=4, workers=2).wall_time_s == pytest.approx(50.0, abs=0.5)
    assert runner.fair_share(b, cards_left=1, workers=1).wall_time_s == pytest.approx(100.0, abs=0.5)
    capped = Budget(deadline=now + 100.0, wall_time_s=10.0)
    assert runner.fair_share(capped, cards_left=2, workers=1).wall_time_s == 10.0  # a per-card cap still holds
    assert runner.fair_share(Budget(), cards_left=3, workers=1) == Budget()  # no deadline: unchanged
    late = Budget(deadline=now - 1.0)
    assert runner.fair_share(late, cards_left=3, workers=1).wall_time_s == 0.0


@pytest.mark.parametrize("options, match", [
    ({"iterations": 0}, "iterations must be a whole number >= 1"),
    ({"iterations": -3}, "iterations must be a whole number >= 1"),
    ({"min_share": 5}, "min_share is a fraction of the model's runtime, from 0 to 1"),
    ({"min_share": -0.1}, "min_share is a fraction"),
    ({"wall_time_s": 0}, "wall_time_s must be a number of seconds > 0"),
    ({"max_cost_usd": -1.0}, "max_cost_usd must be"),
])
def test_meaningless_search_options_are_refused_before_any_work(run_dir, monkeypatch, options, match):
    GPU(monkeypatch, [0])
    with pytest.raises(KforgeError, match=match):
        runner.search_run(run_dir, proposer=FakeProposer, progress=False, **options)
    assert not (run_dir / "search.sqlite").exists()  # no run was opened
    with pytest.raises(KforgeError, match=match):  # run() refuses before capturing
        runner.run(torch.nn.ReLU(), torch.randn(4), run_dir=run_dir.parent / "fresh", proposer=FakeProposer,
                   progress=False, **options)
    assert not (run_dir.parent / "fresh").exists()


def test_ops_that_match_no_card_say_which_ops_were_captured(run_dir, monkeypatch):
    GPU(monkeypatch, [0])
    with pytest.raises(CardError, match=r"no card's op contains any of nonexistent_op; .* are: .*exp.*relu"):
        runner.search_run(run_dir, proposer=FakeProposer, ops=["nonexistent_op"], progress=False)


def test_an_unknown_proposer_fails_before_the_capture(tmp_path):
    model_runs = []

    class Counting(torch.nn.Module):
        def forward(self, x):
            model_runs.append(1)
            return x.relu()

    with pytest.raises(KforgeError, match="unknown proposer 'bogus'"):
        runner.run(Counting(), torch.randn(4), run_dir=tmp_path / "r", proposer="bogus", progress=False)
    assert not model_runs and not (tmp_path / "r").exists()


def test_numpy_scalars_are_accepted_as_options(run_dir, monkeypatch):
    import numpy as np

    GPU(monkeypatch, [0])
    r = runner.search_run(run_dir, proposer=FakeProposer, iterations=np.int64(2), min_share=np.float32(0.2),
                          progress=False)
    assert _rows(r)["aten::exp.default"].status == "done"


def test_a_proposer_factory_is_not_called_before_the_search(tmp_path, monkeypatch):
    # A factory may hand out one shared proposer: closing a trial instance would close it.
    GPU(monkeypatch, [0])
    shared = FakeProposer()
    calls = []

    def factory():
        calls.append(1)
        return shared

    runner.run(torch.nn.ReLU(), torch.randn(64), run_dir=tmp_path / "r", out=tmp_path / "m.cast", proposer=factory, iterations=2,
               progress=False, check_model=False)
    assert calls == [1]  # once for the one worker, as run() documents


def test_other_family_cards_are_searched_by_a_proposer_that_supports_them(tmp_path, monkeypatch):
    """No family but views and vendor ops is skipped wholesale: a cumsum card (family
    `other`) is searched when the proposer supports it and skipped with its reason when not."""
    d = tmp_path / "run"
    cumsum = toy_card(op="aten::cumsum.default", family="other", share=0.9)
    save_card(cumsum, d)
    GPU(monkeypatch, [0])
    rows = _rows(runner.search_run(d, proposer=FakeProposer, iterations=2, progress=False))
    assert rows["aten::cumsum.default"].status == "done"
    decline = lambda: FakeProposer(decline=lambda c: "no builtin template for aten::cumsum.default")  # noqa: E731
    rows = _rows(runner.search_run(d, proposer=decline, iterations=2, progress=False))
    assert rows["aten::cumsum.default"].status == "skipped" and "no builtin template" in rows["aten::cumsum.default"].note
