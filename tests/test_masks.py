"""Graph capture drops the attention masks built from no input that mask nothing (transformers
builds one only while it is traced; eager passes none), runs those that are SDPA's causal mask
as is_causal=True (Llama's, traced), and keeps every other mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kforge import graph

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def heads(x):
    return x.view(2, 16, 4, 8).transpose(1, 2)


class ConstantMask(nn.Module):
    """BERT as transformers 5.17 traces it with no padding mask: `q_idx >= 0` expanded over the
    keys (stride 0 along them), once, for two attention calls."""

    def __init__(self, kind: str = "all_true"):
        super().__init__()
        self.kind = kind
        self.register_buffer("ones", torch.ones(16, 16, dtype=torch.bool))

    def mask(self, x):
        q_idx = torch.arange(16, device=x.device) + 0
        if self.kind == "all_true":
            return (q_idx[None, None, :, None] >= 0).expand(2, -1, 16, 16)
        if self.kind == "additive_zero":
            return torch.zeros(16, 16, device=x.device, dtype=x.dtype)
        if self.kind == "additive_zero_fp32":  # fp32 whatever the queries' dtype
            return torch.zeros(16, 16, device=x.device)
        if self.kind == "causal":
            return q_idx[None, :] <= q_idx[:, None]
        if self.kind == "additive_causal":  # transformers' form: the dtype's lowest value where masked
            keep = (q_idx[None, :] <= q_idx[:, None]).expand(2, 1, 16, 16)
            return torch.where(keep, torch.tensor(0.0, dtype=x.dtype), torch.tensor(torch.finfo(x.dtype).min, dtype=x.dtype))
        if self.kind == "bf16_lowest_in_fp32":  # a bf16 model's finfo.min in an fp32 mask (as on the GPU)
            keep = q_idx[None, :] <= q_idx[:, None]
            return torch.where(keep, torch.tensor(0.0), torch.tensor(torch.finfo(torch.bfloat16).min))
        if self.kind == "causal_minus_inf":
            return torch.zeros(16, 16, device=x.device).masked_fill(q_idx[None, :] > q_idx[:, None], float("-inf"))
        if self.kind == "strictly_causal":  # the diagonal masked too: not SDPA's causal mask
            return q_idx[None, :] < q_idx[:, None] + (q_idx[:, None] == 0)
        if self.kind == "causal_but_additive_minus_one":  # -1 where masked: scores move, are not dropped
            return torch.where(q_idx[None, :] <= q_idx[:, None], torch.tensor(0.0), torch.tensor(-1.0))
        if self.kind == "random":
            return torch.rand(16, 16, device=x.device) > -1.0
        if self.kind == "buffer":
            return self.ones & (q_idx[:, None] >= 0)
        if self.kind == "written_in_place":  # a constant the graph then writes: the write must count
            m = torch.ones(16, 16, dtype=torch.bool, device=x.device)
            m[:, 8:] = False
            return m
        if self.kind == "tril_in_place":
            m = torch.ones(16, 16, dtype=torch.bool, device=x.device)
            m.tril_()
            return m
        if self.kind == "padding_written_into_causal":  # transformers 4.4x: causal, then the padding written in
            m = torch.zeros(16, 16, device=x.device).masked_fill(q_idx[None, :] > q_idx[:, None], float("-inf"))
            m = m[None, None].expand(2, 1, 16, 16).clone()
            m[..., :4] = m[..., :4].masked_fill(x[:, None, None, :4, 0] < 0, float("-inf"))
            return m
        if self.kind == "from_input":
            return (x[:, :, :1] > -1e9).transpose(1, 2).unsqueeze(1).expand(2, 1, 16, 16)
        raise ValueError(self.kind)

    def forward(self, x):
        m = self.mask(x)
        y = F.scaled_dot_product_attention(heads(x), heads(x * 2.0), heads(x), attn_mask=m)
        return F.scaled_dot_product_attention(y, y, y, m).transpose(1, 2).reshape(2, 16, 32)


def trace(model, x):
    with torch.no_grad():
        return graph.trace(model.eval(), (x,), {})


def sdpa_masks(t: graph.Trace) -> list:
    nodes = [n for g in t.graphs for n in g.module.graph.nodes
             if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    assert len(nodes) == 2
    return [n.kwargs.get("attn_mask") for n in nodes]  # keyword-only in the fused ops' schemas


@pytest.mark.parametrize("kind", ["all_true", "additive_zero"])
def test_a_constant_mask_that_masks_nothing_is_dropped(kind):
    x = torch.randn(2, 16, 32)
    t = trace(ConstantMask(kind), x)
    assert sdpa_masks(t) == [None, None]
    assert any("mask nothing" in n for n in t.notes)
    ops = {str(n.target) for g in t.graphs for n in g.module.graph.nodes}
    assert not {"aten.ge.Scalar", "aten.arange.default", "aten.zeros.default", "aten.where.self"} & ops
    (g,) = t.graphs
    with torch.no_grad():
        torch.testing.assert_close(g.module(*g.inputs)[0], ConstantMask(kind)(x))


@pytest.mark.parametrize("kind", ["causal", "additive_causal", "bf16_lowest_in_fp32", "causal_minus_inf"])
def test_a_constant_causal_mask_becomes_is_causal(kind):
    x = torch.randn(2, 16, 32)
    t = trace(ConstantMask(kind), x)
    assert sdpa_masks(t) == [None, None] and any("is_causal=True" in n for n in t.notes)
    nodes = [n for g in t.graphs for n in g.module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert all(n.args[4] is True for n in nodes)  # (q, k, v, dropout_p, is_causal)
    (g,) = t.graphs
    with torch.no_grad():
        torch.testing.assert_close(g.module(*g.inputs)[0], ConstantMask(kind)(x))


@pytest.mark.parametrize("kind", ["strictly_causal", "causal_but_additive_minus_one", "random", "buffer", "from_input",
                                  "written_in_place", "tril_in_place", "padding_written_into_causal"])
def test_masks_that_mask_something_or_are_not_constants_are_kept(kind):
    x = torch.randn(2, 16, 32)
    t = trace(ConstantMask(kind), x)
    assert all(m is not None for m in sdpa_masks(t))
    assert not any("mask nothing" in n for n in t.notes)


def test_an_fp32_causal_mask_on_half_precision_queries_is_left_to_eager():
    """SDPA takes an fp32 mask with bf16 queries, and on Hopper its cuDNN kernel reads the mask as
    bf16: a causal one means whatever eager makes of it, so kforge leaves it as it is. Zeros read
    as zeros in any dtype: an fp32 mask that masks nothing is dropped as ever."""
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    t = trace(ConstantMask("bf16_lowest_in_fp32"), x)
    assert all(m is not None for m in sdpa_masks(t))
    assert not any("is_causal=True" in n for n in t.notes)
    t = trace(ConstantMask("additive_zero_fp32"), x)
    assert sdpa_masks(t) == [None, None]


def test_masks_nothing_reads_bool_and_additive_masks():
    from kforge.masks import masks_nothing

    assert masks_nothing(torch.ones(3, 3, dtype=torch.bool).expand(2, 3, 3))
    assert not masks_nothing(torch.eye(3, dtype=torch.bool))
    assert masks_nothing(torch.zeros(4)) and not masks_nothing(torch.tensor([0.0, -1.0]))
    assert not masks_nothing(torch.zeros(4, dtype=torch.int64)) and not masks_nothing(None)
