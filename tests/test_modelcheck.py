"""kforge.modelcheck: the model timed eager and with its package, and what run() does with it."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from test_dispatch import FakeLauncher, relu_kernel
from test_package import cpu_cast  # noqa: F401  (fixture)

from kforge import run_report, runner
from kforge.dispatch import Dispatcher
from kforge.errors import KforgeError
from kforge.store import SQLiteStore
from kforge.modelcheck import ModelCheck, check_model
from kforge.package import load


class Relu(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def test_the_package_is_applied_in_the_timed_rounds_and_eager_is_not(cpu_cast):  # noqa: F811
    path, x = cpu_cast
    pkg, launcher = load(path, arch="sm_90"), FakeLauncher(relu_kernel)
    check = check_model(Relu(), x, pkg, rounds=3, calls=5, dispatcher=Dispatcher("CPU"), launcher=launcher)
    # 2 warm-up rounds and 3 timed ones, each one untimed call and `calls` more: every one
    # of them with the package applied went to the kernel, and no eager one did.
    assert len(launcher.calls) == (2 + 3) * (1 + 5) and (check.calls, check.rounds) == (5, 3)
    assert check.hits == len(launcher.calls)  # counted from the package's own counters
    assert check.eager_us > 0 and check.package_us > 0 and check.device == "cpu"
    assert not pkg.installed  # uninstalled after every round
    assert set(check.to_json()) >= {"eager_us", "package_us", "speedup", "verdict"}
    assert not check.graphed and not check.graph_error  # CUDA graphs only on a CUDA device


class Slow(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.02)
        return x + 1


def test_a_slow_model_gets_one_call_per_sample_and_fewer_rounds(cpu_cast):  # noqa: F811
    path, x = cpu_cast
    def check(budget_s):
        return check_model(Slow(), x, load(path, arch="sm_90"), rounds=5, budget_s=budget_s,
                           dispatcher=Dispatcher("CPU"), launcher=FakeLauncher(relu_kernel))

    # A round is 2 entries x (1 + 1 calls) x >= 20 ms, and 2 rounds warm up.
    roomy = check(5.0)
    assert (roomy.calls, roomy.rounds) == (1, 5)  # a 20 ms forward is a sample of its own; the rounds asked for fit
    assert roomy.verdict == "unused" and "does nothing" in roomy.message()  # Slow never calls relu
    assert check(0.2).rounds == 3  # never fewer than 3 (where 5 rounds take at most 3 budgets)
    with pytest.raises(KforgeError, match="one forward takes"):
        check(0.02)  # 5 rounds of 80 ms would take 0.4 s, far over 3 x 0.02 s


@pytest.mark.parametrize("iqr, package_us, verdict", [(4.0, 80.0, "faster"), (4.0, 100.5, "level"), (4.0, 99.0, "level"),
                                                      (4.0, 120.0, "slower"), (0.1, 99.5, "level"), (0.1, 98.5, "faster")])
def test_verdict_is_beyond_the_noise(iqr, package_us, verdict):
    check = ModelCheck(100.0, iqr, package_us, 2.0, "cuda:0")  # noise: half the larger iqr, at least 1 % of eager
    assert check.verdict == verdict
    assert check.speedup == pytest.approx(100.0 / package_us)
    if verdict == "slower":
        assert "do not apply the package" in check.message() and "CUDA graph" in check.message()


def run_logged(tmp_path, package_path) -> run_report.RunResult:
    """A finished run "r1" in tmp_path's search log, whose package is `package_path`."""
    log = SQLiteStore(tmp_path)
    log.start_run("r1", model="m")
    log.close()
    return run_report.RunResult("r1", tmp_path, [], Path(package_path), True)


def logged_checks(tmp_path) -> list[tuple]:
    """(kind, level, message) of run r1's events."""
    with SQLiteStore(tmp_path, readonly=True) as log:
        return [(e.kind, e.level, e.message) for e in log.events("r1")]


def test_run_records_a_failed_model_check_and_does_not_raise(tmp_path):
    result = run_logged(tmp_path, tmp_path / "missing.cast")
    runner._check_model(result, Relu(), torch.randn(4, 8))
    assert result.model_check is None and "missing.cast" in result.model_check_error
    (kind, level, message), = logged_checks(tmp_path)
    assert (kind, level) == ("model-check", "warning") and "did not complete" in message


class Interrupted(torch.nn.Module):
    def forward(self, x):
        raise KeyboardInterrupt


def test_ctrl_c_during_the_model_check_keeps_the_finished_run(cpu_cast, tmp_path):  # noqa: F811
    path, x = cpu_cast
    result = run_logged(tmp_path, path)
    runner._check_model(result, Interrupted(), x, load_options={"arch": "sm_90"}, dispatcher=Dispatcher("CPU"),
                        launcher=FakeLauncher(relu_kernel))  # returns: the package is written, the run done
    assert result.model_check is None and result.model_check_error == "interrupted by the user"


def test_run_checks_the_model_with_the_new_package(cpu_cast, tmp_path):  # noqa: F811
    path, x = cpu_cast
    result = run_logged(tmp_path, path)
    launcher = FakeLauncher(relu_kernel)
    runner._check_model(result, Relu(), x, load_options={"arch": "sm_90"}, dispatcher=Dispatcher("CPU"),
                        launcher=launcher)
    assert result.model_check is not None and not result.model_check_error and launcher.calls
    (kind, _, message), = logged_checks(tmp_path)
    assert kind == "model-check" and message.startswith(f"{path.resolve()}: model forward on cpu: eager")


def graph_check(package_us, graph_eager_us, graph_package_us, **kw) -> ModelCheck:
    return ModelCheck(100.0, 2.0, package_us, 2.0, "cuda:0", hits=10, graph_eager_us=graph_eager_us,
                      graph_eager_iqr_us=0.5, graph_package_us=graph_package_us, graph_package_iqr_us=0.5, **kw)


def test_a_launch_bound_forward_is_told_to_use_a_cuda_graph():
    # Eager 100 µs op by op, 90 µs from a graph: launch-bound. The package is level op by op
    # and 1.2x from a graph: the check says where its gains show.
    check = graph_check(99.5, 90.0, 75.0)
    assert (check.verdict, check.graph_verdict, check.launch_bound) == ("level", "faster", True)
    assert check.graph_speedup == pytest.approx(1.2)
    msg = check.message()
    assert "replayed from a CUDA graph: eager 90.0 µs, with the package 75.0 µs: 1.200x, faster" in msg
    assert "bound by launch overhead" in msg and "do not apply" not in msg
    assert check.to_json()["graph_verdict"] == "faster" and check.to_json()["launch_bound"] is True


def test_a_forward_not_launch_bound_gets_the_plain_verdicts():
    check = graph_check(80.0, 99.5, 79.0)  # the graph takes what eager takes: the GPU sets the pace
    assert (check.verdict, check.graph_verdict, check.launch_bound) == ("faster", "faster", False)
    assert "bound by launch overhead" not in check.message()
    slower = graph_check(120.0, 99.5, 119.0)
    assert slower.graph_verdict == "slower" and "do not apply the package" in slower.message()
    # Measured slower from a graph too: the check does not send the user to graphs.
    assert "from a CUDA graph: do not apply" in slower.message() and "torch.cuda.graph;" not in slower.message()


def test_without_a_graph_the_check_says_why():
    check = ModelCheck(100.0, 2.0, 90.0, 2.0, "cuda:0", hits=3, graph_error="RuntimeError: capture failed")
    assert not check.graphed and check.graph_verdict is None and not check.launch_bound
    assert "not replayed from a CUDA graph (RuntimeError: capture failed)" in check.message()
    cpu = ModelCheck(100.0, 2.0, 90.0, 2.0, "cpu", hits=3)
    assert "CUDA graph" not in cpu.message() and cpu.to_json()["graph_speedup"] is None


def test_the_check_compares_kforge_compile_with_torch_compile_and_names_the_sites_to_drop():
    base = ModelCheck(100.0, 1.0, 90.0, 1.0, "cuda:0", hits=4, compile_hits=("c1",))
    level = dataclasses.replace(base, compiled={"torch.compile": (60.0, 1.0), "kforge.compile": (59.8, 1.0),
                                                "torch.compile reduce-overhead": (40.0, 0.5),
                                                "kforge.compile reduce-overhead": (40.1, 0.5)})
    assert (level.compile_verdict(), level.compile_verdict("reduce-overhead")) == ("level", "level")
    assert "kforge.compile is not faster than torch.compile" in level.message() and "(c1)" in level.message()
    faster = dataclasses.replace(level, compiled={**level.compiled, "kforge.compile": (50.0, 1.0)})
    assert faster.compile_verdict() == "faster" and "not faster" not in faster.message()
    assert "torch.compile 60.0 µs, kforge.compile 50.0 µs: 1.200x, faster" in faster.message()
    assert faster.to_json()["compile_verdict"] == "faster"
    assert base.compile_verdict() is None and "torch.compile" not in base.message()  # not measured: not said


def test_the_verdict_names_the_fastest_way_and_by_how_much():
    check = ModelCheck(100.0, 2.0, 90.0, 2.0, "cuda:0", hits=3, graph_eager_us=70.0, graph_eager_iqr_us=1.0,
                       graph_package_us=65.0, graph_package_iqr_us=1.0,
                       compiled={"torch.compile": (80.0, 1.0), "kforge.optimize": (75.0, 1.0),
                                 "kforge.optimize cuda_graphs": (50.0, 1.0)})
    assert check.fastest == ("kforge.optimize cuda_graphs", 1.3, "pkg.apply(), CUDA graph")
    assert check.message().endswith("Fastest: kforge.optimize cuda_graphs 50.0 µs, 1.300x pkg.apply(), CUDA graph "
                                    "(65.0 µs), 2.000x eager")
    level = ModelCheck(100.0, 2.0, 99.5, 2.0, "cpu", hits=3)
    assert level.message().endswith("Fastest: pkg.apply() 99.5 µs, level with eager 100.0 µs")
    assert check.to_json()["fastest"] == check.fastest


def test_the_compile_record_is_what_kforge_compile_follows():
    lost = ModelCheck(100.0, 1.0, 90.0, 1.0, "cuda:0", hits=4, compile_hits=("a" * 16, "b" * 16),
                      compiled={"torch.compile": (946.0, 4.0), "kforge.compile": (1124.0, 6.0)})
    record = lost.compile_record()
    assert record["use"] == "torch.compile" and record["verdict"] == "slower" and record["drop"] == []
    assert record["compiled_cards"] == ["a" * 16, "b" * 16] and record["noise_us"] == 9.46
    assert "runs plain torch.compile for it. Sites to drop: the cards its graphs ran (aaaa" in lost.message()
    # Leaving b out makes it win (beside torch.compile in the same rounds): b is recorded and dropped.
    one_out = dataclasses.replace(lost, leave_one_out={"torch.compile": (950.0, 4.0), "kforge.compile": (1120.0, 6.0),
                                                       "a" * 16: (1300.0, 6.0), "b" * 16: (900.0, 5.0)})
    record = one_out.compile_record()
    assert record["use"] == "kforge.compile" and record["drop"] == ["b" * 16]
    assert [(r["card"], r["verdict"]) for r in record["leave_one_out"]] == [("a" * 16, "slower"), ("b" * 16, "faster")]
    assert f"without card {'b' * 16}" in one_out.message()
    won = dataclasses.replace(lost, compiled={"torch.compile": (946.0, 4.0), "kforge.compile": (800.0, 4.0)})
    assert won.compile_record()["use"] == "kforge.compile" and won.compile_record()["drop"] == []
    assert ModelCheck(100.0, 1.0, 90.0, 1.0, "cuda:0").compile_record() is None  # not measured


def test_kforge_optimize_slower_than_eager_is_recorded_for_it_to_follow():
    """Op by op slower than eager beyond the noise: "use" eager, said in the message; from CUDA
    graphs within the noise: kept. Recorded beside the compile verdict, in the package's format."""
    from kforge.manifest import check_manifest

    check = ModelCheck(100.0, 1.0, 90.0, 1.0, "cuda:0", hits=4, compiled={
        "torch.compile": (95.0, 1.0), "kforge.compile": (80.0, 1.0),
        "kforge.optimize": (120.0, 2.0), "kforge.optimize cuda_graphs": (99.5, 1.0)})
    rec = check.compile_record()["optimize"]
    assert rec["ops"] == {"verdict": "slower", "use": "eager", "eager_us": 100.0, "optimize_us": 120.0}
    assert (rec["cuda_graphs"]["verdict"], rec["cuda_graphs"]["use"]) == ("level", "kforge.optimize")
    assert "kforge.optimize 120.0 µs: 0.833x eager, slower: the package records it" in check.message()
    assert "cuda_graphs 99.5 µs: 1.005x eager. Fastest" in check.message()
    manifest = {"format": 3, "kforge": "0", "torch": "2", "gpu": {"name": "g", "arch": "sm_90"}, "cards": [],
                "model_check": check.compile_record()}
    assert check_manifest(Path("p.cast"), json.dumps(manifest).encode())["model_check"]["optimize"] == rec
    no_optimize = dataclasses.replace(check, compiled={"torch.compile": (95.0, 1.0), "kforge.compile": (80.0, 1.0)})
    assert "optimize" not in no_optimize.compile_record()


def test_run_records_the_compile_verdict_in_the_package(cpu_cast, tmp_path, monkeypatch):  # noqa: F811
    import kforge.modelcheck

    path, x = cpu_cast
    card = load(path, arch="sm_90").cards[0].id
    asked = {}

    def check_model(model, inputs, pkg, **options):  # the GPU check's result, on the CPU
        asked.update(options)
        return ModelCheck(100.0, 1.0, 90.0, 1.0, "cuda:0", hits=4, compile_hits=(card,),
                          compiled={"torch.compile": (946.0, 4.0), "kforge.compile": (1124.0, 6.0)})
    monkeypatch.setattr(kforge.modelcheck, "check_model", check_model)
    result = run_logged(tmp_path, path)
    runner._check_model(result, Relu(), x, load_options={"arch": "sm_90"}, leave_one_out=3)
    assert asked["with_compile"] is True and asked["leave_one_out"] == 3  # the card has a compiled-graph kernel
    recorded = load(path, arch="sm_90").manifest["model_check"]
    assert recorded["use"] == "torch.compile" and recorded["compiled_cards"] == [card]
    (_, level, message), = logged_checks(tmp_path)
    assert level == "warning" and "kforge.compile runs plain torch.compile for it" in message


class Doubled(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_the_checks_compiles_leave_no_entry_against_the_users_recompile_limit():
    """Nine compiles of one forward with as many backends (the check's six ways and its cards left
    out) fill dynamo's per-frame cache: the user's own compile after them runs eager, its backend
    never called. Inside compiles_forgotten, the entries go when the block ends and the user's
    compile traces the forward; a function compiled before, elsewhere, keeps its entry."""
    from kforge.modelcheck import compiles_forgotten

    def fill(model, x):
        for _ in range(9):
            torch.compile(model, backend=lambda gm, ex: gm.forward)(x)  # a new backend each time

    def users_compile_traces(model, x) -> bool:
        traced = []

        def backend(gm, ex):
            traced.append(gm)
            return gm.forward
        torch.compile(model, backend=backend)(x)
        return bool(traced)

    x = torch.randn(4)
    torch.compiler.reset()
    fill(Doubled(), x)
    assert not users_compile_traces(Doubled(), x)  # past the limit: eager
    torch.compiler.reset()
    other = torch.compile(lambda t: t + 1, backend=lambda gm, ex: gm.forward)
    other(x)  # compiled before the check, elsewhere: its entry stays
    with compiles_forgotten(Doubled()):
        fill(Doubled(), x)
    assert users_compile_traces(Doubled(), x)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    assert len(_debug_get_cache_entry_list(other._torchdynamo_orig_callable.__code__)) == 1
