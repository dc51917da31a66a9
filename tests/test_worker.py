"""The worker protocol end to end, in real spawned processes, with the FakeBackend: good
kernels get timed verdicts, cheats are caught, crashes and hangs cost one worker and the
pool goes on, and processes and memory stay bounded."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from evalkit import fake, make_card, relu_card, softmax_card
from kforge.card_files import save_card, save_sample
from kforge.errors import CardError
from kforge.evaluate import CompileOnlyEvaluator, KeptEvaluators, WorkerHandle, WorkerPool, make_evaluator
from kforge.verdict import EvalResult, Verdict
from kforge.timing import as_called_calls
from kforge.backends import FakeBackend, NotDispatched
from kforge.baseline import Baselines
from kforge.inputsets import prepare
from kforge.judge import Judge
from kforge.worker_protocol import FATAL_EXIT, EvalOptions

pytestmark = pytest.mark.timeout(300)

FAST = dict(min_reps=5, min_ms=0.0, warmup_ms=0.0, fresh_sets=3, compile_baseline=False)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with make_evaluator(tmp_path_factory.mktemp("run"), backend="fake", timeout_s=2.0, **FAST) as p:
        yield p


@pytest.fixture(scope="module")
def card():
    return relu_card()


def _restarts(pool) -> int:
    return pool.handles[0].starts


def test_good_kernel_is_timed_against_eager(pool, card):
    r = pool.evaluate(card, fake("relu_good"))
    assert r.verdict in (Verdict.VALID, Verdict.SLOWER), r.message
    assert r.eager_us > 0 and r.kernel_us > 0 and r.max_abs_err == 0.0
    assert r.evidence["input_sets"] == ["seed1", "seed2", "seed3"]
    assert len(r.evidence["kernel_samples_us"]) == 5 and r.evidence["tolerance"]["rtol"] == 1e-5
    assert r.dispatched_us is None


def test_slow_kernel_is_slower(pool, card):
    r = pool.evaluate(card, fake("relu_sleepy"))
    assert r.verdict is Verdict.SLOWER, r.message


@pytest.mark.parametrize("name, check", [
    ("relu_partial", "unwritten"),
    ("relu_zeros", "constant"),
    ("relu_nan", "nonfinite"),
    ("relu_mutates", "inputs_mutated"),
    ("relu_jitter", "nondeterministic"),
    ("relu_overfit", "mismatch"),
])
def test_cheats_are_incorrect(pool, card, name, check):
    r = pool.evaluate(card, fake(name))
    assert r.verdict is Verdict.INCORRECT, r.message
    assert r.evidence["check"] == check, r.evidence


def test_skipping_elements_that_look_like_the_poison_is_caught(pool):
    card = make_card(torch.ops.aten.sign.default, torch.randint(-5, 6, (64, 64), dtype=torch.int32))
    r = pool.evaluate(card, fake("sign_skips_minus_one"))
    assert r.verdict is Verdict.INCORRECT and r.evidence["check"] == "unwritten", r.message
    assert "second run" in r.message


def test_declared_atomics_allow_tiny_run_to_run_differences(pool, card):
    r = pool.evaluate(card, fake("relu_jitter", atomics=True))
    assert r.verdict in (Verdict.VALID, Verdict.SLOWER), r.message


def test_fp16_math_in_an_fp32_softmax_is_incorrect(pool):
    card = softmax_card(8, 4096)
    assert pool.evaluate(card, fake("softmax_good")).verdict in (Verdict.VALID, Verdict.SLOWER)
    r = pool.evaluate(card, fake("softmax_half"))
    assert r.verdict is Verdict.INCORRECT and r.evidence["check"] == "mismatch"
    assert r.evidence["worst"]["got"] != r.evidence["worst"]["expected"]


def test_kernel_that_stops_working_after_the_checks_is_caught_after_timing(pool, card):
    r = pool.evaluate(card, fake("relu_counter"))
    assert r.verdict is Verdict.INCORRECT, r.message
    assert r.evidence["after_timing"] and r.evidence["check"] == "unwritten"


def test_compile_error_for_an_unknown_kernel(pool, card):
    r = pool.evaluate(card, fake("no_such_kernel"))
    assert r.verdict is Verdict.COMPILE_ERROR and "no_such_kernel" in r.compile_log


def test_mislabelled_vendor_wrapper_never_reaches_a_worker(pool, card):
    cand = fake("relu_good")
    cand.source += "\n#include <cudnn.h>"
    before = pool.handles[0].served
    r = pool.evaluate(card, cand)
    assert r.verdict is Verdict.INCORRECT and "mislabelled vendor wrapper" in r.message
    assert pool.handles[0].served == before


def test_crash_exit_is_a_runtime_error_and_the_pool_goes_on(pool, card):
    starts = _restarts(pool)
    r = pool.evaluate(card, fake("relu_exit"))
    assert r.verdict is Verdict.RUNTIME_ERROR and r.evidence["exitcode"] == 7, r.message
    assert pool.evaluate(card, fake("relu_good")).verdict in (Verdict.VALID, Verdict.SLOWER)
    assert _restarts(pool) == starts + 1


def test_segfault_is_a_runtime_error_naming_the_signal(pool, card):
    r = pool.evaluate(card, fake("relu_segv"))
    assert r.verdict is Verdict.RUNTIME_ERROR and r.evidence["signal"] == "SIGSEGV", r.message
    assert "SIGSEGV" in r.message


def test_poisoning_cuda_error_ends_the_worker_after_it_reports(pool, card):
    pid = pool.handles[0].ping()["pid"]
    r = pool.evaluate(card, fake("relu_illegal_address"))
    assert r.verdict is Verdict.RUNTIME_ERROR and r.evidence["cuda_error"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert r.evidence["worker_exit"] == FATAL_EXIT
    assert pool.handles[0].ping()["pid"] != pid


def test_recoverable_cuda_error_keeps_the_worker(pool, card):
    pid = pool.handles[0].ping()["pid"]
    r = pool.evaluate(card, fake("relu_out_of_resources"))
    assert r.verdict is Verdict.RUNTIME_ERROR and r.evidence["cuda_error"] == "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
    assert pool.handles[0].ping()["pid"] == pid


def test_device_error_outside_a_guarded_launch_still_ends_the_worker(pool, card):
    pid = pool.handles[0].ping()["pid"]
    r = pool.evaluate(card, fake("relu_late_fault"))
    assert r.verdict is Verdict.RUNTIME_ERROR and r.evidence["cuda_error"] == "CUDA_ERROR_ILLEGAL_ADDRESS", r.message
    assert r.evidence["worker_exit"] == FATAL_EXIT
    assert pool.handles[0].ping()["pid"] != pid


def test_unreadable_card_is_a_card_error_and_the_worker_stays(pool, card, monkeypatch):
    pid = pool.handles[0].ping()["pid"]
    newer = dict(card.to_json(), format=10**6)
    monkeypatch.setattr(card, "to_json", lambda: newer)
    with pytest.raises(CardError, match="newer than this kforge reads"):
        pool.evaluate(card, fake("relu_good"))
    assert pool.handles[0].ping()["pid"] == pid


def test_hang_is_killed_within_the_timeout(pool, card):
    pool.evaluate(card, fake("relu_good"))  # card prepared, worker warm: only the launch is timed
    t0 = time.monotonic()
    r = pool.evaluate(card, fake("relu_hang"))
    took = time.monotonic() - t0
    assert r.verdict is Verdict.HANG, r.message
    assert r.evidence["phase"] == "compiled" and r.evidence["timeout_s"] == 2.0
    assert 2.0 <= took < 6.0
    assert pool.evaluate(card, fake("relu_good")).verdict in (Verdict.VALID, Verdict.SLOWER)


def test_captured_sample_is_checked_first(tmp_path):
    card = relu_card((32, 32))
    card.samples = 1
    x = card.random_inputs(99, "cpu")
    save_card(card, tmp_path)
    save_sample(card, tmp_path, 0, x, card.call_eager(x))
    with make_evaluator(tmp_path, backend="fake", **FAST) as p:
        r = p.evaluate(card, fake("relu_good"))
        assert r.evidence["input_sets"][0] == "sample0", r.evidence


def test_kept_evaluators_keep_one_worker_across_runs_each_reading_its_own_samples(tmp_path):
    """KeptEvaluators (a benchmark running many models): the second run is served by the first
    run's worker process, reads its own run directory's sample, and closing a run keeps it."""
    card = relu_card((32, 32))
    card.samples = 1
    made = []

    def make(run_dir, device):
        made.append((run_dir, device))
        return make_evaluator(run_dir, backend="fake", **FAST)

    with KeptEvaluators(make) as workers:
        pids, sets = [], []
        verdicts = []
        for run in ("a", "b"):
            d = tmp_path / run
            x = card.random_inputs(7, "cpu")
            save_card(card, d)
            save_sample(card, d, 0, x, card.call_eager(x))
            ev = workers(d, 0)
            r = ev.evaluate(card, fake("relu_good"))
            verdicts.append(r.verdict)
            sets.append(r.evidence["input_sets"][0])
            pids.append(workers._kept[0].handles[0].ping()["pid"])
            ev.close()  # what kforge.run does when it ends: the worker stays
        assert made == [(tmp_path / "a", 0)] and pids[0] == pids[1] and sets == ["sample0", "sample0"]
        assert all(v in (Verdict.VALID, Verdict.SLOWER) for v in verdicts)
        kept = workers._kept[0]
    assert kept.handles[0]._proc is None  # the with block stopped it


def test_a_kept_pool_is_asked_with_each_runs_own_directory(tmp_path, card):
    class Recording(WorkerPool):
        def __init__(self):
            self.seen, self.closed = [], False

        def evaluate(self, card, candidate, run_dir=None):
            self.seen.append(run_dir)
            return EvalResult(Verdict.VALID)

        def close(self):
            self.closed = True

    pool = Recording()
    with KeptEvaluators(lambda run_dir, device: pool) as workers:
        for run in ("a", "b"):
            ev = workers(tmp_path / run, 0)
            ev.evaluate(card, fake("relu_good"))
            ev.close()
        assert pool.seen == [tmp_path / "a", tmp_path / "b"] and not pool.closed
    assert pool.closed


def test_ctrl_c_while_the_worker_judges_leaves_nothing_for_the_next_request(tmp_path, card):
    """A Ctrl-C in the parent mid-candidate (a notebook's interrupt) kills the worker: it would
    go on judging and answer the next request, perhaps another run's, with this one's replies."""
    import threading

    with make_evaluator(tmp_path, backend="fake", timeout_s=30.0, **FAST) as p:
        p.evaluate(card, fake("relu_good"))
        first = p.handles[0].pid
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                p.evaluate(card, fake("relu_hang"))
        finally:
            signal.signal(signal.SIGINT, previous)
        assert time.monotonic() - t0 < 10  # the Ctrl-C ended the wait, not the 30 s timeout
        r = p.evaluate(card, fake("relu_zeros"))
        assert r.verdict is Verdict.INCORRECT and r.evidence["check"] == "constant", r.message
        assert p.handles[0].pid != first


def test_card_that_eager_cannot_run_raises_card_error(tmp_path):
    card = relu_card((8,))
    card.op = "aten::linalg_cholesky.default"  # rejects a 1-D input: the card, not the kernel, is broken
    with make_evaluator(tmp_path, backend="fake", **FAST) as p:
        with pytest.raises(CardError, match="eager aten::linalg_cholesky.default fails"):
            p.evaluate(card, fake("relu_good"))


def test_beyond_roofline_is_flagged_and_kept_when_revalidation_passes(tmp_path, card):
    slow_hbm = dict(FAST, backend_options={"bandwidth": 1.0})  # 1 B/s: every kernel beats the "floor"
    with make_evaluator(tmp_path, backend="fake", **slow_hbm) as p:
        r = p.evaluate(card, fake("relu_good"))
        assert "beyond_roofline" in r.flags and r.verdict in (Verdict.VALID, Verdict.SLOWER)


def _judge(tmp_path, card, kernel: str, beats: list, backend=None, baselines=None, **opts):
    o = EvalOptions(**{**FAST, **opts})
    backend = backend or FakeBackend(dispatch=True)
    sets, holdout = prepare(card, tmp_path, backend.device, o.fresh_sets)
    return Judge(backend, card, sets, holdout, fake(kernel), o, lambda ph, b: beats.append((ph, b)), baselines)


def _always(verdict):
    return lambda kernel, eager: (verdict, f"forced {verdict.value}")


def test_latency_as_dispatched_goes_through_the_guard_path(tmp_path, card, monkeypatch):
    monkeypatch.setattr("kforge.validate.speed_verdict", _always(Verdict.VALID))  # CPU timing is noise
    r, fatal = _judge(tmp_path, card, "relu_good", []).run()
    assert r.verdict is Verdict.VALID and not fatal, r.message
    assert r.dispatched_us > 0 and r.eager_dispatched_us > 0 and "not_dispatched" not in r.evidence
    assert r.evidence["dispatched"]["n"] == 5  # FakeBackend.time_as_called's rounds


def test_a_kernel_slower_than_eager_is_not_timed_as_dispatched(tmp_path, card, monkeypatch):
    """A loser on the GPU can only lose as dispatched: the search does not pay for that timing."""
    monkeypatch.setattr("kforge.validate.speed_verdict", _always(Verdict.SLOWER))
    beats: list = []
    r, _ = _judge(tmp_path, card, "relu_good", beats).run()
    assert r.verdict is Verdict.SLOWER and r.dispatched_us is None
    assert "not faster than eager" in r.evidence["not_dispatched"]
    assert [p for p, _ in beats][-2:] == ["timing", "revalidating"]


def test_the_cards_reference_under_torch_compile_is_timed_with_eager_and_the_kernel_and_compiled_once(
        tmp_path, card, monkeypatch):
    monkeypatch.setattr("kforge.validate.speed_verdict", _always(Verdict.VALID))
    backend, compiled = FakeBackend(dispatch=True), []
    real = backend.compile_reference
    monkeypatch.setattr(backend, "compile_reference", lambda c: compiled.append(c.id) or real(c))
    baselines, beats = Baselines(), []
    for kernel in ("relu_good", "relu_good"):  # two candidates of one card: one compile
        r, fatal = _judge(tmp_path, card, kernel, beats, backend, baselines, compile_baseline=True).run()
        assert r.verdict is Verdict.VALID and not fatal, r.message
        assert r.compile_us > 0 and r.evidence["compiled"]["n"] == r.evidence["kernel"]["n"] == 5
        assert r.compile_us == r.evidence["compiled"]["median_us"] and "compile_error" not in r.evidence
    assert compiled == [card.id]
    assert [p for p, _ in beats].count("compiling the torch.compile baseline") == 1
    assert EvalResult.from_json(r.to_json()).compile_us == r.compile_us


def test_a_card_torch_compile_cannot_compile_records_why_and_no_compile_time(tmp_path, card, monkeypatch):
    monkeypatch.setattr("kforge.validate.speed_verdict", _always(Verdict.VALID))
    backend = FakeBackend(dispatch=True, compile_backend="evalkit:failing_compile_backend")
    r, fatal = _judge(tmp_path, card, "relu_good", [], backend, compile_baseline=True).run()
    assert r.verdict is Verdict.VALID and not fatal and r.compile_us is None and "compiled" not in r.evidence
    assert r.evidence["compile_error"].startswith("torch.compile cannot compile aten::relu.default alone: ")
    assert "this op cannot be compiled here" in r.evidence["compile_error"]


def test_without_the_compile_baseline_nothing_is_compiled(tmp_path, card, monkeypatch):
    backend = FakeBackend(dispatch=True)
    monkeypatch.setattr(backend, "compile_reference", lambda c: pytest.fail("compiled a baseline"))
    r, _ = _judge(tmp_path, card, "relu_good", [], backend).run()
    assert r.compile_us is None and "compile_error" not in r.evidence


def test_guard_misses_are_not_reported_as_latency_as_dispatched(card):
    """Every call falling back to eager would time eager under the kernel's name."""
    backend, cand = FakeBackend(dispatch=True), fake("relu_good")
    kernel = backend.load(cand, backend.compile(cand))
    eager, dispatched = backend.time_dispatched(card, cand, kernel, card.random_inputs(1, "cpu"), EvalOptions())
    assert eager.n == dispatched.n == 5
    other_shape = [torch.randn(3, 5)]
    with pytest.raises(NotDispatched, match=r"35 of 35 calls fell back to eager \({'shape': 35}\)"):
        backend.time_dispatched(card, cand, kernel, other_shape, EvalOptions())


def test_each_timing_phase_has_a_heartbeat_that_fits_its_work(tmp_path, monkeypatch):
    """Timing as dispatched calls a kernel (rounds + 2) x (calls + 1) times: a kernel of a
    few ms must not be killed as a hang under a budget sized for the timed reps."""
    monkeypatch.setattr("kforge.validate.speed_verdict", _always(Verdict.VALID))  # winners get every phase
    beats: list[tuple[str, float]] = []
    result, fatal = _judge(tmp_path, relu_card(), "relu_sleepy", beats, timeout_s=2.0, far_slower=1e9).run()
    assert not fatal, result.message
    budgets = dict(beats)
    assert list(budgets)[-4:] == ["timing", "timing (kernel alone)", "timing as dispatched", "revalidating"]
    assert budgets["timing as dispatched"] >= 2.0 + 3 * as_called_calls() * 0.005


def test_vendor_label_is_flagged(pool, card):
    r = pool.evaluate(card, fake("relu_good", kind="vendor"))
    assert "vendor_wrapper" in r.flags


def test_processes_and_memory_stay_bounded(tmp_path, card):
    others = set(mp.active_children())  # the module's pool
    with make_evaluator(tmp_path, backend="fake", restart_every=4, **FAST) as p:
        h = p.handles[0]
        rss = []
        for i in range(10):
            r = p.evaluate(card, fake("relu_good"))
            assert r.verdict in (Verdict.VALID, Verdict.SLOWER)
            assert len(set(mp.active_children()) - others) <= 1
            if h.pid is not None:
                rss.append(h.ping()["rss_bytes"])
        assert h.starts == 3  # restarted after candidates 4 and 8
        assert max(rss) < 2 * min(rss)
    assert set(mp.active_children()) - others == set()


def test_worker_that_does_not_leave_is_killed_not_abandoned(monkeypatch):
    """A worker told to go (or leaving after a poisoned context) that hangs on its way out
    must not keep holding its GPU once the handle moves on."""
    monkeypatch.setattr(WorkerHandle, "join_s", 0.5)
    h = WorkerHandle(0, "fake", EvalOptions())
    h._proc = h._ctx.Process(target=time.sleep, args=(60,), daemon=True)
    h._proc.start()
    pid = h._proc.pid
    assert h._reap() == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_pool_is_thread_safe_across_devices(tmp_path, card):
    from concurrent.futures import ThreadPoolExecutor

    with make_evaluator(tmp_path, backend="fake", devices=[0, 1], **FAST) as p:
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(lambda n: p.evaluate(card, fake(n)), ["relu_good", "relu_zeros"] * 3))
        assert [r.verdict is Verdict.INCORRECT for r in results] == [False, True] * 3
        assert {h.starts for h in p.handles} == {1}


def test_make_evaluator_rejects_unknown_options(tmp_path):
    with pytest.raises(TypeError, match="min_rep"):
        make_evaluator(tmp_path, backend="fake", min_rep=3)


def test_cuda_backend_without_a_gpu_raises(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from kforge.errors import CudaUnavailableError

    with pytest.raises(CudaUnavailableError):
        make_evaluator(tmp_path)


# ---- compile only (NVRTC, no GPU) ---------------------------------------------------------

FAULT_KERNELS = Path(__file__).parent / "gpu" / "kernels"


def _nvrtc_or_skip():
    from kforge import cuda
    from kforge.errors import CudaUnavailableError

    try:
        cuda.load_nvrtc()
    except CudaUnavailableError as e:
        pytest.skip(f"NVRTC unavailable: {e}")


@pytest.mark.parametrize("case", json.loads((FAULT_KERNELS / "cases.json").read_text())["cases"], ids=lambda c: c["name"])
def test_fault_injection_kernels_compile_only(case):
    """The GPU suite only means something if its bad kernels fail at run time, not at compile time."""
    _nvrtc_or_skip()
    from kforge.candidate import Candidate, LaunchPlan

    plan = {"kernels": [{"name": n, "grid": g, "block": b, "args": a} for n, g, b, a in case["kernels"]],
            "workspace": case.get("workspace", [])}
    cand = Candidate((FAULT_KERNELS / case["file"]).read_text(), LaunchPlan.from_json(plan))
    card = {"relu": relu_card, "softmax": softmax_card, "row_sum": _row_sum_card}[case["card"]]()
    r = CompileOnlyEvaluator("sm_90").evaluate(card, cand)
    if case["name"] == "vendor_cub":
        assert r.verdict is Verdict.INCORRECT and r.evidence["check"] == "mislabelled_vendor"
    else:
        assert r.verdict is Verdict.UNTIMED, r.message
        assert r.evidence["cubin_bytes"] > 0 and r.evidence["arch"] == "sm_90"


def _row_sum_card():
    from evalkit import make_card

    return make_card(torch.ops.aten.sum.dim_IntList, torch.randn(4, 8), [-1])


def test_compile_only_reports_the_log_and_missing_kernels():
    _nvrtc_or_skip()
    from kforge.candidate import Candidate, LaunchPlan

    plan = LaunchPlan.from_json({"kernels": [{"name": "relu", "grid": [1], "block": [32], "args": [{"in": 0}, {"out": 0}]}]})
    broken = Candidate('extern "C" __global__ void relu(const float* x, float* y) { y[0] = x[0] +; }', plan)
    r = CompileOnlyEvaluator("sm_90").evaluate(relu_card(), broken)
    assert r.verdict is Verdict.COMPILE_ERROR and "expected an expression" in r.compile_log
    misnamed = Candidate('extern "C" __global__ void relu2(const float* x, float* y) { y[0] = x[0]; }', plan)
    r = CompileOnlyEvaluator("sm_90").evaluate(relu_card(), misnamed)
    assert r.verdict is Verdict.LOAD_ERROR and r.evidence["missing_kernels"] == ["relu"]


def test_ctrl_c_in_the_terminal_does_not_kill_a_worker(tmp_path, card):
    """SIGINT reaches the whole process group; the parent decides when to stop, so a worker
    must outlive it rather than leave a false "worker died" verdict behind."""
    with make_evaluator(tmp_path, backend="fake", **FAST) as p:
        assert p.evaluate(card, fake("relu_good")).verdict in (Verdict.VALID, Verdict.SLOWER)
        pid = p.handles[0].pid
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        r = p.evaluate(card, fake("relu_good"))
        assert r.verdict in (Verdict.VALID, Verdict.SLOWER), r.message
        assert p.handles[0].pid == pid and p.handles[0].starts == 1


_PARENT = """
import os, sys, threading, time
sys.path.insert(0, {tests!r})
from evalkit import fake, relu_card
from kforge.evaluate import make_evaluator
card = relu_card()
p = make_evaluator({run!r}, backend="fake", timeout_s=600.0, min_reps=5, min_ms=0.0, warmup_ms=0.0, fresh_sets=3,
                   compile_baseline=False)
p.evaluate(card, fake("relu_good"))
threading.Thread(target=p.evaluate, args=(card, fake("relu_hang")), daemon=True).start()
time.sleep(1.0)  # the worker is inside the hung kernel
print(p.handles[0].pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_worker_inside_a_hung_kernel_ends_when_its_parent_is_killed(tmp_path):
    """A SIGKILLed `kforge run` (or Ray actor) cannot stop its worker, and a worker stuck in a
    kernel does not read the pipe that would tell it: it must notice the parent is gone."""
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(tests=str(Path(__file__).parent), run=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "the worker outlived its killed parent"
    finally:
        parent.kill()
        parent.wait(10)
        parent.stdout.close()


@pytest.mark.parametrize("text, name", [
    ("CUDA error in kforge's kernel for aten::relu.default: CUDA_ERROR_MISALIGNED_ADDRESS: misaligned address",
     "CUDA_ERROR_MISALIGNED_ADDRESS"),  # the C++ dispatch path names the driver's error
    ("CUDA error: an illegal memory access was encountered", "CUDA_ERROR_ILLEGAL_ADDRESS"),  # torch's wording
    ("CUDA error: something new", "CUDA_ERROR_UNKNOWN"),
])
def test_device_errors_raised_as_runtime_errors_get_their_driver_name(text, name):
    from kforge.backends import CudaBackend

    fault = CudaBackend.fault(None, RuntimeError(text))
    assert fault is not None and fault.cuda_error == name
    assert CudaBackend.fault(None, RuntimeError("shape mismatch")) is None


def test_out_of_memory_outside_a_kernel_gives_cached_blocks_back_and_tries_once_more(tmp_path, card, monkeypatch):
    """The worker loop in this process (a pipe for the parent): preparing the card's input sets
    runs out of memory once; the worker empties the allocator's cache and judges the candidate."""
    from kforge import worker

    calls, released, handling = [0], [0], []

    def prepare_once_oom(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        handling.append(sys.exc_info()[1])  # the first try's error, and its frames' tensors, are gone
        return prepare(*args, **kwargs)

    real_release = worker.release_cached_memory
    monkeypatch.setattr(worker, "prepare", prepare_once_oom)
    monkeypatch.setattr(worker, "release_cached_memory", lambda: (released.__setitem__(0, released[0] + 1), real_release()))
    parent, child = mp.Pipe()
    from kforge.worker_protocol import Request

    parent.send(Request("evaluate", 1, card.to_json(), str(tmp_path), fake("relu_good").to_json()).__dict__)
    parent.send(Request("shutdown").__dict__)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        worker.main(child, "fake", 0, {**FAST, "timeout_s": 2.0})
    finally:
        signal.signal(signal.SIGINT, sigint)  # the worker ignores Ctrl-C; this process must not
    messages = []
    while parent.poll():
        messages.append(parent.recv())
    (result,) = [m for m in messages if m["kind"] == "result"]
    assert EvalResult.from_json(result["result"]).verdict in (Verdict.VALID, Verdict.SLOWER)
    assert calls[0] == 2 and released[0] >= 2  # one for the new card, one for the retry
    assert handling == [None]
