"""kforge.gqa: an SDPA call on keys and values repeated to the queries' heads (transformers'
repeat_kv, traced) takes the grouped ones with enable_gqa=True, and only where it has no mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge import gqa, masks

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def repeat_kv(x, n):  # transformers' form
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class Grouped(nn.Module):
    def __init__(self, mask: str = "none", unsqueeze: bool = False, interleave: bool = False):
        super().__init__()
        self.mask, self.unsqueeze, self.interleave = mask, unsqueeze, interleave

    def forward(self, q, k, v):
        if self.unsqueeze:
            kr, vr = (x.unsqueeze(2).expand(1, 2, 3, 16, 8).reshape(1, 6, 16, 8) for x in (k, v))
        elif self.interleave:
            kr, vr = k.repeat_interleave(3, dim=1), torch.repeat_interleave(v, 3, dim=1)
        else:
            kr, vr = repeat_kv(k, 3), repeat_kv(v, 3)
        if self.mask == "none":
            return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        i = torch.arange(16, device=q.device)
        m = i[None, :] <= i[:, None] if self.mask == "causal" else (q[:, :1, :, :1] > 0).expand(1, 1, 16, 16)
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=m)


def compiled(model, *inputs):
    seen = {}

    def backend(gm, example_inputs):
        notes: list[str] = []
        masks.apply(gm, notes)
        seen["count"] = gqa.apply(gm, notes)
        seen["notes"], seen["calls"] = notes, [n for n in gm.graph.nodes if n.target in masks.SDPA]
        return gm.forward

    with torch.no_grad():
        out = torch.compile(model, backend=backend)(*inputs)
    return out, seen


def inputs():
    return torch.randn(1, 6, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)


@pytest.mark.parametrize("model", [Grouped(), Grouped(unsqueeze=True), Grouped(interleave=True), Grouped("causal")],
                         ids=["repeat_kv", "unsqueeze", "repeat_interleave", "constant_causal_mask"])
def test_repeated_keys_and_values_become_grouped(model):
    q, k, v = inputs()
    out, seen = compiled(model, q, k, v)
    (call,) = seen["calls"]
    assert seen["count"] == 1 and call.kwargs.get("enable_gqa") is True
    assert [a.meta["example_value"].shape[1] for a in call.args[1:3]] == [2, 2]  # the grouped heads
    assert not [n for n in call.graph.nodes if "expand" in str(n.target) or "reshape" in str(n.target)
                or "repeat_interleave" in str(n.target)]
    assert any("enable_gqa" in n for n in seen["notes"])
    torch.testing.assert_close(out, model(q, k, v))


def test_a_call_with_a_mask_keeps_its_repeats():
    q, k, v = inputs()
    out, seen = compiled(Grouped("from_input"), q, k, v)
    assert seen["count"] == 0 and "enable_gqa" not in seen["calls"][0].kwargs
    torch.testing.assert_close(out, Grouped("from_input")(q, k, v))


def test_graph_capture_hands_the_fused_call_grouped_heads():
    """Through kforge.graph (kforge.optimize's and the region capture's graphs): the CPU's fused
    kernel takes the two grouped heads, and no op repeats them."""
    from kforge import graph

    q, k, v = inputs()
    with torch.no_grad():
        t = graph.trace(Grouped("causal").eval(), (q, k, v), {})
    (g,) = t.graphs
    ops = [str(n.target) for n in g.module.graph.nodes if n.op == "call_function"]
    (call,) = [n for n in g.module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert call.args[1].meta["val"].shape[1] == 2 and not any("expand" in o or "clone" in o for o in ops)
    with torch.no_grad():
        torch.testing.assert_close(g.module(*g.inputs)[0], Grouped("causal")(q, k, v))


def test_a_repeat_that_is_not_repeat_kv_is_left_alone():
    """Heads repeated in blocks (repeat, not repeat_interleave), or interleaved along another dim,
    are not what enable_gqa means."""
    class Tiled(nn.Module):
        def forward(self, q, k, v):
            kr, vr = (x[:, None].expand(1, 3, 2, 16, 8).reshape(1, 6, 16, 8) for x in (k, v))
            return F.scaled_dot_product_attention(q, kr, vr)

    class Sideways(nn.Module):  # keys repeated along the sequence: a different attention
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q[:, :2].repeat_interleave(3, dim=2), k.repeat_interleave(3, dim=2),
                                                  v.repeat_interleave(3, dim=2))

    q, k, v = inputs()
    out, seen = compiled(Sideways(), q, k, v)
    assert seen["count"] == 0
    torch.testing.assert_close(out, Sideways()(q, k, v))

    q, k, v = inputs()
    out, seen = compiled(Tiled(), q, k, v)
    assert seen["count"] == 0
    torch.testing.assert_close(out, Tiled()(q, k, v))
