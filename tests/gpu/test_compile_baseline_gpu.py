"""torch.compile as the baseline of every card, on a real GPU: the worker times the card's own
call compiled alone by Inductor in the same reps as eager and the kernel (compiled once per card
per worker), and the packager decides twice, into eager dispatch and into compiled graphs."""

from __future__ import annotations

import pytest

from builtin_cards import gn
from kforge.evaluate import make_evaluator
from kforge.hardware import current
from kforge.package import load, write_package
from kforge.proposers.builtin import template_for
from kforge.verdict import Verdict
from test_package import build_run

pytestmark = pytest.mark.gpu


def test_a_real_card_gets_a_torch_compile_time_and_both_decisions(tmp_path):
    card = gn(1, 512, 64, 64, 32)  # group_norm at batch 1: where kforge's kernels beat Inductor's
    hw = current()
    template = template_for(card)
    candidate = template.build(card, template.default(card, hw), hw)
    with make_evaluator(tmp_path / "search", devices=[0], timeout_s=10.0) as evaluator:
        first = evaluator.evaluate(card, candidate)
        second = evaluator.evaluate(card, candidate)
    for r in (first, second):
        assert r.verdict in (Verdict.VALID, Verdict.SLOWER), r.message
        assert r.compile_us is not None and r.compile_us > 0, r.evidence.get("compile_error")
        assert r.evidence["compiled"]["n"] == r.evidence["kernel"]["n"] >= 100
    # Compiled once: the second candidate of the card reuses the worker's compiled baseline.
    assert first.evidence["compile_baseline_s"] == second.evidence["compile_baseline_s"] > 0

    run = build_run(tmp_path / "run", [(card, [(candidate, first)], None)], arch=card.arch)
    (c,) = load(write_package(run, tmp_path / "m.cast")).cards
    entry = c.entry["compile"]
    assert c.decision in ("dispatched", "fallback") and c.compile_decision in ("dispatched", "fallback")
    if first.verdict is Verdict.VALID:
        assert (entry["compile_us"], entry["kernel_us"]) == (first.compile_us, first.kernel_us)
        assert "torch.compile" in entry["reason"] and entry["noise_us"] >= 0
        assert c.compiled == (first.kernel_us < first.compile_us - entry["noise_us"])
