"""A region card's generated kernel inside torch.compile on a real GPU: silu(a) * b captured as a
region, its kernel written by the code generator (the built-in proposer), validated and timed
against torch.compile of the region alone by the real evaluator, then run by kforge.compile in
Inductor's graph, default and reduce-overhead, with outputs equal to eager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kforge
from kforge import compiler
from kforge.capturing import capture
from kforge.evaluate import make_evaluator
from kforge.hardware import current
from kforge.package import CastPackage, PackagedCard
from kforge.proposers.base import ProposalContext
from kforge.proposers.builtin import BuiltinProposer

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]


class SiluMul(nn.Module):
    def forward(self, a, b):
        return F.silu(a) * b


def region_package(tmp_path):
    a, b = (torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    model = SiluMul()
    with torch.no_grad():
        (card,) = [c for c in capture(model, (a, b), tmp_path, regions=True).cards if c.region is not None]
    cand = BuiltinProposer().propose(ProposalContext(card, current())).candidate
    with make_evaluator(tmp_path, devices=[0]) as ev:  # the compile baseline is on by default
        res = ev.evaluate(card, cand)
    assert not res.verdict.failed, res.message
    assert res.compile_us is not None, res.evidence  # the region compiled alone, timed beside the kernel
    cubin = compiler.compile(cand.source, name=f"{card.id}.cu", options=cand.plan.options, arch=card.arch).cubin
    # The package's evidence says the kernel wins, as its compile decision does: what this test
    # checks is that kforge.compile then runs it (with 8 test processes on the GPU, the measured
    # pair can say either, and a region that saves nothing is never chosen).
    entry = {"id": card.id, "compile": {"kernel_us": 1.0, "compile_us": 2.0}}
    pc = PackagedCard(card, "fallback", "test", cand.kind, entry, cand, cubin,
                      compile_decision="dispatched", compile_reason="test")
    pkg = CastPackage(Path("region.cast"), {"format": 3, "gpu": {"arch": card.arch, "name": torch.cuda.get_device_name()},
                                            "cards": [{"id": card.id}]}, [pc])
    return model, a, b, pkg, pc


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_kforge_compile_runs_the_generated_region_kernel_in_inductors_graph(tmp_path, mode):
    model, a, b, pkg, pc = region_package(tmp_path)
    compiled = kforge.compile(model, pkg, **({"mode": mode} if mode else {}))
    with torch.inference_mode():
        for _ in range(3):  # (reduce-overhead: warm-up, record, replay)
            a.copy_(torch.randn_like(a))
            got = compiled(a, b).clone()
            torch.testing.assert_close(got, model(a, b), atol=2e-2, rtol=2e-2)
    assert pc.counters.hits >= 1 and not pc.counters.fallbacks


def test_another_shape_is_inductors(tmp_path):
    model, a, b, pkg, pc = region_package(tmp_path)
    a2, b2 = a[:128].clone(), b[:128].clone()
    with torch.inference_mode():
        torch.testing.assert_close(kforge.compile(model, pkg)(a2, b2), model(a2, b2), atol=2e-2, rtol=2e-2)
    assert pc.counters.hits == 0
