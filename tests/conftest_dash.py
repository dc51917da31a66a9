"""Search logs for the dashboard tests, every one written by kforge's own writers.

`write_demo_run` writes a run with SQLiteStore directly: several cards, a tree of candidates
with every verdict, repairs, LLM calls (named as the search names them), events, and a .cast
package written by `kforge.package.write_package`, so every view has something to show and
the data tests can assert exact groupings.

`make_demo_run` is what a user would see: a real `kforge.runner.run` on a tiny CPU model
with the deterministic fake proposer and evaluator of tests/fakes.py (no GPU needed).
`write_capture_only`, `make_compile_only_run` and `make_llm_error_run` are the other runs a
user can make: a capture without a search, a run on a machine without a GPU, and a run whose
LLM endpoint never gives a usable answer (the real LLM proposer against tests/llm_server.py).

All capture TinyModel for real on the CPU, so card shares are measured and vary a little
from run to run: tests take the ranking from the log, not from here. No fixture writes a
log row or manifest field by hand: a reader can only pass on the formats kforge writes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fakes import FakeEvaluator, FakeProposer
from llm_server import ScriptedLLMServer, error, reply

from kforge import inputsets, runner
from kforge.candidate import Candidate, LaunchPlan
from kforge.capturing import capture
from kforge.cardtable import skip_reason
from kforge.cards import Card
from kforge.hardware import H200
from kforge.store import SQLiteStore, connect
from kforge.package import write_package
from kforge.proposers.llm import LLMConfig, LLMProposer
from kforge.verdict import EvalResult, Verdict

LLM_MODEL = "demo-coder"
LLM = f"llm:{LLM_MODEL}"  # LLMProposer's name: what the search writes as proposer and LLM call model


@dataclass
class DemoRun:
    run_dir: Path
    run_id: str
    card_ids: list[str]  # ranked by share
    searched: list[str]  # cards with candidates; written runs: the big tree first
    real: bool  # made by kforge.runner.run rather than written row by row


def _ranked(run_dir: Path, run_id: str) -> tuple[list[str], list[str]]:
    conn = connect(run_dir, readonly=True)
    try:
        ranked = [r[0] for r in conn.execute("SELECT card_id FROM cards WHERE run_id=? "
                                             "ORDER BY COALESCE(share, 0) DESC, card_id", (run_id,))]
        searched = [r[0] for r in conn.execute("SELECT card_id FROM candidates WHERE run_id=? GROUP BY card_id "
                                               "ORDER BY COUNT(*) DESC, card_id", (run_id,))]
    finally:
        conn.close()
    return ranked, searched


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(torch.nn.functional.gelu(self.fc(x))), dim=-1)


def _real_run(run_dir: Path, *, gpu: bool, evaluator, proposer=FakeProposer, iterations: int = 10):
    """kforge.runner.run on TinyModel with the runner's GPU seam set to one GPU or none."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "gpu_devices", lambda devices: [0] if gpu else [])
        return runner.run(TinyModel().eval(), (torch.randn(32, 64),), out=run_dir / "model.cast",
                          proposer=proposer, iterations=iterations, run_dir=run_dir, progress=False,
                          model_name="TinyModel", evaluator_factory=evaluator)


def make_demo_run(tmp_path: Path) -> DemoRun:
    # The runner's GPU seam says "one GPU" so the search runs its full budget and packages;
    # the fake evaluator gives the verdicts (with the tolerances the worker derives), so nothing
    # touches a GPU (CPU-captured cards all fall back in the package).
    run_dir = tmp_path / "real-run"
    result = _real_run(run_dir, gpu=True, evaluator=lambda run_dir, device: FakeEvaluator(evidence_dir=run_dir))
    return DemoRun(run_dir, result.run_id, *_ranked(run_dir, result.run_id), real=True)


def write_capture_only(tmp_path: Path) -> Path:
    """What `kforge capture` leaves: cards and capture.json, no search log."""
    return capture(TinyModel().eval(), (torch.randn(32, 64),), tmp_path / "capture-only").run_dir


def make_compile_only_run(tmp_path: Path) -> DemoRun:
    """`kforge run` on a machine without a GPU: candidates compiled, nothing timed, no package."""
    run_dir = tmp_path / "compile-only"
    result = _real_run(run_dir, gpu=False, evaluator=lambda run_dir, device: FakeEvaluator(untimed=True))
    return DemoRun(run_dir, result.run_id, *_ranked(run_dir, result.run_id), real=True)


def make_llm_error_run(tmp_path: Path) -> DemoRun:
    """A run whose LLM endpoint answers, and is paid, but never with a usable kernel; every
    third request fails with HTTP 500. The real LLMProposer and search write what that costs."""
    answers = iter(range(10**6))

    def respond(body: dict):
        return error(500, "upstream overloaded") if next(answers) % 3 == 2 else reply("I cannot write that kernel.",
                                                                                   usage=(1000, 200))

    run_dir = tmp_path / "llm-errors"
    with ScriptedLLMServer(api_key="k", models={LLM_MODEL}, responder=respond) as server:
        config = LLMConfig(model=LLM_MODEL, base_url=server.base_url, api_key="k", max_retries=0,
                           max_repair_attempts=1, prices={LLM_MODEL: (1.0, 5.0)})
        result = _real_run(run_dir, gpu=True, evaluator=lambda run_dir, device: FakeEvaluator(),
                           proposer=lambda: LLMProposer(config), iterations=2)
    return DemoRun(run_dir, result.run_id, *_ranked(run_dir, result.run_id), real=True)


# ---- a run written row by row ------------------------------------------------------------

def _demo_cards(run_dir: Path) -> list[Card]:
    """TinyModel's cards, captured for real on the CPU (ranked by share) and retargeted to the
    H200 as a GPU capture would have them. Each takes at least 20 µs, so the package's rule
    (faster as dispatched, beyond noise) decides by the speedups below, not the CPU's timing."""
    cards = [c.retarget("cuda", H200.arch) for c in capture(TinyModel().eval(), (torch.randn(32, 64),), run_dir).cards]
    for c in cards:
        if c.eager_us is not None:
            c.eager_us = max(c.eager_us, 20.0)
    return cards


def kernel(name: str, threads: int, vec: int, bug: str = "") -> Candidate:
    """A plausible CUDA kernel whose source changes with its knobs (so diffs show something)."""
    load = "x[i]" if vec == 1 else f"reinterpret_cast<const float{vec}*>(x)[i / {vec}].x"
    source = (f'extern "C" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, int n) {{\n'
              f"  // threads={threads} vec={vec}\n"
              f"  int i = (blockIdx.x * blockDim.x + threadIdx.x) * {vec};\n"
              f"  if (i < n) {{\n"
              f"    float v = {load};{bug}\n"
              f"    y[i] = v * 0.5f * (1.0f + erff(v * 0.70710678f));\n"
              f"  }}\n}}\n")
    launch = {"name": name, "grid": [max(2048 // (threads * vec), 1), 1, 1], "block": [threads, 1, 1],
              "args": [{"in": 0}, {"out": 0}, {"i32": 2048}]}
    plan = LaunchPlan.from_json({"kernels": [launch]})
    return Candidate(source, plan, proposer="builtin", knobs={"threads": threads, "vec": vec})


# (key, parent key, repair-of key, iteration, proposer, threads, vec, verdict, speedup, message)
TREE = [
    ("a", None, None, 0, "builtin", 256, 1, "valid", 1.3, ""),
    ("b", None, None, 1, "builtin", 128, 4, "compile_error", None,
     'kernel.cu(5): error: identifier "blockDimx" is undefined'),
    ("c", None, "b", 1, "builtin", 128, 2, "valid", 1.6, ""),
    ("d", "a", None, 2, "builtin", 512, 1, "incorrect", None, "max abs err 0.31 > atol 1e-05 at index 17"),
    ("e", "a", None, 3, LLM, 256, 4, "valid", 2.4, ""),
    ("f", "e", None, 4, LLM, 1024, 4, "runtime_error", None,
     "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"),
    ("g", "e", "f", 4, LLM, 1024, 2, "hang", None, "kernel did not finish in 5.0 s; worker restarted"),
    ("h", "e", None, 5, "builtin", 64, 4, "slower", 0.8, ""),
    ("i", "c", None, 6, "builtin", 128, 1, "load_error", None,
     "CUDA_ERROR_NOT_FOUND: named symbol not found: gelu_rowz"),
    ("j", "e", None, 7, LLM, 256, 2, "valid", 2.9, ""),
    ("k", "j", None, 8, "builtin", 512, 2, "incorrect", None, "max abs err 0.12 > atol 1e-05 at index 4"),
]


DEMO_MODEL_CHECK = ("model forward on cuda:0: eager 1234.0 µs (iqr 5.0), with the package 1100.0 µs (iqr 4.0): "
                    "1.122x, faster")


def write_demo_run(tmp_path: Path, run_id: str = "demo-run") -> DemoRun:
    run_dir = tmp_path / "written-run"
    cards = _demo_cards(run_dir)
    log = SQLiteStore(run_dir)
    log.start_run(run_id, model="TinyModel",
                  config={"proposer": "builtin", "validated": True, "out": str((run_dir / "model.cast").resolve())},
                  device=H200.name, arch=H200.arch, torch=torch.__version__, kforge="0.1.0")
    log.event(run_id, "start", f"searching {len(cards)} cards")
    for card in cards:
        log.upsert_card(run_id, card, floor_us=H200.floor_us(card.io_bytes()))
    by_op = {c.op: c for c in cards}
    main, second, third = (by_op[f"aten::{op}.default"] for op in ("gelu", "_softmax", "native_layer_norm"))
    ids = _write_tree(log, run_dir, run_id, main, TREE)
    _write_tree(log, run_dir, run_id, second, [("a", None, None, 0, "builtin", 256, 1, "valid", 1.02, ""),
                                               ("b", "a", None, 1, "builtin", 256, 4, "compile_error", None,
                                                'kernel.cu(5): error: identifier "blockDimx" is undefined'),
                                               ("c", "a", None, 2, "builtin", 64, 1, "slower", 0.9, "")])
    _write_tree(log, run_dir, run_id, third, [("a", None, None, 0, LLM, 256, 1, "valid", 1.02, "")])
    log.set_card_status(run_id, main.id, "done")
    log.set_card_status(run_id, second.id, "done")
    log.set_card_status(run_id, third.id, "searching")
    for extra in cards:
        if extra not in (main, second, third):
            why = skip_reason(extra) or "below min_share 1.00%"
            log.set_card_status(run_id, extra.id, "skipped", why)
            log.event(run_id, "skip", why, card_id=extra.id)
    for key in ("e", "f", "g", "j"):
        log.add_llm_call(run_id, main.id, LLM, prompt_tokens=1800, completion_tokens=600,
                         cost_usd=0.0125, duration_s=4.2, candidate_id=ids[key], base_url="http://localhost:9/v1")
    log.add_llm_call(run_id, main.id, LLM, status="error", error="HTTP 429: rate limited", duration_s=0.3)
    log.add_llm_call(run_id, third.id, LLM, prompt_tokens=1500, completion_tokens=500, cost_usd=0.01,
                     duration_s=3.1)
    log.event(run_id, "llm", "rate limited; retrying in 2 s", level="warning", card_id=main.id)
    log.event(run_id, "card_done", "best 2.90x after 9 iterations", card_id=main.id)
    log.event(run_id, "model-check", f"{(run_dir / 'model.cast').resolve()}: {DEMO_MODEL_CHECK}")
    log.close()
    write_package(run_dir, run_dir / "model.cast", run_id=run_id)
    ranked, _ = _ranked(run_dir, run_id)
    return DemoRun(run_dir, run_id, ranked, [main.id, second.id, third.id], real=False)


def _write_tree(log: SQLiteStore, run_dir: Path, run_id: str, card: Card, tree: list[tuple]) -> dict[str, int]:
    eager = card.eager_us
    tolerances: dict = {}  # what the worker records for a kernel that passed every input set
    for s in inputsets.prepare(card, run_dir, torch.device("cpu"), fresh_sets=1)[0]:
        inputsets.record_tolerances(tolerances, s)
    ids: dict[str, int] = {}
    for key, parent, repair_of, iteration, proposer, threads, vec, verdict, speedup, message in tree:
        cand = kernel("gelu_rows", threads, vec, bug=" blockDimx;" if verdict == "compile_error" else "")
        cand.proposer = proposer
        v = Verdict(verdict)
        result = EvalResult(v, message=message)
        if v == Verdict.COMPILE_ERROR:
            result.compile_log = f"{message}\n\n1 error detected in the compilation of \"kernel.cu\"."
        if speedup is not None:
            result.eager_us, result.kernel_us = eager, eager / speedup
            result.dispatched_us = result.kernel_us + 2.0
            result.compile_us = eager  # the card alone under torch.compile: no faster than eager here
            result.max_abs_err, result.max_rel_err = 2e-7, 1e-6
            result.evidence = {**tolerances,
                               "kernel_samples_us": [eager / speedup * (1 + 0.01 * (i % 7)) for i in range(100)],
                               "eager_samples_us": [eager * (1 + 0.01 * (i % 5)) for i in range(100)]}
        if v == Verdict.INCORRECT:
            result.max_abs_err, result.max_rel_err = 0.31, 0.9
            result.evidence = {"worst": {"index": [0, 17], "got": 0.52, "expected": 0.21}, "input_set": "fresh 2"}
        ids[key] = log.add_candidate(run_id, card.id, cand, result, iteration=iteration,
                                     parent_id=ids[parent] if parent else None,
                                     repair_of=ids[repair_of] if repair_of else None,
                                     reward=speedup, eval_s=0.4)
    return ids


def import_dash_app():
    """The dashboard package: the repo's dash_app/ (installed wheels have it as kforge.dash_app)."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    import dash_app

    return dash_app
