"""kforge.optimize on a real GPU: the region kernel in the traced graph, op by op and replayed
from CUDA graphs (cuda_graphs=True), outputs equal to eager, and every case a replay cannot take
falling back to the graph op by op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge import compiler, fold, layout
from kforge.capturing import capture
from kforge.optimize import optimize
from kforge.package import CastPackage, PackagedCard
from test_regions_gpu import SILU_MUL, SiluMul, silu_mul_candidate

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]


def silu_mul_package(tmp_path, a, b) -> tuple[CastPackage, PackagedCard]:
    (card,) = [c for c in capture(SiluMul(), (a, b), tmp_path, regions=True, time_cards=False).cards if c.region]
    cubin = compiler.compile(SILU_MUL, name="silu_mul.cu", arch=card.arch).cubin
    pc = PackagedCard(card, "dispatched", "test", "custom", {"timing": {"dispatched_us": 1.0},
                                                             "baseline": {"baseline_us": 2.0}}, silu_mul_candidate(), cubin)
    return CastPackage(Path("test.cast"), {"gpu": {"arch": card.arch, "name": torch.cuda.get_device_name()}}, [pc]), pc


class Scaled(nn.Module):
    """SiluMul with a parameter after it (the region ends at its output, which is also returned):
    the replay's guard on where the model's tensors are."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((64, 4096), 2.0, device="cuda"))

    def forward(self, a, b):
        y = SiluMul()(a, b)
        return y, y * self.scale


def test_the_region_kernel_replays_from_a_cuda_graph_and_new_inputs_are_read(tmp_path):
    a, b = (torch.randn(64, 4096, device="cuda") for _ in range(2))
    pkg, pc = silu_mul_package(tmp_path, a, b)
    model = Scaled()
    fast = optimize(model, pkg, cuda_graphs=True)
    with torch.inference_mode():
        for _ in range(3):
            a2, b2 = torch.randn_like(a), torch.randn_like(b)  # new tensors, new values each call
            torch.testing.assert_close(fast(a2, b2), model(a2, b2))
        held = fast(a, b)
        fast(b, a)
        torch.testing.assert_close(held, model(a, b))  # an output stays valid after the next replay
    graphs = fast.report()["cuda_graphs"]  # one per traced graph: dynamo traces again for a, b made outside inference_mode
    assert graphs and all(r["captured"] for r in graphs), fast.notes
    assert sum(r["replays"] for r in graphs) == 5 and sum(r["misses"] for r in graphs) == 0, (graphs, fast.notes)
    assert pc.counters.hits >= 1  # the kernel is in the graph (its hits count the capture's calls)
    with torch.no_grad():
        model.scale.data = torch.full_like(model.scale, 3.0)  # moved: a replay would read the old one
    with torch.inference_mode():
        torch.testing.assert_close(fast(a, b), model(a, b))
    assert sum(r["misses"] for r in fast.report()["cuda_graphs"]) == 1  # whichever graph a, b reach


def test_a_new_shape_captures_its_own_graph_and_a_host_sync_runs_op_by_op(tmp_path):
    a, b = (torch.randn(64, 4096, device="cuda") for _ in range(2))
    pkg, _ = silu_mul_package(tmp_path, a, b)
    fast = optimize(SiluMul(), pkg, cuda_graphs=True)
    with torch.inference_mode():
        torch.testing.assert_close(fast(a, b), SiluMul()(a, b))
        c, d = a[:32], b[:32]
        torch.testing.assert_close(fast(c, d), SiluMul()(c, d))
    assert [r["captured"] for r in fast.report()["cuda_graphs"]] == [True, True]

    class Syncs(nn.Module):
        def forward(self, x):
            return x * float(x.abs().max())  # .item() inside: dynamo breaks the graph there

    torch.compiler.reset()
    slow = optimize(Syncs(), pkg, cuda_graphs=True)
    with torch.inference_mode():
        torch.testing.assert_close(slow(a), Syncs()(a))
    assert slow.notes, "the graph break is noted"


def test_without_cuda_graphs_the_region_kernel_runs_op_by_op(tmp_path):
    a, b = (torch.randn(64, 4096, device="cuda") for _ in range(2))
    pkg, pc = silu_mul_package(tmp_path, a, b)
    fast = optimize(SiluMul(), pkg)
    with torch.inference_mode():
        for _ in range(2):
            torch.testing.assert_close(fast(a, b), SiluMul()(a, b))
    assert pc.counters.hits == 2 and fast.report()["cuda_graphs"] == [] and fast.graphs[0] is not None


class WeightNormed(nn.Module):
    """SiluMul, then a matmul by a weight-normed parameter (g * v / |v|, computed every forward).
    The matmul ends the region, so the package's SiluMul region matches (a product would join it)."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(64, 4096, device="cuda"))
        self.g = nn.Parameter(torch.rand(64, 1, device="cuda") + 0.5)

    def forward(self, a, b):
        return SiluMul()(a, b) @ (self.g * self.v / self.v.norm(dim=1, keepdim=True)).t()


def test_a_value_of_weights_is_computed_once_until_a_weight_is_written(tmp_path):
    from test_optimize import aten_calls  # the profiler's count: a dispatch mode would make dynamo run eagerly

    a, b = (torch.randn(64, 4096, device="cuda") for _ in range(2))
    pkg, pc = silu_mul_package(tmp_path, a, b)
    model = WeightNormed()
    fast = optimize(model, pkg)
    with torch.no_grad():
        torch.testing.assert_close(fast(a, b), model(a, b))
        assert aten_calls(fast, b, a)["aten::linalg_vector_norm"] == 0  # the first forward's value, reused
        model.v.mul_(-0.5)  # written in place, as load_state_dict writes it
        torch.testing.assert_close(fast(a, b), model(a, b))
    assert pc.counters.hits == 3


def test_values_of_weights_a_cuda_graph_reads_are_refreshed_after_a_weight_is_written(tmp_path):
    """With cuda_graphs the graph reads the kept values at their addresses: the weight-normed
    product (kforge.fold) and a convolution's channels-last weight (kforge.layout) follow a weight
    written in place, replayed, with no miss; a weight moved elsewhere runs op by op."""
    a, b = (torch.randn(64, 4096, device="cuda") for _ in range(2))
    pkg, pc = silu_mul_package(tmp_path, a, b)
    model = WeightNormed()
    fast = optimize(model, pkg, cuda_graphs=True)
    conv = nn.Conv2d(16, 32, 3, padding=1, bias=False).cuda()
    fast_conv = optimize(conv, pkg, cuda_graphs=True)
    x = torch.randn(8, 16, 20, 20, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fast(a, b), model(a, b))
            torch.testing.assert_close(fast_conv(x), conv(x), rtol=1e-2, atol=1e-2)
        model.v.mul_(-0.5)  # written in place, as load_state_dict writes it
        conv.weight.mul_(-1)
        torch.testing.assert_close(fast(a, b), model(a, b))
        torch.testing.assert_close(fast_conv(x), conv(x), rtol=1e-2, atol=1e-2)
    held = [type(n.target) for m in (fast, fast_conv) for gm in m.graphs if gm is not None for n in gm.graph.nodes]
    assert fold.Folded in held and layout.ConvertedOnce in held  # what a replay must refresh
    for m in (fast, fast_conv):
        graphs = m.report()["cuda_graphs"]
        assert graphs and all(r["captured"] for r in graphs), m.notes
        assert sum(r["replays"] for r in graphs) >= 2 and sum(r["misses"] for r in graphs) == 0, (graphs, m.notes)
    with torch.no_grad():
        model.v.data = torch.randn_like(model.v)  # other memory: op by op
        torch.testing.assert_close(fast(a, b), model(a, b))
    assert sum(r["misses"] for r in fast.report()["cuda_graphs"]) == 1


class ConvByInput(nn.Module):
    def forward(self, x, w):
        return F.conv2d(x, w, padding=1)


def test_a_convolution_weight_passed_as_an_input_is_converted_after_it_is_copied_in(tmp_path):
    """The replay copies an input that is not the model's into its own buffer, then refreshes the
    channels-last copy made of that buffer: each call's weight is the one convolved."""
    a, b = (torch.randn(64, 4096, device="cuda") for _ in range(2))
    pkg, _ = silu_mul_package(tmp_path, a, b)
    fast = optimize(ConvByInput(), pkg, cuda_graphs=True)
    x = torch.randn(8, 16, 20, 20, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            w = torch.randn(32, 16, 3, 3, device="cuda")
            torch.testing.assert_close(fast(x, w), F.conv2d(x, w, padding=1), rtol=1e-2, atol=1e-2)
    graphs = fast.report()["cuda_graphs"]
    assert graphs and all(r["captured"] for r in graphs) and sum(r["replays"] for r in graphs) >= 1, (graphs, fast.notes)
