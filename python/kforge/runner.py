"""The main job: capture a model, choose its cards, search kernels for each, package the winners.

    result = kforge.run(model, example_inputs, out="model.cast")

Without a CUDA GPU the job still captures, generates and NVRTC-compiles candidates, then
says that validation, timing and packaging need a GPU and returns without a package.
Three module-level functions are the seams to the GPU-side modules (tests replace them):
`gpu_devices`, `default_evaluator` and `package_run`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import queue
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.text import Text

from .card_files import load_cards
from .cards import Card
from .cardtable import module_path, search_order
from .errors import CardError, KforgeError, ProposerUnavailable
from .hardware import Hardware
from .pool import EvaluatorFactory, EvaluatorPool, LocalPool
from .proposers.base import Proposer
from .run_report import CardResult, ProgressView, RunResult
from .search.mcts import Budget, SearchOutcome, search_card
from .spend import Spend
from .store import SQLiteStore
from .verdict import Evaluator

# Without a GPU nothing can be ranked, so only a few first versions per card are compiled:
# enough to check that the proposer's code builds, not a search.
COMPILE_ONLY_ITERATIONS = 3

class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: everything evaluated so far is in the run directory's log."""

    def __init__(self, run_dir: Path, run_id: str):
        super().__init__(f"run {run_id} interrupted; resume it from {run_dir}")
        self.run_dir = run_dir
        self.run_id = run_id


# ---- seams to the GPU-side modules ------------------------------------------------------------

def gpu_devices(devices: Sequence[int] | None) -> list[int]:
    """The GPU ordinals to evaluate on: `devices`, or every visible GPU; [] without CUDA
    (then asking for devices is an error: they would be silently ignored)."""
    from . import cuda

    if not cuda.available():
        if devices:
            raise KforgeError(f"GPU {', '.join(map(str, devices))} asked for (--devices), but no CUDA GPU is usable "
                              f"here (`kforge doctor` says why); leave out --devices to only generate and compile "
                              f"kernels")
        return []
    import torch

    count = torch.cuda.device_count()
    if devices is None:
        return list(range(count))
    # One worker per GPU: a repeated ordinal would time two candidates on one GPU at once.
    chosen = list(dict.fromkeys(devices))
    missing = [d for d in chosen if not 0 <= d < count]
    if missing:
        raise KforgeError(f"no GPU {', '.join(map(str, missing))} here: {count} visible (ordinals 0 to {count - 1}); "
                          "check --devices and CUDA_VISIBLE_DEVICES")
    return chosen


def default_evaluator(run_dir: Path, device: int | None) -> Evaluator:
    """One evaluator per GPU (a worker process that owns it); compile-only without a GPU."""
    from . import evaluate

    if device is None:
        from .compiler import default_arch

        return evaluate.CompileOnlyEvaluator(default_arch())
    return evaluate.make_evaluator(run_dir, devices=[device])


def package_run(run_dir: Path, out: str | Path, run_id: str) -> Path:
    from .package import write_package

    return write_package(run_dir, out, run_id=run_id)


# ---- choosing cards -----------------------------------------------------------------------

def _asked_for(card: Card, ops: Sequence[str] | None) -> bool:
    """The card is among the ops asked for: no `ops`, or its op name contains one of them."""
    return not ops or any(o in card.op for o in ops)


def skip_reason(card: Card, proposer: Proposer, *, min_share: float, include_vendor: bool,
                ops: Sequence[str] | None = None) -> str | None:
    """Why a card is not searched, or None. `ops`: only cards whose op name contains one of these."""
    if not _asked_for(card, ops):
        return f"not among the ops asked for ({', '.join(ops)})"
    if card.family == "vendor":
        if not include_vendor:
            return "backed by a vendor library (cuBLAS/cuDNN); pass include_vendor=True (--include-vendor) to search it"
    else:
        from .cardtable import skip_reason as capture_skip_reason

        why = capture_skip_reason(card)
        if why:
            return why
    if (card.share or 0.0) < min_share:
        return f"{100 * (card.share or 0.0):.2f}% of runtime is below min_share {100 * min_share:.2f}%"
    ok, why = proposer.supports(card)
    return None if ok else f"proposer {proposer.name} declines: {why}"


def _make_proposer(spec: Any, options: dict) -> Proposer:
    if isinstance(spec, str):
        from .proposers import get_proposer

        return get_proposer(spec, **options)
    return spec()


# ---- the job ------------------------------------------------------------------------------

def run(model=None, example_inputs=None, out: str | Path | None = "model.cast", proposer: Any = "builtin",
        iterations: int = 50, run_dir: str | Path | None = None, resume: bool = False, min_share: float = 0.0,
        include_vendor: bool = False, devices: Sequence[int] | None = None, wall_time_s: float | None = None,
        max_cost_usd: float | None = None, seed: int = 0, progress: bool = True, *,
        proposer_options: dict | None = None, evaluator_factory: EvaluatorFactory | None = None,
        cards: Sequence[str] | None = None, ops: Sequence[str] | None = None, console: Console | None = None,
        model_name: str | None = None, check_model: bool = True, leave_one_out: int = 0,
        capture_progress: Callable[[str], None] | None = None, regions: bool = False,
        cluster: str | None = None) -> RunResult:
    """Capture `model` on `example_inputs`, search kernels for its cards and package the winners.

    proposer: "builtin", "llm", "llm:<model>" (options in proposer_options), or a callable
      returning a Proposer (called once per evaluation worker). For "llm", proposer_options
      are LLMConfig settings (base_url, model, price=(prompt, completion) USD per 1M tokens,
      max_reply_tokens, temperature or "none", top_p, reasoning_effort, extra_headers,
      extra_body, config_file, ...); the endpoint is checked before the capture.
    max_cost_usd: a hard limit on the run's LLM spend, checked before every call.
    resume: continue the run in `run_dir` from its cards and search log, without capturing.
    evaluator_factory(run_dir, device): the evaluator of one worker (device None: no GPU);
      default `default_evaluator`. A script that runs many models passes one
      `kforge.evaluate.KeptEvaluators()` to every run: its worker processes stay up between runs.
    cards: only search these card ids.
    ops: only search cards whose op name contains one of these (e.g. ["softmax", "group_norm"]).
    check_model: when a package was written, time the model's forward eager and with the
      package (kforge.modelcheck) and say in result.model_check whether it is faster; where
      the package has kernels for compiled graphs (on a GPU), also under torch.compile and
      kforge.compile, and the package records whether kforge.compile beat torch.compile
      (kforge.compile follows that verdict).
    leave_one_out: when kforge.compile did not beat torch.compile and its graphs ran at most
      this many cards, time it without each of them in turn (0: not at all); a card whose
      removal makes it win is recorded, and kforge.compile leaves it out.
    capture_progress: called with a line as each stage of the capture starts.
    regions: also capture region cards (fused multi-op regions, kforge.region_capture) and
      search them like any card.
    cluster: evaluate on a cluster instead of this machine's GPUs: "ray" (the cluster at
      $RAY_ADDRESS) or "ray://HOST:PORT" (kforge.cluster; docs/cluster.md).
    Ctrl-C raises RunInterrupted (a KeyboardInterrupt) after marking the run interrupted.
    """
    iterations, min_share = _check_options(iterations, min_share, wall_time_s, max_cost_usd)
    if resume:
        if run_dir is None:
            raise KforgeError("resume=True needs run_dir: the directory of the run to continue")
    else:
        if model is None:
            raise KforgeError("run() needs a model and example inputs (or resume=True with a run_dir)")
        if isinstance(proposer, str):  # an unknown, misconfigured or unreachable proposer fails before the capture
            trial = _make_proposer(proposer, proposer_options or {})
            try:
                trial.preflight(Spend(max_cost_usd=max_cost_usd))
            finally:
                trial.close()
        if cluster is None:
            gpu_devices(devices)  # and so do devices that are not here
        else:
            from .cluster import check_cluster

            check_cluster(cluster, devices)  # and a cluster option that cannot work
        from .capturing import capture

        run_dir = capture(model, example_inputs, run_dir, progress=capture_progress, regions=regions).run_dir
        from .worker import release_cached_memory

        release_cached_memory()  # what the capture cached: the workers' now (a 1 GB card's sets OOMed at 41 GB held)
        model_name = model_name or type(model).__name__
    result = search_run(run_dir, out=out, proposer=proposer, iterations=iterations, min_share=min_share,
                        include_vendor=include_vendor, devices=devices, wall_time_s=wall_time_s,
                        max_cost_usd=max_cost_usd, seed=seed, progress=progress, proposer_options=proposer_options,
                        evaluator_factory=evaluator_factory, cards=cards, ops=ops, console=console,
                        model_name=model_name, resume=resume, cluster=cluster)
    if check_model and model is not None and result.package_path is not None:
        _check_model(result, model, example_inputs, leave_one_out=leave_one_out)
    return result


def _check_model(result: RunResult, model, example_inputs, *, load_options: dict | None = None,
                 leave_one_out: int = 0, **install_options) -> None:
    """Time the model eager and with the new package; the verdict goes into the result and
    the run's log. A failure or Ctrl-C here is reported, never raised: the package is
    already written and the run is done."""
    from .package import check_package, load

    where = Path(result.package_path).resolve()  # how the dashboard finds the check of its package
    try:
        pkg = load(result.package_path, **(load_options or {}))
        if not any(c.dispatched or c.compiled for c in pkg.cards):
            return  # nothing is dispatched: the model runs eager and compiles plain either way
        check = check_package(model, example_inputs, pkg, leave_one_out=leave_one_out, **install_options)
        message = f"{where}: {check.message()}"
        record = check.compile_record()
        lost = record is not None and record["use"] == "torch.compile"
        level = "warning" if check.verdict in ("slower", "unused") or lost else "info"
        result.model_check = check
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 (reported to the user and the log)
        why = "interrupted by the user" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        result.model_check_error = why
        message, level = f"{where}: the model check did not complete: {why}", "warning"
    try:
        with SQLiteStore(result.run_dir) as log:
            log.event(result.run_id, "model-check", message, level=level)
    except Exception as e:  # noqa: BLE001 (the result still carries the check)
        result.model_check_error = result.model_check_error or f"could not log the model check: {e}"


def search_run(run_dir: str | Path, *, out: str | Path | None = None, proposer: Any = "builtin",
               iterations: int = 50, min_share: float = 0.0, include_vendor: bool = False,
               devices: Sequence[int] | None = None, wall_time_s: float | None = None,
               max_cost_usd: float | None = None, seed: int = 0, progress: bool = True,
               proposer_options: dict | None = None, evaluator_factory: EvaluatorFactory | None = None,
               cards: Sequence[str] | None = None, ops: Sequence[str] | None = None,
               console: Console | None = None, model_name: str | None = None, resume: bool = True,
               cluster: str | None = None) -> RunResult:
    """Search the cards captured in `run_dir`, then package the winners into `out` (when a GPU
    validated them and `out` is set). With `resume`, the log's latest run is continued
    (what it evaluated is never evaluated again); otherwise a new run starts."""
    iterations, min_share = _check_options(iterations, min_share, wall_time_s, max_cost_usd)
    run_dir = Path(run_dir)
    all_cards = load_cards(run_dir)
    if not all_cards:
        raise CardError(f"no cards in {run_dir}: run `kforge capture MODEL --run-dir {run_dir}` first")
    if not any(_asked_for(c, ops) for c in all_cards):
        captured = sorted({c.op.removeprefix("aten::").split(".")[0] for c in all_cards})
        raise CardError(f"no card's op contains any of {', '.join(ops)}; the ops captured in {run_dir} are: "
                        f"{', '.join(captured)}")
    if cards is not None:
        unknown = set(cards) - {c.id for c in all_cards}
        if unknown:
            raise CardError(f"no card(s) {sorted(unknown)} in {run_dir}; `kforge inspect {run_dir}` lists them")
        all_cards = [c for c in all_cards if c.id in set(cards)]
    factory = evaluator_factory or default_evaluator
    if cluster is None:
        pool: EvaluatorPool = LocalPool(run_dir, gpu_devices(devices), factory)
    else:
        from .cluster import open_pool
        from .evaluate import KeptEvaluators

        if isinstance(factory, KeptEvaluators):
            raise ValueError("KeptEvaluators keeps this machine's worker processes; a cluster's actors own theirs: "
                             "pass it to kforge.run without cluster=")
        pool = open_pool(cluster, run_dir, all_cards, factory, devices)
    validated, hardware = pool.validated, pool.hardware
    if not validated:
        # Without a GPU, kernels are still generated and compiled for the GPU the cards
        # would run on; a CPU capture is retargeted to it.
        all_cards = [c.retarget("cuda", hardware.arch) if c.device_type != "cuda" else c for c in all_cards]
    try:  # the pool may hold a cluster's GPUs: given back on every way out
        log = SQLiteStore(run_dir)
        run_id, finished = _open_run(log, resume, validated, model_name, hardware, dict(
            proposer=proposer if isinstance(proposer, str) else getattr(proposer, "__name__", "custom"),
            iterations=iterations, min_share=min_share, include_vendor=include_vendor, **pool.config,
            wall_time_s=wall_time_s, max_cost_usd=max_cost_usd, seed=seed, ops=list(ops) if ops else None,
            out=str(Path(out).resolve()) if out else None))  # where the dashboard finds the package
        for note in pool.notes:
            log.event(run_id, "cluster", note, level="warning")
            if progress:
                (console or Console(stderr=True)).print(Text(f"warning: {note}", style="yellow"))
    except BaseException:
        pool.close()
        raise
    try:
        budget = Budget(iterations=iterations if validated else min(iterations, COMPILE_ONLY_ITERATIONS),
                        deadline=time.monotonic() + wall_time_s if wall_time_s else None, max_cost_usd=max_cost_usd)
        spend = Spend.from_log(log, run_id, max_cost_usd=budget.max_cost_usd, max_tokens=budget.max_tokens)
        first = _make_proposer(proposer, proposer_options or {})
        try:
            first.preflight(spend)
            chosen = []
            for card in all_cards:
                log.upsert_card(run_id, card, hardware.floor_us(card.io_bytes()))
                why = skip_reason(card, first, min_share=min_share, include_vendor=include_vendor, ops=ops)
                if why:
                    log.set_card_status(run_id, card.id, "skipped", why)
                    log.event(run_id, "skip", why, card_id=card.id)
                else:
                    chosen.append(card)
            from .region_capture import alone_op_cards

            order = search_order(chosen, hardware, alone_op_cards(run_dir))
            outcomes = _search_all(order, first, proposer, proposer_options or {}, pool, run_dir, run_id,
                                   budget, spend, hardware, seed, progress, console, log)
        finally:
            first.close()
        unanswered = [o for o in outcomes.values() if o.stop_reason == "unavailable"]
        if unanswered and len(unanswered) == len(outcomes):
            raise ProposerUnavailable(f"{first.name} gave no answer for any card; the last error: "
                                      f"{unanswered[-1].stop_detail}", transient=True)
        stops = {card_id: o.stop_reason for card_id, o in outcomes.items()}
        log.set_run_status(run_id, "done")
        package_path = package_run(run_dir, out, run_id) if validated and out else None
        table = card_results(log, run_id)
        message = "" if validated else _compile_only_message(log, run_id)
        if finished:
            message = " ".join(filter(None, [
                f"Run {run_id} had finished; it was continued: cards below {iterations} iterations were searched "
                f"further, the others kept their results (resume=False / a new --run-dir starts afresh).", message]))
    except KeyboardInterrupt:
        log.set_run_status(run_id, "interrupted")
        log.event(run_id, "interrupted", "stopped by the user; resume with the same run directory", level="warning")
        raise RunInterrupted(run_dir, run_id) from None
    except BaseException as e:
        log.set_run_status(run_id, "failed")
        log.event(run_id, "failed", f"{type(e).__name__}: {e}", level="error")
        raise
    finally:
        log.close()
        pool.close()
    return RunResult(run_id, run_dir, table, package_path, validated, message, stops)


def _check_options(iterations: Any, min_share: Any, wall_time_s: Any, max_cost_usd: Any) -> tuple[int, float]:
    """Search options that cannot mean anything are refused before any work; (iterations,
    min_share) come back as a Python int and float (numpy scalars are accepted)."""
    if isinstance(iterations, bool) or not isinstance(iterations, numbers.Integral) or iterations < 1:
        raise KforgeError(f"iterations must be a whole number >= 1 (search iterations per card), got {iterations!r}")
    if isinstance(min_share, bool) or not isinstance(min_share, numbers.Real) or not 0.0 <= min_share <= 1.0:
        raise KforgeError(f"min_share is a fraction of the model's runtime, from 0 to 1 (0.02 = 2 %), got {min_share!r}")
    if wall_time_s is not None and not wall_time_s > 0:
        raise KforgeError(f"wall_time_s must be a number of seconds > 0, got {wall_time_s!r}")
    if max_cost_usd is not None and not max_cost_usd >= 0:
        raise KforgeError(f"max_cost_usd must be a number of US dollars >= 0, got {max_cost_usd!r}")
    return int(iterations), float(min_share)


def _compile_only_message(log: SQLiteStore, run_id: str) -> str:
    """What a run without a GPU did, and that the rest needs one."""
    cards = [c for c in log.cards(run_id) if c.candidates]
    total, searched = sum(c.candidates for c in cards), len(cards)
    untimed = sum(c.verdicts.get("untimed", 0) for c in cards)
    did = (f"{total} candidate(s) for {searched} card(s) were generated and {untimed} compiled with NVRTC" if total
           else "no card could be searched here (see the notes)")
    return (f"No CUDA GPU here: {did}. Validation, timing and packaging need a GPU: run kforge on a machine "
            "with an NVIDIA GPU to get a package.")


def _open_run(log: SQLiteStore, resume: bool, validated: bool, model_name: str | None, hardware: Hardware,
              config: dict) -> tuple[str, bool]:
    """(run id, whether it is a finished run continued): the log's latest run when resuming,
    else a new one. A compile-only run is never continued on a GPU: its untimed candidates
    would count as evaluated and never be measured."""
    import torch

    from . import __version__

    run_id = log.latest_run() if resume else None
    if run_id is not None:
        run = log.run(run_id)
        if run.validated or not validated:
            log.start_run(run_id)
            log.event(run_id, "resume", "search continued from the log")
            return run_id, run.status == "done"
    run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    log.start_run(run_id, model=model_name or "", config=dict(config, validated=validated),
                  device=hardware.name if validated else "cpu", arch=hardware.arch, torch=torch.__version__,
                  kforge=__version__)
    return run_id, False


def fair_share(budget: Budget, cards_left: int, workers: int) -> Budget:
    """The budget of the next card when the run has a deadline: an equal slice of the time
    left, per worker, over the cards not yet started (this one included), so the first cards
    cannot spend the whole run. Time a card leaves unused goes to the cards after it."""
    if budget.deadline is None:
        return budget
    slice_s = max(budget.deadline - time.monotonic(), 0.0) / max(math.ceil(cards_left / workers), 1)
    per_card = slice_s if budget.wall_time_s is None else min(budget.wall_time_s, slice_s)
    return dataclasses.replace(budget, wall_time_s=per_card)


def _search_all(cards: list[Card], first: Proposer, proposer_spec: Any, proposer_options: dict,
                pool: EvaluatorPool, run_dir: Path, run_id: str, budget: Budget,
                spend: Spend, hardware: Hardware, seed: int, progress: bool, console: Console | None,
                log: SQLiteStore) -> dict[str, SearchOutcome]:
    """Search every card: inline with one slot, or one thread per slot of the pool pulling cards
    from a queue, each with its own evaluator, proposer and log connection (SQLite serializes
    writes; all of them are in this process, the one writer of the log).
    `spend` is the run's: every worker's proposer charges it, so its limits are run-wide."""
    view = ProgressView(console, progress)
    for card in cards:
        view.add(card, budget.iterations, log.card_iterations(run_id, card.id), log.card(run_id, card.id).best_speedup)
    outcomes: dict[str, SearchOutcome] = {}
    todo: queue.Queue[Card] = queue.Queue()
    for card in cards:
        todo.put(card)
    cancel = threading.Event()
    busy: dict[int, str] = {}  # slot -> the card its worker is searching

    def work(slot: int, proposer: Proposer, wlog: SQLiteStore) -> None:
        evaluator = pool.evaluator(slot)
        try:
            while not cancel.is_set():
                try:
                    card = todo.get_nowait()
                except queue.Empty:
                    return
                busy[slot] = card.id
                share = fair_share(budget, todo.qsize() + 1, len(pool.slots))
                outcome = search_card(card, proposer, evaluator, wlog, run_id, budget=share, hardware=hardware,
                                      rng_seed=seed, on_progress=view.update, spend=spend, cancel=cancel)
                outcomes[card.id] = outcome
                view.finish(card.id)
                del busy[slot]
        finally:
            evaluator.close()

    with view.progress:
        if len(pool.slots) == 1:
            work(0, first, log)
            return outcomes
        errors: list[BaseException] = []

        def thread_main(slot: int, finished: threading.Event) -> None:
            try:
                proposer = _make_proposer(proposer_spec, proposer_options)
                try:
                    with SQLiteStore(run_dir) as wlog:
                        work(slot, proposer, wlog)
                finally:
                    proposer.close()
            except BaseException as e:  # re-raised in the main thread below
                errors.append(e)
                cancel.set()
            finally:
                finished.set()  # after its log is closed: all it evaluated is committed

        # The main thread waits on these events, not on Thread.join: on Python 3.11 a Ctrl-C
        # landing in join() can mark a live thread finished, and the run would exit while a
        # worker is still writing its candidate. Daemon threads, so that a second Ctrl-C
        # (which stops the wait) is not undone by the interpreter waiting for them at exit.
        done = [threading.Event() for _ in pool.slots]
        for slot, finished in enumerate(done):
            threading.Thread(target=thread_main, args=(slot, finished), name=f"kforge-slot{slot}", daemon=True).start()
        try:
            _wait_all(done)
        except KeyboardInterrupt:
            cancel.set()  # each worker stops after its current candidate is logged
            if progress:
                view.progress.console.print("stopping: the workers log the candidates they are evaluating "
                                            "(Ctrl-C again stops now; those are then marked lost)")
            try:
                _wait_all(done)
            except KeyboardInterrupt:
                for slot, finished in enumerate(done):
                    if not finished.is_set() and slot in busy:
                        log.event(run_id, "lost", f"stopped while the worker on {pool.slots[slot]} was busy with this "
                                  "card: the candidate it had in flight is not in the log (the search proposes "
                                  "again on resume)", level="warning", card_id=busy[slot])
            raise
        if errors:
            raise errors[0]
    return outcomes


def _wait_all(events: list[threading.Event]) -> None:
    for e in events:
        while not e.wait(0.2):  # a timed wait, so Ctrl-C is seen promptly on every platform
            pass


def card_results(log: SQLiteStore, run_id: str) -> list[CardResult]:
    """The per-card table of a run, from its log (a read-only store is enough)."""
    out = []
    for c in log.cards(run_id):
        note = c.skip_reason or ", ".join(f"{n} {v}" for v, n in c.verdicts.items()) or "no candidates"
        out.append(CardResult(c.card_id, c.op, c.family, c.summary, c.status, c.iterations, c.eager_us, c.best_us,
                              c.best_speedup, note, c.eval_s, c.calls, c.share, module_path(Card.from_json(c.card))))
    return out
