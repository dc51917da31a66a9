"""A region card goes through the evaluator like any card: validated against its replay on
fresh inputs, cheats caught, timed as dispatched through kforge.optimize's guarded call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge.candidate import Candidate, LaunchPlan
from kforge.capturing import capture
from kforge.verdict import Verdict
from kforge.backends import FakeBackend, NotDispatched
from kforge.inputsets import prepare
from kforge.judge import Judge
from kforge.worker_protocol import EvalOptions

FAST = dict(min_reps=5, min_ms=0.0, warmup_ms=0.0, fresh_sets=3)


class SiluMul(nn.Module):
    def forward(self, a, b):
        return F.silu(a) * b


def silu_mul_good(ins, outs, ws):
    a, b = ins
    outs[0].copy_(a * torch.sigmoid(a) * b)


def silu_mul_forgets_b(ins, outs, ws):
    outs[0].copy_(F.silu(ins[0]))


def candidate(name: str) -> Candidate:
    plan = LaunchPlan.from_json({"kernels": [{"name": "k", "grid": [1], "block": [1],
                                              "args": [{"in": 0}, {"in": 1}, {"out": 0}]}]})
    return Candidate(f"test_region_eval:{name}", plan, kind="custom", proposer="test")


@pytest.fixture
def card(tmp_path, fresh_dynamo):
    r = capture(SiluMul(), (torch.randn(64, 32), torch.randn(64, 32)), tmp_path, regions=True, time_cards=False)
    (c,) = [c for c in r.cards if c.region is not None]
    assert c.region.ops == ["silu", "mul"] and c.samples == 1
    return c, tmp_path


def judge(card, run_dir, name):
    o = EvalOptions(**FAST)
    backend = FakeBackend(dispatch=True)
    sets, holdout = prepare(card, run_dir, backend.device, o.fresh_sets)
    return Judge(backend, card, sets, holdout, candidate(name), o, lambda ph, b: None)


def test_a_right_region_kernel_is_valid_and_timed_as_dispatched(card, monkeypatch):
    monkeypatch.setattr("kforge.validate.speed_verdict", lambda kernel, eager: (Verdict.VALID, "forced"))
    c, run_dir = card
    r, fatal = judge(c, run_dir, "silu_mul_good").run()
    assert r.verdict is Verdict.VALID and not fatal, r.message
    assert r.dispatched_us > 0 and r.eager_dispatched_us > 0 and "not_dispatched" not in r.evidence


def test_a_wrong_region_kernel_is_incorrect(card):
    c, run_dir = card
    r, _ = judge(c, run_dir, "silu_mul_forgets_b").run()
    assert r.verdict is Verdict.INCORRECT, r.message


def test_a_region_guard_miss_is_not_latency_as_dispatched(card):
    c, _ = card
    backend, cand = FakeBackend(dispatch=True), candidate("silu_mul_good")
    kernel = backend.load(cand, backend.compile(cand))
    eager, dispatched = backend.time_dispatched(c, cand, kernel, c.random_inputs(1, "cpu"), EvalOptions())
    assert eager.n == dispatched.n == 5
    with pytest.raises(NotDispatched, match="the region's guard did not take the kernel"):
        backend.time_dispatched(c, cand, kernel, [torch.randn(3, 5), torch.randn(3, 5)], EvalOptions())


def test_the_llm_prompt_shows_the_region_as_pytorch_and_builtin_declines_it(card):
    from kforge.hardware import H200
    from kforge.proposers import get_proposer
    from kforge.proposers.llm.prompts import describe_card
    from kforge.runner import skip_reason

    c, _ = card
    text = describe_card(c, H200)
    assert "  def region(in0, in1):" in text and "    v0 = aten.silu.default(in0)" in text
    assert "    v1 = aten.mul.Tensor(v0, in1)" in text and "    return v1" in text
    builtin = get_proposer("builtin")
    try:
        why = skip_reason(c, builtin, min_share=0.0, include_vendor=False)
    finally:
        builtin.close()
    assert why is not None and why.startswith("proposer builtin declines")
