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
