"""kforge.optimize on the CPU with a fake package: exactly the matched regions replaced, outputs
equal to eager, a new shape falls back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kforge
from kforge.candidate import Candidate, LaunchPlan
from kforge.capturing import capture
from kforge.optimize import RegionCall, RegionKernel, optimize
from kforge.package import CastPackage, PackagedCard
from test_regions import BasicBlock

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BN = "_native_batch_norm_legit_no_training"



def resnet() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(BasicBlock(), BasicBlock()).eval()
    for m in model.modules():  # non-trivial statistics, so a wrong kernel would show
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return model


class FakeLauncher:
    """The package's launcher on the CPU: variant id -> the region computed by PyTorch, plus 1
    when asked (a kernel whose use shows in the output)."""

    def __init__(self, cards, offset: float = 0.0, fns: dict | None = None):
        self.cards, self.offset, self.fns = cards, offset, fns or {}
        self.calls: list[int] = []

    def launch(self, vid, inputs, outputs, workspaces, device):
        self.calls.append(vid)
        fn = self.fns.get(vid, self.cards[vid].call_eager)
        for out, ref in zip(outputs, fn(list(inputs))):
            out.copy_(ref + self.offset)


def fake_package(cards, timings: dict[str, tuple[float, float]]) -> CastPackage:
    """A package whose region cards are all dispatched; timings: card id -> (kernel, baseline) µs."""
    plan = LaunchPlan.from_json({"kernels": [{"name": "k", "grid": [1], "block": [1], "args": []}]})
    entries = [PackagedCard(c, "dispatched", "test", "custom",
                            {"timing": {"dispatched_us": timings[c.id][0]},
                             "baseline": {"baseline_us": timings[c.id][1]}}, Candidate("", plan)) for c in cards]
    return CastPackage(Path("fake.cast"), {"gpu": {"arch": "cpu", "name": "cpu"}}, entries)


def region_cards(model, x, tmp_path, kind: str | None = None):
    cards = [c for c in capture(model, x, tmp_path, regions=True, time_cards=False).cards if c.region]
    return [c for c in cards if kind is None or c.region.kind == kind]


def test_replaces_exactly_the_matched_regions_and_matches_eager(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    assert sorted(c.region.ops for c in cards) == [[BN, "add", "relu"], [BN, "relu"]]
    pkg = fake_package(cards, {c.id: (1.0, 5.0) for c in cards})
    launcher = FakeLauncher(cards)
    fast = optimize(model, pkg, launcher=launcher)
    with torch.no_grad():
        want, got = model(x), fast(x)
    assert torch.equal(got, want)
    assert sorted(launcher.calls) == [0, 0, 1, 1]  # each region at both blocks
    assert len(fast.replaced) == 4
    assert {r["id"]: r["hits"] for r in fast.report()["regions"]} == {c.id: 2 for c in cards}


def test_the_kernel_is_what_runs(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    bn_relu = [c for c in cards if c.region.ops == [BN, "relu"]]
    fast = optimize(model, fake_package(bn_relu, {bn_relu[0].id: (1.0, 5.0)}),
                    launcher=FakeLauncher(bn_relu, offset=1.0))
    with torch.no_grad():
        assert not torch.allclose(fast(x), model(x))  # the fake kernel's +1 reached the output


def test_a_new_shape_falls_back_to_the_original_nodes(tmp_path):
    model = resnet()
    cards = region_cards(model, torch.randn(2, 4, 8, 8), tmp_path, "fused")
    launcher = FakeLauncher(cards)
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=launcher)
    other = torch.randn(3, 4, 6, 6)
    with torch.no_grad():
        assert torch.equal(fast(other), model(other))
    assert launcher.calls == [] and fast.replaced == []


def test_a_guard_miss_runs_the_region_eagerly_and_says_why(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    card = next(c for c in cards if c.region.ops == [BN, "relu"])
    launcher = FakeLauncher([card])
    kernel = RegionKernel(card, lambda ins: launcher.launch(0, ins, [], [], None) or [])
    call = RegionCall(card.region, [kernel])
    ins = [torch.rand(m.shape) + 0.5 for m in card.inputs]  # (a positive running variance)
    ins[0] = torch.randn(ins[0].numel() + 1)[1:].view(ins[0].shape)  # 4-byte aligned, the card says 16
    (got,) = call(*ins)
    assert torch.equal(got, card.region.replay(ins)[0]) and launcher.calls == []
    assert dict(kernel.counters.fallbacks) == {"alignment": 1}


def test_overlapping_regions_keep_the_larger_saving(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path)
    fused = next(c for c in cards if c.region.ops == [BN, "add", "relu"])
    epilogue = next(c for c in cards if c.region.ops == ["convolution", BN, "add", "relu"])
    pkg = fake_package([fused, epilogue], {fused.id: (2.0, 5.0), epilogue.id: (10.0, 20.0)})
    launcher = FakeLauncher([fused, epilogue])
    fast = optimize(model, pkg, launcher=launcher)
    with torch.no_grad():
        assert torch.allclose(fast(x), model(x), atol=1e-6)
    assert launcher.calls == [1, 1]  # the conv's epilogue saves 10 µs, the fused region inside it 3


def test_package_optimize_and_kforge_optimize(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    pkg = fake_package(cards, {c.id: (1.0, 5.0) for c in cards})
    for fast in (pkg.optimize(model, launcher=FakeLauncher(cards)), kforge.optimize(model, pkg, launcher=FakeLauncher(cards))):
        with torch.no_grad():
            assert torch.equal(fast(x), model(x))
        assert len(fast.replaced) == 4


def test_op_cards_run_in_the_graph_beside_the_regions_and_nothing_is_installed(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = capture(model, x, tmp_path, regions=True, time_cards=False).cards
    bn_relu = next(c for c in cards if c.region is not None and c.region.ops == [BN, "relu"])
    relu = next(c for c in cards if c.op == "aten::relu.default")
    pkg = fake_package([bn_relu, relu], {bn_relu.id: (1.0, 5.0), relu.id: (1.0, 2.0)})
    # Stand-ins that call no relu: one would be served by the relu override under test.
    launcher = FakeLauncher([bn_relu, relu], fns={
        0: lambda ins: [F.batch_norm(ins[0], ins[3], ins[4], ins[1], ins[2]).clamp(min=0)],
        1: lambda ins: [ins[0].clamp(min=0)]})
    fast = optimize(model, pkg, launcher=launcher)
    with torch.no_grad():
        got = fast(x)
        # bn+relu at both blocks by its region kernel; the relu after each residual add (not a
        # region of the package) by the op card's kernel, its custom op in the graph
        assert sorted(launcher.calls) == [0, 0, 1, 1] and fast.ops_replaced == 2
        assert torch.equal(got, model(x))
    assert sorted(launcher.calls) == [0, 0, 1, 1] and not pkg.installed  # eager's own calls stay eager
