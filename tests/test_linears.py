"""Decomposed linear layers in a traced graph are one torch._C._nn.linear call again
(kforge.linears), bitwise what the decomposition computes, for 2-D and 3-D inputs with and
without a bias; a matmul that is not exactly a linear stays as it is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from kforge import linears


def _calls(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


def _decomposed(f, *args):
    """f traced to aten with linear decomposed, as aot_autograd leaves it."""
    from torch._decomp import core_aten_decompositions

    table = {op: fn for op, fn in core_aten_decompositions().items() if "linear" in str(op)}
    return make_fx(f, tracing_mode="fake", decomposition_table=table)(*args)


def projections(x, w, b, x2):
    return F.linear(x, w), F.linear(x, w, b), F.linear(x2, w, b), F.linear(x2, w)


def test_decomposed_linears_are_one_call_each_and_compute_the_same():
    x, w, b, x2 = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6), torch.randn(7, 8)
    gm = _decomposed(projections, x, w, b, x2)
    assert {"mm.default", "addmm.default", "t.default"} & set(_calls(gm))  # the decomposition
    assert linears.recompose(gm.graph) == 4
    gm.recompile()
    assert _calls(gm) == ["linear"] * 4
    for got, want in zip(gm(x, w, b, x2), projections(x, w, b, x2)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_matmul_that_is_not_exactly_a_linear_stays():
    def f(x, w, b):
        return x @ w, torch.addmm(b, x, w.t(), beta=2.0)  # no transpose; a scaled bias

    x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    gm = _decomposed(f, x, w, b)
    before = _calls(gm)
    assert linears.recompose(gm.graph) == 0
    gm.recompile()
    assert _calls(gm) == before
