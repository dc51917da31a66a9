"""The layout pass (kforge.layout): traced convolutions run channels-last, regions are captured
and matched in that layout, outputs keep eager's strides, weights are converted once."""

from __future__ import annotations

import pytest
import torch
from kforge import fold, graph, layout
from kforge.optimize import optimize
from test_optimize import FakeLauncher, fake_package, region_cards, resnet
from torch import nn

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def on_cpu(monkeypatch):
    """The pass applies on the CPU too (it applies on CUDA only by default)."""
    monkeypatch.setattr(layout, "DEVICES", ("cpu", "cuda"))


def traced(model, *inputs) -> graph.Trace:
    with torch.no_grad():
        return graph.trace(model.eval(), inputs, {})


def calls(gm, target) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


class ConvOut(nn.Module):
    """A graph whose output is a convolution's: eager gives it NCHW strides."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_convolutions_run_channels_last_and_only_the_first_input_is_converted(on_cpu):
    g = traced(resnet(), torch.randn(2, 4, 8, 8)).graphs[0]
    convs = calls(g.module, torch.ops.aten.convolution.default)
    assert len(convs) == 4 and g.module.meta[layout.CHANGED] == 4
    assert all(c.meta["val"].is_contiguous(memory_format=torch.channels_last) for c in convs)
    assert len(calls(g.module, layout.channels_last)) == 1  # the rest arrive channels-last
    check = Strides(g.module)
    with torch.no_grad():
        check.run(*g.inputs)
    assert check.wrong == []
    assert all(isinstance(c.args[1].target, layout.ConvertedOnce) for c in convs)


def test_outputs_keep_eagers_strides_and_values(on_cpu):
    model, x = ConvOut().eval(), torch.randn(2, 3, 9, 7)
    t = traced(model, x)
    assert any(isinstance(n.target, layout.Restrided) for n in t.graphs[0].module.graph.nodes)
    fast = optimize(model, fake_package([], {}), launcher=FakeLauncher([]))
    with torch.no_grad():
        want, got = model(x), fast(x)
    assert got.stride() == want.stride() == (504, 63, 7, 1)
    torch.testing.assert_close(got, want)
    assert fast.graphs[0] is not None  # the layout alone changes the graph, so it runs


def test_regions_are_captured_and_matched_in_the_new_layout(on_cpu, tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    # every batch norm reads a convolution's output, channels-last; the first block's residual is
    # the model's input, NCHW as the caller gave it (so that block's add is a card of its own)
    assert len(cards) == 3 and all(c.inputs[0].stride == (256, 1, 32, 4) for c in cards)
    assert sorted(c.inputs[-1].stride for c in cards if len(c.region.ops) == 3) == [(256, 1, 32, 4), (256, 64, 8, 1)]
    launcher = FakeLauncher(cards)
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=launcher)
    with torch.no_grad():
        want, got = model(x), fast(x)
    torch.testing.assert_close(got, want)
    assert sorted(launcher.calls) == [0, 0, 1, 2]  # the norm-relu region at both blocks, each add once


class Strides(torch.fx.Interpreter):
    """Every node's traced strides against the ones it really produces."""

    def __init__(self, gm):
        super().__init__(gm)
        self.wrong: list[str] = []

    def run_node(self, n):
        out = super().run_node(n)
        val = n.meta.get("val")
        if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor) and out.stride() != val.stride():
            self.wrong.append(f"{n.name}: traced {val.stride()}, ran {out.stride()}")
        return out


class NormAfterConv(nn.Module):
    """A group norm and an upsample read convolutions' outputs (native_group_norm's CUDA kernel
    takes only contiguous input)."""

    def __init__(self):
        super().__init__()
        self.a, self.gn, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 1)
        self.c, self.d = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.b(torch.nn.functional.silu(self.gn(self.a(x))))
        return self.d(torch.relu(self.c(torch.nn.functional.interpolate(y, scale_factor=2.0))))


def test_ops_that_need_the_traced_layout_get_it_back(on_cpu, monkeypatch):
    model, x = NormAfterConv().eval(), torch.randn(2, 3, 6, 6)
    monkeypatch.setattr(layout, "RESTORED_PER_CONV", 0.5)  # two copies back for four convolutions
    (g,) = traced(model, x).graphs
    assert g.module.meta[layout.CHANGED] == 4
    norm = calls(g.module, torch.ops.aten.native_group_norm.default)[0]
    assert norm.args[0].meta["val"].stride() == (288, 36, 6, 1)  # as traced
    check = Strides(g.module)
    with torch.no_grad():
        check.run(*g.inputs)
    assert check.wrong == []
    fast = optimize(model, fake_package([], {}), launcher=FakeLauncher([]))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


class StemNorm(nn.Module):
    """ConvNeXt's stem: a convolution, its output permuted to channels last for a layer norm, and
    back for the next convolution."""

    def __init__(self):
        super().__init__()
        self.stem, self.norm, self.next = nn.Conv2d(3, 8, 2, stride=2), nn.LayerNorm(8), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.next(self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_a_layer_norm_reads_the_channels_last_convolution_as_it_is(on_cpu):
    """native_layer_norm takes any strides and writes contiguous output: no copy back to the
    traced permute's strides, which would be copied again inside the norm."""
    model, x = StemNorm().eval(), torch.randn(2, 3, 8, 8)
    (g,) = traced(model, x).graphs
    assert g.module.meta[layout.CHANGED] == 2
    assert not any(isinstance(n.target, layout.Restrided) for n in g.module.graph.nodes)
    (norm,) = calls(g.module, torch.ops.aten.native_layer_norm.default)
    assert norm.args[0].meta["val"].is_contiguous()  # the permute of a channels-last convolution
    check = Strides(g.module)
    with torch.no_grad():
        check.run(*g.inputs)
        assert check.wrong == []
        torch.testing.assert_close(g.module(*g.inputs)[0], model(x))


def test_many_copies_back_keep_the_traced_layout_with_a_note(on_cpu):
    t = traced(NormAfterConv().eval(), torch.randn(2, 3, 6, 6))  # 2 copies back > 0.25 x 4 convolutions
    assert layout.CHANGED not in t.graphs[0].module.meta
    assert not calls(t.graphs[0].module, layout.channels_last)
    assert any("convolutions left in the traced layout (2 values would be copied back" in n for n in t.notes)


def test_a_weight_is_converted_once_per_version():
    convert, w = layout.ConvertedOnce(), torch.randn(8, 4, 3, 3)
    first = convert(w)
    assert first.is_contiguous(memory_format=torch.channels_last) and convert(w) is first
    with torch.no_grad():
        w.mul_(2)  # an in-place update is a new version: converted anew, into the copy's memory
    again = convert(w)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, w)
    other = torch.randn(8, 4, 3, 3)  # another tensor is never the memo's
    assert torch.equal(convert(other), other)


def test_a_kept_weight_copy_is_refreshed_in_place_before_a_graph_replay():
    """What a CUDA graph reads at its address (kforge.replay): the holder, recorded while the
    graph's forward ran, copies a weight written since into the same memory."""
    convert, w = layout.ConvertedOnce(), torch.randn(8, 4, 3, 3)
    with fold.recording() as held:
        copy = convert(w)
        convert(w)  # a hit is recorded too: the memo may predate the capture
    assert held == [convert, convert] and convert.weights() == [w]
    assert convert.refresh() and torch.equal(copy, w)  # nothing written: nothing done
    with torch.no_grad():
        w.add_(1)
    assert convert.refresh() and torch.equal(copy, w) and convert(w) is copy
    w.data = torch.randn(8, 4, 3, 3)  # other memory: the replay cannot read it, the graph runs op by op
    assert not convert.refresh()
    assert convert(w).data_ptr() == copy.data_ptr() and torch.equal(copy, w)


def test_a_weight_autograd_must_see_is_converted_on_every_call():
    convert, w = layout.ConvertedOnce(), torch.randn(8, 4, 3, 3, requires_grad=True)
    with torch.no_grad():
        first = convert(w)  # memoized: nothing records a backward here
    assert convert(w) is not first and convert(w).grad_fn is not None  # grad on: a copy autograd records
    with torch.no_grad():
        assert convert(w) is first


def test_keep_turns_the_pass_off(on_cpu, monkeypatch):
    monkeypatch.setenv("KFORGE_LAYOUT", "keep")
    g = traced(resnet(), torch.randn(2, 4, 8, 8)).graphs[0]
    assert layout.CHANGED not in g.module.meta
    assert not calls(g.module, layout.channels_last)


def test_mostly_grouped_convolutions_and_cpu_graphs_by_default_are_left_alone(on_cpu, monkeypatch):
    depthwise = nn.Sequential(nn.Conv2d(8, 8, 3, groups=2), nn.Conv2d(8, 8, 3, groups=4)).eval()
    assert layout.CHANGED not in traced(depthwise, torch.randn(1, 8, 9, 9)).graphs[0].module.meta
    monkeypatch.setattr(layout, "DEVICES", ("cuda",))
    assert layout.CHANGED not in traced(resnet(), torch.randn(2, 4, 8, 8)).graphs[0].module.meta


class StandardizedConvs(nn.Module):
    """Two convolutions whose weights are standardized on every forward (timm's StdConv2d)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        for conv in (self.a, self.b):
            w = conv.weight
            w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.var((1, 2, 3), keepdim=True) + 1e-5).sqrt()
            x = torch.relu(torch.nn.functional.conv2d(x, w, conv.bias, padding=conv.padding))
        return x


def test_a_computed_weights_channels_last_copy_is_kept_with_it(on_cpu):
    """The standardized weight is a value of the weights alone, and so is its channels-last copy:
    both are computed on the first forward and kept (kforge.fold); the input's conversion stays."""
    model, x = StandardizedConvs().eval(), torch.randn(2, 3, 6, 6)
    fast = optimize(model, fake_package([], {}), launcher=FakeLauncher([]))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
        (g,) = [g for g in fast.graphs if g is not None]
        assert len(calls(g, layout.channels_last)) == 1  # the first convolution's input; the weights' are folded
        model.a.weight.mul_(2)
        torch.testing.assert_close(fast(x), model(x))
