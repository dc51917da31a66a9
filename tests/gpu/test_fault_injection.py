"""One deliberately bad kernel per cheat docs/security.md lists, and good kernels, through ONE evaluator
pool on the GPU: every verdict is what its check must give, and the pool survives
crashes and hangs. The kernels and their launch plans are in kernels/ (cases.json);
tests/test_worker.py checks on the CPU that each of them compiles with NVRTC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evalkit import make_card
from kforge.candidate import Candidate, LaunchPlan
from kforge.card_files import save_card, save_sample

KERNELS = Path(__file__).parent / "kernels"
CASES = json.loads((KERNELS / "cases.json").read_text())["cases"]


def candidate(case: dict) -> Candidate:
    plan = {"kernels": [{"name": n, "grid": g, "block": b, "args": a} for n, g, b, a in case["kernels"]],
            "workspace": case.get("workspace", [])}
    return Candidate((KERNELS / case["file"]).read_text(), LaunchPlan.from_json(plan), kind=case.get("kind", "custom"),
                     proposer="fault-injection", knobs=case.get("knobs", {}), note=case["name"])


def gpu_cards(run_dir: Path) -> dict:
    """The three cards the cases run against; relu has a captured sample ((i % 7) - 3)."""
    aten = torch.ops.aten
    x = (torch.arange(4096 * 4096, device="cuda") % 7 - 3).float().reshape(4096, 4096)
    relu = make_card(aten.relu.default, x, family="pointwise", arch="sm_90")
    relu.samples = 1
    save_card(relu, run_dir)
    save_sample(relu, run_dir, 0, [x], [torch.relu(x)])
    rows = torch.randn(1024, 4096, device="cuda")
    softmax = make_card(aten._softmax.default, rows, -1, False, family="normalization", arch="sm_90")
    row_sum = make_card(aten.sum.dim_IntList, rows, [-1], family="reduction", arch="sm_90")
    return {"relu": relu, "softmax": softmax, "row_sum": row_sum}


def mismatches(case: dict, r) -> list[str]:
    want, ev = case["expect"], r.evidence
    verdicts = want["verdict"] if isinstance(want["verdict"], list) else [want["verdict"]]
    out = []
    if r.verdict.value not in verdicts:
        out.append(f"verdict {r.verdict.value} not in {verdicts}: {r.message}")
    for key in ("check", "cuda_error", "input_set", "after_timing"):
        if key in want and ev.get(key) != want[key]:
            out.append(f"{key} {ev.get(key)!r} != {want[key]!r}")
    if "flag" in want and want["flag"] not in r.flags:
        out.append(f"flag {want['flag']} not in {r.flags}")
    return [f"{case['name']} (row {case['row']}): {m}" for m in out]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_every_guard_row_in_one_pool(tmp_path):
    from kforge import timing
    from kforge.evaluate import make_evaluator

    # Row 11: the flush that precedes every timed rep must evict the whole L2.
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = timing.flush_buffer(0)
    assert flush.numel() * flush.element_size() >= 2 * l2

    cards = gpu_cards(tmp_path)
    results = {}
    with make_evaluator(tmp_path, devices=[0], timeout_s=5.0) as pool:
        for case in CASES:
            results[case["name"]] = pool.evaluate(cards[case["card"]], candidate(case))
        good = next(c for c in CASES if c["name"] == "relu_good")
        survivor = pool.evaluate(cards["relu"], candidate(good))
        restarts = pool.handles[0].starts

    report = "\n".join(f"{n}: {r.verdict.value} {r.message[:160]} flags={r.flags}" for n, r in results.items())
    problems = [m for c in CASES for m in mismatches(c, results[c["name"]])]
    assert not problems, "\n".join(problems) + "\n\nall results:\n" + report
    assert survivor.verdict.value in ("valid", "slower"), survivor.message
    assert restarts >= 5  # two faults and two hangs each cost a worker; the pool went on
    for name in ("relu_good", "softmax_good"):
        r = results[name]
        assert r.max_abs_err is not None and r.kernel_us and r.eager_us
        # Only a candidate faster than eager is timed alone too; a slower one stops there.
        assert ("kernel_alone" in r.evidence) == (r.verdict.value == "valid"), (name, r.verdict, r.evidence)
