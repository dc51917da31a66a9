"""Convolution biases added after the convolution (kforge.conv_bias): cuDNN's convolutions take no
bias and the regions after them take its add in, as Inductor does; outputs stay eager's."""

from __future__ import annotations

import pytest
import torch
from kforge import conv_bias, graph
from kforge.optimize import optimize
from test_optimize import FakeLauncher, fake_package, region_cards
from torch import nn

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
CONV = torch.ops.aten.convolution.default


class Block(nn.Module):
    """ConvNeXt's block: a depthwise convolution with a bias, channels moved last, a layer norm,
    a pointwise layer, the residual add."""

    def __init__(self, c: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.dw, self.norm, self.pw = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c), nn.Linear(c, c)
        nn.init.uniform_(self.dw.bias, -1, 1)  # a bias whose loss would show

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.pw(y).permute(0, 3, 1, 2)


@pytest.fixture
def as_cudnn(monkeypatch):
    """The CPU's convolutions taken for cuDNN's: the split applies on the CPU too."""
    monkeypatch.setattr(conv_bias, "DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(conv_bias, "backend", lambda conv: "Cudnn")


def traced(model, x) -> graph.Trace:
    with torch.no_grad():
        return graph.trace(model.eval(), (x,), {})


def convs(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CONV]


def test_a_cudnn_convolution_takes_no_bias_and_an_add_of_it_follows(as_cudnn):
    model, x = Block(), torch.randn(2, 8, 6, 5)
    (g,) = traced(model, x).graphs
    (conv,) = convs(g.module)
    assert conv.args[2] is None
    (add,) = conv.users
    assert add.target is torch.ops.aten.add.Tensor and add.args[0] is conv
    view = add.args[1]
    assert view.target is torch.ops.aten.view.default and view.args[1] == [1, 8, 1, 1]
    assert add.meta["val"].shape == conv.meta["val"].shape
    with torch.no_grad():
        torch.testing.assert_close(g.module(*g.inputs)[0], model(x))


def test_the_bias_add_is_in_the_region_of_the_ops_after_it_and_optimize_matches_eager(as_cudnn, tmp_path):
    model, x = Block(), torch.randn(2, 8, 6, 5)
    cards = region_cards(model, x, tmp_path)
    (norm,) = [c for c in cards if "native_layer_norm" in c.region.ops]
    assert norm.region.ops[0] == "add"  # the bias, then the layer norm
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=FakeLauncher(cards))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_in_compiled_graphs_every_cuda_convolution_is_split_with_a_reshape(monkeypatch):
    """kforge.compile's pass splits every CUDA convolution first, before the package's rewrites
    (whatever they are: regions and the fusions single-op cards weigh are then the graph Inductor
    fuses), with the bias reshaped as Inductor's post-grad graphs spell every view; a package with
    nothing for compiled graphs gets no split."""
    from kforge import inductor, inductor_rewrites

    seen = []
    monkeypatch.setattr(conv_bias, "split", lambda graph, **kw: seen.append(kw) or 0)
    monkeypatch.setattr(inductor, "_own", lambda: [])
    ops = inductor_rewrites.OpRewrite([])
    monkeypatch.setattr(inductor, "_rewrites", lambda package, launcher, drop: [ops])
    split, rewrite = inductor._pass_rewrites(None, None, ())
    assert isinstance(split, inductor_rewrites.ConvBiasSplit) and rewrite is ops
    empty = torch.fx.Graph()
    empty.output(empty.placeholder("x"))
    assert split(empty) == 0 and seen == [{"every": True, "view_op": torch.ops.aten.reshape.default}]
    monkeypatch.setattr(inductor, "_rewrites", lambda package, launcher, drop: [])
    assert inductor._pass_rewrites(None, None, ()) == []
    (g,) = traced(Block(), torch.randn(2, 8, 6, 5)).graphs
    monkeypatch.undo()
    monkeypatch.setattr(conv_bias, "DEVICES", ("cpu",))
    assert conv_bias.split(g.module.graph, every=True, view_op=torch.ops.aten.reshape.default) == 1
    assert [n.target for n in g.module.graph.nodes].count(torch.ops.aten.reshape.default) == 1


def test_convolutions_off_cudnn_keep_their_bias(monkeypatch):
    """The CPU's and CUDA's depthwise kernels add the bias inside the convolution: the split
    would change their rounding, so those stay whole unless every one is asked for."""
    (g,) = traced(Block(), torch.randn(2, 8, 6, 5)).graphs  # on the CPU: the pass does not apply
    assert convs(g.module)[0].args[2] is not None
    monkeypatch.setattr(conv_bias, "DEVICES", ("cpu",))
    monkeypatch.setattr(conv_bias, "backend", lambda conv: "CudaDepthwise2d")
    assert conv_bias.split(g.module.graph) == 0
    assert conv_bias.split(g.module.graph, every=True) == 1 and convs(g.module)[0].args[2] is None


def test_backend_reads_torchs_choice_for_the_traced_call():
    """torch's own backend selection takes the traced arguments as they are (on the CPU, its CPU
    backends), so on a GPU it says which convolutions are cuDNN's."""
    (g,) = traced(Block(), torch.randn(2, 8, 6, 5)).graphs
    name = conv_bias.backend(convs(g.module)[0])
    assert name in torch._C._ConvBackend.__members__ and "Cudnn" not in name


class ReadTwice(nn.Module):
    """ConvNeXt's downsampling: one convolution read by the next one and by the residual add."""

    def __init__(self):
        super().__init__()
        self.down, self.dw = nn.Conv2d(4, 8, 2, stride=2), nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, x):
        y = self.down(x)
        return y + torch.relu(self.dw(y))


def test_a_convolution_read_twice_keeps_its_bias_unless_every_one_is_split(as_cudnn):
    """Its add could join no region (a value used twice ends one): it would be one more call."""
    (g,) = traced(ReadTwice().eval(), torch.randn(2, 4, 8, 8)).graphs
    down, dw = convs(g.module)
    assert down.args[2] is not None and dw.args[2] is None  # the depthwise one is read once
    assert conv_bias.split(g.module.graph, every=True) == 1 and down.args[2] is None


class SqueezeExcited(nn.Module):
    """A convolution read by a mean and by the product the mean gates (squeeze-excite, ECA)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(4, 8, 1), nn.Linear(8, 8)

    def forward(self, x):
        y = self.conv(x)
        return y * torch.sigmoid(self.fc(y.mean((2, 3)))).view(y.shape[0], -1, 1, 1)


def test_a_convolution_read_by_a_mean_and_the_product_it_gates_is_split_into_a_shared_region(as_cudnn, tmp_path):
    """The bias add and the mean become one shared region (it writes the sum the product reads)."""
    model, x = SqueezeExcited().eval(), torch.randn(2, 4, 6, 5)
    (g,) = traced(model, x).graphs
    (conv,) = convs(g.module)
    assert conv.args[2] is None
    cards = region_cards(model, x, tmp_path)
    assert ["add", "mean"] in [c.region.ops for c in cards if c.region.kind == "shared"]
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=FakeLauncher(cards))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_a_convolution_without_a_bias_is_left_alone(as_cudnn):
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.ReLU()).eval()
    (g,) = traced(model, torch.randn(1, 3, 8, 8)).graphs
    (conv,) = convs(g.module)
    assert conv.args[2] is None and not any(n.target is torch.ops.aten.add.Tensor for n in g.module.graph.nodes)


def test_a_convolution_read_by_another_convolution_keeps_its_bias(as_cudnn):
    """Read once, but by an op no region takes the add into (a vendor op): the add would run alone,
    out of place, one more call; a convolution read by a view before a norm is split."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1), nn.ReLU()).eval()
    (g,) = traced(model, torch.randn(1, 3, 8, 8)).graphs
    first, second = convs(g.module)
    assert first.args[2] is not None and second.args[2] is None
    (g,) = traced(Block(), torch.randn(2, 8, 6, 5)).graphs
    assert convs(g.module)[0].args[2] is None
