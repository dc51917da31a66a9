"""Regions on a real GPU: region cards captured with CUDA-event timings, a region kernel
validated and timed as dispatched by the real evaluator, then run by kforge.optimize, also
inside a CUDA graph. The kernel is a test stand-in (the product's come from the code generator)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge import compiler
from kforge.candidate import Candidate, LaunchPlan
from kforge.capturing import capture
from kforge.card_files import load_cards, load_sample
from kforge.optimize import optimize
from kforge.package import CastPackage, PackagedCard

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]

N = 64 * 4096
SILU_MUL = r"""
extern "C" __global__ void silu_mul(const float* a, const float* b, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float x = a[i]; y[i] = x / (1.0f + __expf(-x)) * b[i]; }
}
"""



class SiluMul(nn.Module):
    def forward(self, a, b):
        return F.silu(a) * b


class Block(nn.Module):
    def __init__(self, c=64):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.norm = nn.GroupNorm(8, c)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)) + x)
        return F.silu(self.norm(y))


def silu_mul_candidate() -> Candidate:
    plan = LaunchPlan.from_json({"kernels": [{"name": "silu_mul", "grid": [N // 256, 1, 1], "block": [256, 1, 1],
                                              "args": [{"in": 0}, {"in": 1}, {"out": 0}, {"i32": N}]}]})
    return Candidate(SILU_MUL, plan, proposer="test")


def test_region_cards_on_the_gpu_are_timed_and_replay_their_samples(tmp_path):
    model = Block().cuda().eval().to(torch.bfloat16)
    r = capture(model, torch.randn(8, 64, 32, 32, device="cuda", dtype=torch.bfloat16), tmp_path, regions=True)
    regions = {tuple(c.region.ops): c for c in load_cards(tmp_path) if c.region is not None}
    # The finder may fuse the two chains into one region (one reduction, the batch norm chain its
    # prologue: what the H200's bf16 graph gives) or keep them apart; each chain is in a region.
    def found(chain):
        return any(ops[i:i + len(chain)] == chain for ops in regions for i in range(len(ops)))
    assert found(("_native_batch_norm_legit_no_training", "add", "relu")), list(regions)
    assert found(("native_group_norm", "silu")), list(regions)
    for c in regions.values():
        assert c.arch.startswith("sm_") and c.eager_us > 0 and c.share > 0
        ins, outs = load_sample(c, tmp_path, device="cuda")
        got = c.call_eager(ins, "cuda")
        assert all(torch.equal(a, b) for a, b in zip(got, outs))
    assert not [n for n in r.notes if n.startswith("graph")], r.notes


def test_a_region_kernel_is_validated_dispatched_and_optimized_also_in_a_cuda_graph(tmp_path):
    from kforge.evaluate import make_evaluator

    a, b = (torch.randn(64, 4096, device="cuda") for _ in range(2))
    model = SiluMul()
    (card,) = [c for c in capture(model, (a, b), tmp_path, regions=True).cards if c.region is not None]
    cand = silu_mul_candidate()
    with make_evaluator(tmp_path, devices=[0]) as ev:
        res = ev.evaluate(card, cand)
    assert res.verdict.value in ("valid", "slower"), res.message
    if res.verdict.value == "valid":
        assert res.dispatched_us is not None and res.eager_dispatched_us is not None, res.evidence

    cubin = compiler.compile(SILU_MUL, name="silu_mul.cu", arch=card.arch).cubin
    pc = PackagedCard(card, "dispatched", "test", "custom", {"timing": {"dispatched_us": 1.0},
                                                             "baseline": {"baseline_us": 2.0}}, cand, cubin)
    pkg = CastPackage(Path("test.cast"), {"gpu": {"arch": card.arch, "name": torch.cuda.get_device_name()}}, [pc])
    fast = optimize(model, pkg)
    with torch.no_grad():
        torch.testing.assert_close(fast(a, b), model(a, b))
        assert pc.counters.hits == 1 and len(fast.replaced) == 1
        static_a, static_b = a.clone(), b.clone()
        fast(static_a, static_b)  # warm: traced already, kernels loaded
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fast(static_a, static_b)
        static_a.copy_(torch.randn_like(a))
        g.replay()
        torch.testing.assert_close(out, model(static_a, static_b))
