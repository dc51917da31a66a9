"""The layout pass on CUDA: every traced value's strides are the ones the graph really produces
(region cards are matched on the traced ones), and the laid-out graph computes what eager does."""

from __future__ import annotations

import pytest
import torch
from kforge import graph, layout
from kforge.optimize import optimize
from kforge.package import CastPackage
from test_channels_last import Strides
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]


class Block(nn.Module):
    """The node kinds of ResNet-50 and of the SD-VAE decoder around a convolution."""

    def __init__(self, dtype):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 7, stride=2, padding=3)
        self.bn = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv = nn.Conv2d(32, 32, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(8, 32)
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.out = nn.Conv2d(32, 16, 1)
        self.to(device="cuda", dtype=dtype)

    def forward(self, x):
        y = self.pool(torch.relu(self.bn(self.stem(x))))
        y = y + self.conv(y)
        y = torch.nn.functional.silu(self.gn(y))
        z = self.out(self.up(y))
        return z, torch.flatten(torch.nn.functional.adaptive_avg_pool2d(z, 1), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_strides_are_the_real_ones_and_outputs_match_eager(dtype, monkeypatch):
    monkeypatch.setattr(layout, "RESTORED_PER_CONV", 1.0)  # the group norm's and upsample's copies back
    model, x = Block(dtype).eval(), torch.randn(2, 3, 64, 64, device="cuda", dtype=dtype)
    with torch.no_grad():
        (g,) = graph.trace(model, (x,), {}).graphs
        assert g.module.meta[layout.CHANGED] == 3
        check = Strides(g.module)
        check.run(*g.inputs)
        assert check.wrong == []
        fast = optimize(model, CastPackage(None, {}, []))
        want, got = model(x), fast(x)
    for w, o in zip(want, got):
        assert o.stride() == w.stride()
        torch.testing.assert_close(o, w, atol=2e-2 if dtype == torch.bfloat16 else 1e-3, rtol=2e-2)


def test_cudnn_convolutions_add_their_bias_after_them_and_outputs_match_eager():
    """ConvNeXt's depthwise convolution, on a channels-last input in bf16 (the previous block's
    output permuted back), runs on cuDNN: it takes no bias, an add of it follows (for the layer
    norm's region to take in), and the forward is eager's. (On an NCHW input, CUDA's own
    depthwise kernel runs it, bias inside, and the convolution keeps it.)"""
    from kforge import conv_bias
    from test_conv_bias import Block as ConvNeXtBlock

    model = ConvNeXtBlock(64).to(device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(4, 14, 14, 64, device="cuda", dtype=torch.bfloat16).permute(0, 3, 1, 2)
    with torch.no_grad():
        (g,) = graph.trace(model, (x,), {}).graphs
        (conv,) = [n for n in g.module.graph.nodes if n.target is torch.ops.aten.convolution.default]
        assert conv.args[2] is None and conv_bias.backend(conv) in conv_bias.CUDNN
        check = Strides(g.module)
        check.run(*g.inputs)
        assert check.wrong == []
        fast = optimize(model, CastPackage(None, {}, []))
        torch.testing.assert_close(fast(x), model(x), atol=2e-2, rtol=2e-2)


def test_a_layer_norm_of_a_channels_last_convolution_reads_it_as_it_is():
    """ConvNeXt's stem in bf16: the layer norm reads the channels-last convolution's permute,
    contiguous, with no copy back to the traced strides; strides and values as eager's."""
    from test_channels_last import StemNorm

    model = StemNorm().to(device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(4, 3, 32, 32, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        (g,) = graph.trace(model, (x,), {}).graphs
        assert g.module.meta[layout.CHANGED] == 2
        assert not any(isinstance(n.target, layout.Restrided) for n in g.module.graph.nodes)
        check = Strides(g.module)
        check.run(*g.inputs)
        assert check.wrong == []
        fast = optimize(model, CastPackage(None, {}, []))
        torch.testing.assert_close(fast(x), model(x), atol=2e-2, rtol=2e-2)
