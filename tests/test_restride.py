"""Chains of views in a traced graph become one as_strided call of the chain's base
(kforge.restride), on graphs traced with fake values as dynamo's are: the result is the same
view of the same memory, including where the base lies at another storage offset than the
trace saw, and views something else still reads stay."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kforge import restride


def _traced(f, *args):
    return make_fx(f, tracing_mode="fake")(*args)


def _calls(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


def attention_plumbing(x):
    """A projection's output split into heads, transposed, unsqueezed and expanded (repeat_kv)."""
    return x.view(2, 3, 4, 2).transpose(1, 2).unsqueeze(2).expand(2, 4, 5, 3, 2) * 2


def test_a_chain_of_views_is_one_call_and_the_same_view():
    x = torch.randn(2, 3, 8)
    gm = _traced(attention_plumbing, x)
    assert restride.collapse(gm.graph) == 3
    gm.recompile()
    assert _calls(gm) == ["restride", "mul.Tensor"]  # the view of the input is a link of the chain too
    torch.testing.assert_close(gm(x), attention_plumbing(x), rtol=0, atol=0)


def test_the_base_may_lie_at_another_storage_offset_than_the_trace_saw():
    def f(x):
        return (x[:, 1:].transpose(0, 1).unsqueeze(0) + 1).sum(), x[:, 2:].t().unsqueeze(-1)

    gm = _traced(f, torch.randn(6, 5))
    assert restride.collapse(gm.graph) >= 2
    gm.recompile()
    assert [c for c in _calls(gm) if c not in ("add.Tensor", "sum.default")] == ["restride", "restride"]
    big = torch.randn(200)
    x = big[37:67].view(6, 5)  # storage offset 37, not 0
    got, want = gm(x), f(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[1].data_ptr() == want[1].data_ptr() and got[1].stride() == want[1].stride()


def test_a_view_read_elsewhere_stays_and_single_views_are_left_alone():
    def f(x):
        h = x.view(4, 6)
        return h.t().contiguous(), h.sum(0), x.t()

    gm = _traced(f, torch.randn(6, 4))
    assert restride.collapse(gm.graph) == 1  # h.t(): h stays, read by the sum; x.t() is one call
    gm.recompile()
    x = torch.randn(6, 4)
    for g, w in zip(gm(x), f(x)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert _calls(gm) == ["view.default", "restride", "clone.default", "sum.dim_IntList", "t.default"]
