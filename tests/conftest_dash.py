"""Search logs for the dashboard tests.

`write_demo_run` writes a run with SearchLog directly: several cards, a tree of candidates
with every verdict, repairs, LLM calls, events and a .cast package, so every view has
something to show and the data tests can assert exact groupings.

`make_demo_run` is what a user would see: a real `kforge.runner.run` on a tiny CPU model
with the deterministic fake proposer and evaluator of tests/fakes.py (no GPU needed).

Both capture TinyModel for real on the CPU, so card shares are measured and vary a little
from run to run: tests take the ranking from the log, not from here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fakes import FakeEvaluator, FakeProposer

from kforge import castfile, runner
from kforge.candidate import Candidate, LaunchPlan
from kforge.capture import capture, skip_reason
from kforge.cards import Card
from kforge.hardware import H200
from kforge.log import SearchLog, connect
from kforge.verdict import EvalResult, Verdict

LLM = "llm:demo-coder"


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


def make_demo_run(tmp_path: Path) -> DemoRun:
    run_dir = tmp_path / "real-run"
    # The runner's GPU seam says "one GPU" so the search runs its full budget and packages;
    # the fake evaluator gives the verdicts, so nothing touches a GPU (CPU-captured cards
    # all fall back in the package).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "gpu_devices", lambda devices: [0])
        result = runner.run(TinyModel().eval(), (torch.randn(32, 64),), out=run_dir / "model.cast",
                            proposer=FakeProposer, iterations=10, run_dir=run_dir, progress=False,
                            model_name="TinyModel", evaluator_factory=lambda run_dir, device: FakeEvaluator())
    return DemoRun(run_dir, result.run_id, *_ranked(run_dir, result.run_id), real=True)


# ---- a run written row by row ------------------------------------------------------------

def _demo_cards(run_dir: Path) -> list[Card]:
    """TinyModel's cards, captured for real on the CPU (ranked by share)."""
    return capture(TinyModel().eval(), (torch.randn(32, 64),), run_dir).cards


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
    log = SearchLog(run_dir)
    log.start_run(run_id, model="TinyModel", config={"proposer": "builtin"},
                  device="NVIDIA H200", arch="sm_90", torch=torch.__version__, kforge="0.1.0")
    log.event(run_id, "start", f"searching {len(cards)} cards")
    for card in cards:
        log.upsert_card(run_id, card, floor_us=H200.floor_us(card.io_bytes()))
    by_op = {c.op: c for c in cards}
    main, second, third = (by_op[f"aten::{op}.default"] for op in ("gelu", "_softmax", "native_layer_norm"))
    ids = _write_tree(log, run_id, main, TREE)
    _write_tree(log, run_id, second, [("a", None, None, 0, "builtin", 256, 1, "valid", 1.2, ""),
                                      ("b", "a", None, 1, "builtin", 256, 4, "compile_error", None,
                                       'kernel.cu(5): error: identifier "blockDimx" is undefined'),
                                      ("c", "a", None, 2, "builtin", 64, 1, "slower", 0.9, "")])
    _write_tree(log, run_id, third, [("a", None, None, 0, LLM, 256, 1, "valid", 1.1, "")])
    log.set_card_status(run_id, main.id, "done")
    log.set_card_status(run_id, second.id, "done")
    log.set_card_status(run_id, third.id, "searching")
    for extra in cards:
        if extra not in (main, second, third):
            why = skip_reason(extra) or "below min_share 1.00%"
            log.set_card_status(run_id, extra.id, "skipped", why)
            log.event(run_id, "skip", why, card_id=extra.id)
    for key in ("e", "f", "g", "j"):
        log.add_llm_call(run_id, main.id, LLM.removeprefix("llm:"), prompt_tokens=1800, completion_tokens=600,
                         cost_usd=0.0125, duration_s=4.2, candidate_id=ids[key], base_url="http://localhost:9/v1")
    log.add_llm_call(run_id, main.id, "demo-coder", status="error", error="HTTP 429: rate limited", duration_s=0.3)
    log.add_llm_call(run_id, third.id, "demo-coder", prompt_tokens=1500, completion_tokens=500, cost_usd=0.01,
                     duration_s=3.1)
    log.event(run_id, "llm", "rate limited; retrying in 2 s", level="warning", card_id=main.id)
    log.event(run_id, "card_done", "best 2.90x after 9 iterations", card_id=main.id)
    log.event(run_id, "model-check", f"{(run_dir / 'model.cast').resolve()}: {DEMO_MODEL_CHECK}")
    log.close()
    _write_package(run_dir / "model.cast", run_id, main, second, ids)
    ranked, _ = _ranked(run_dir, run_id)
    return DemoRun(run_dir, run_id, ranked, [main.id, second.id, third.id], real=False)


def _write_tree(log: SearchLog, run_id: str, card: Card, tree: list[tuple]) -> dict[str, int]:
    eager = card.eager_us or 10.0
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
            result.max_abs_err, result.max_rel_err = 2e-7, 1e-6
            result.evidence = {"tolerance": {"atol": 1e-5, "rtol": 1e-5},
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


def _write_package(path: Path, run_id: str, won: Card, lost: Card, ids: dict[str, int]) -> None:
    """A manifest in kforge.package's format (written by hand: packaging CPU-captured cards
    would, rightly, dispatch nothing)."""
    def entry(card: Card, decision: str, reason: str, kind: str, speedup: float, cand: int | None) -> dict:
        return {"id": card.id, "op": card.op, "summary": card.summary(), "decision": decision, "reason": reason,
                "kind": kind, "timing": {"eager_us": card.eager_us, "kernel_us": card.eager_us / speedup,
                                         "eager_dispatched_us": card.eager_us + 3.0,
                                         "dispatched_us": card.eager_us / speedup + 2.0, "noise_us": 0.2},
                "error": {"max_abs_err": 2e-7, "max_rel_err": 1e-6, "tolerances": {"atol": 1e-5, "rtol": 1e-5}},
                "candidate": {"log_id": cand} if cand else None}

    manifest = {
        "format": 1, "kforge": "0.1.0", "torch": torch.__version__, "cuda": {"nvrtc": "13.0", "torch_cuda": "13.0"},
        "gpu": {"name": "NVIDIA H200", "arch": "sm_90"}, "run_id": run_id,
        "cards": [entry(won, "dispatched", "2.90x faster than eager as dispatched", "custom", 2.9, ids["j"]),
                  entry(lost, "fallback", "not faster than eager as dispatched", "vendor", 1.2, None)],
    }
    castfile.write_zip(path, {"manifest.json": json.dumps(manifest).encode()})


def import_dash_app():
    """The dashboard package: the repo's dash_app/ (installed wheels have it as kforge.dash_app)."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    import dash_app

    return dash_app
