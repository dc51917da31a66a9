"""Graph capture: the aten form eager runs, exact metadata on every node, one line per graph break."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge import graph
from kforge.capturing import capture

pytestmark = pytest.mark.usefixtures("fresh_dynamo")



def traced(model, *inputs) -> graph.Trace:
    with torch.no_grad():
        return graph.trace(model.eval(), inputs, {})


def targets(g: graph.Graph) -> list[str]:
    return [str(n.target) for n in g.module.graph.nodes if n.op == "call_function"]


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)
        self.inner = nn.Sequential(nn.Linear(6, 6))

    def forward(self, x):
        y = torch.softmax(self.norm(x), dim=-1)
        return self.inner(y.transpose(-1, -2))


def test_keeps_the_ops_eager_dispatch_runs_with_exact_metadata():
    t = traced(Mixed(), torch.randn(2, 4, 6, 6))
    assert t.notes == [] and len(t.graphs) == 1
    ops = targets(t.graphs[0])
    assert "aten.native_group_norm.default" in ops and "aten._softmax.default" in ops
    assert not any("group_norm.default" == o.split("aten.")[-1] for o in ops)  # not the composite
    nodes = {n.name: n for n in t.graphs[0].module.graph.nodes}
    gn = nodes["native_group_norm"]
    assert gn.args[3:] == (2, 4, 36, 2, 1e-05)  # scalar arguments as eager gets them
    transposed = next(n for n in nodes.values() if n.target == torch.ops.aten.transpose.int)
    val = transposed.meta["val"]
    assert tuple(val.shape) == (2, 4, 6, 6) and val.stride() == (144, 36, 1, 6) and val.dtype == torch.float32
    assert graph.module_path(gn) == "norm"
    assert graph.module_path(next(n for n in nodes.values() if "mm" in str(n.target))) == "inner.0"
    assert graph.module_path(nodes["_softmax"]) == graph.ROOT


def test_real_inputs_of_each_graph_are_kept():
    x = torch.randn(2, 4, 6, 6)
    t = traced(Mixed(), x)
    ins = t.graphs[0].inputs
    assert ins is not None and any(i is x for i in ins)


class Upsampling(nn.Module):
    """A feature pyramid's merge: nearest twice the size, then bilinear to another size."""

    def forward(self, x, y):
        up = F.interpolate(x, scale_factor=2, mode="nearest") + y
        return F.interpolate(up, size=(7, 9), mode="bilinear", align_corners=False)


@pytest.mark.parametrize("channels_last", [False, True])
def test_upsampling_is_traced_as_the_op_eager_calls(channels_last):
    """Not torch's Python decomposition (index tensors built by arange, then _unsafe_index; four of
    them and a blend for bilinear): the one aten op eager calls, with its output's strides."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x, y = torch.randn(2, 3, 4, 5).to(memory_format=fmt), torch.randn(2, 3, 8, 10).to(memory_format=fmt)
    t = traced(Upsampling(), x, y)
    (g,) = t.graphs
    ops = targets(g)
    assert "aten.upsample_nearest2d.default" in ops and "aten.upsample_bilinear2d.default" in ops
    assert not any("index" in o or "arange" in o for o in ops), ops
    with torch.no_grad():
        want = Upsampling()(x, y)
        (got,) = g.module(*g.inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    last = next(n for n in g.module.graph.nodes if n.target == torch.ops.aten.upsample_bilinear2d.default)
    assert last.meta["val"].stride() == want.stride()
    # torch's decomposition is back in place once the trace is done
    assert torch._C.DispatchKey.CompositeImplicitAutograd in torch.ops.aten.upsample_nearest2d.vec.py_kernels


class Branchy(nn.Module):
    def forward(self, x):
        y = torch.relu(x) * 2
        if y.sum() > 0:  # data-dependent control flow: a graph break
            y = torch.sigmoid(y) + 1
        return y


def test_a_graph_break_is_one_line_and_each_graph_stands_alone():
    t = traced(Branchy(), torch.randn(4, 4))
    assert len(t.graphs) == 2
    (note,) = t.notes
    assert "\n" not in note and note.startswith("graph break after graph 0 at ") and "test_graph.py" in note
    assert t.graphs[0].break_note == note and t.graphs[1].break_note is None
    assert "aten.sigmoid.default" in targets(t.graphs[1])


def test_model_dynamo_cannot_run_still_gets_its_op_cards(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("dynamo is not available here\nsecond line")

    monkeypatch.setattr(torch, "compile", refuse)
    r = capture(Branchy(), torch.randn(4, 4), tmp_path, time_cards=False, regions=True)
    assert {c.op for c in r.cards} >= {"aten::relu.default", "aten::sigmoid.default"}
    assert not any(c.region for c in r.cards)
    assert "graph capture failed: RuntimeError: dynamo is not available here" in r.notes


def test_graph_breaks_leave_the_op_capture_whole(tmp_path):
    r = capture(Branchy(), torch.randn(4, 4), tmp_path, time_cards=False, regions=True)
    assert sum(n.startswith("graph break after graph 0") for n in r.notes) == 1
    assert {"aten::relu.default", "aten::mul.Tensor", "aten::sigmoid.default", "aten::add.Tensor"} <= {c.op for c in r.cards}
    # relu*2 and the branch's condition before the break, sigmoid+1 after it
    assert sorted(c.region.ops for c in r.cards if c.region) == [["relu", "mul"], ["sigmoid", "add"], ["sum", "gt"]]


def test_the_trace_forgets_the_frames_it_retraced_for_new_shapes():
    """Dynamo's entries are per code object, shared by every compiled model in the process: an
    expert the trace retraced for each token count would keep checking those entries' guards
    under the user's own torch.compile. A code traced once keeps its entries (the compiled
    module's wrapper, shared by every compiled module, holds the user's own)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from test_optimize import Expert, Moe

    torch.manual_seed(0)
    model, x = Moe().eval(), torch.randn(64, 8)
    codes = []

    def backend(gm, example_inputs):
        codes.append(graph.tracing_code())
        return gm.forward

    with torch.no_grad():
        compiled = torch.compile(model.gate, backend=backend, dynamic=False)
        compiled(x)
        (wrapper,) = codes
        t = graph.trace(model, (x,), {})
        assert len(t.graphs) > 3  # the router's, and one per expert's token count
        assert not _debug_get_cache_entry_list(Expert.forward.__code__)
        assert _debug_get_cache_entry_list(wrapper)
        compiled(x)
    assert len(codes) == 1  # the user's compiled entry, still there, still used
