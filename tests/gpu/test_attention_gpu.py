"""kforge.attention on CUDA: the measured decision at head dim 512 (where eager runs the
memory-efficient kernel) and at 64 (flash), the rewritten graph's outputs against eager's, and
kforge.compile with the rewrite in its pass. Speed itself is bench/probe_attention.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kforge
from kforge import attention, graph

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]


class SingleHead(torch.nn.Module):
    def __init__(self, d: int, heads: int = 1):
        super().__init__()
        self.heads = heads
        self.proj = torch.nn.Linear(d, 3 * d).to("cuda", torch.bfloat16)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = (t.view(b, s, self.heads, c // self.heads).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, c)


def _trace(model, x):
    with torch.no_grad():
        t = graph.trace(model.eval(), (x,), {})
    (g,) = t.graphs
    return t, g


def test_the_decomposition_matches_the_fused_kernels_on_cuda_at_half_precision():
    torch.manual_seed(0)
    for shape in ((1, 1, 1024, 512), (2, 4, 257, 64), (1, 2, 1, 128)):
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        got = attention.decomposed(q, k, v, shape[-1] ** -0.5)
        fused = F.scaled_dot_product_attention(q, k, v)
        assert float((got.float() - ref).abs().max()) <= 2 * float((fused.float() - ref).abs().max()) + 1e-3


def test_head_dim_512_is_measured_and_the_rewritten_graph_equals_eager(monkeypatch):
    monkeypatch.setenv("KFORGE_ATTENTION", "")
    torch.manual_seed(0)
    model, x = SingleHead(512), torch.randn(1, 4096, 512, device="cuda", dtype=torch.bfloat16)
    t, g = _trace(model, x)
    decisions = [n for n in t.notes if n.startswith("attention")]
    fused = any("scaled_dot_product" in str(n.target) for n in g.module.graph.nodes)
    assert fused != bool(decisions)  # rewritten exactly where a note says so, with its numbers
    assert all("µs against" in n for n in decisions)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(g.module(*g.inputs)[0], want, rtol=2e-2, atol=2e-2)


def test_forced_rewrite_under_kforge_compile_equals_eager(monkeypatch):
    monkeypatch.setenv("KFORGE_ATTENTION", "decompose")
    from kforge.package import CastPackage
    from pathlib import Path

    pkg = CastPackage(Path("empty.cast"), {"format": 2, "gpu": {}, "cards": []}, [])
    torch.manual_seed(0)
    model, x = SingleHead(256, heads=2), torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        for mode in (None, "reduce-overhead"):
            torch._dynamo.reset()
            compiled = kforge.compile(model, pkg, mode=mode)
            for _ in range(3):
                got = compiled(x)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["all_true", "additive_causal"])
def test_a_traced_constant_mask_leaves_sdpa_fused_as_eager(kind):
    """transformers' traced BERT mask (`q_idx >= 0`, stride 0 along the keys) keeps every fused
    kernel off the call, and SDPA ran its math path (fp32 scores, _safe_softmax); dropped, the
    call runs a fused kernel, as eager's call without a mask does. Llama's traced causal mask
    (additive, the dtype's lowest value above the diagonal) becomes is_causal=True."""
    from test_masks import ConstantMask

    x = torch.randn(2, 16, 32, device="cuda", dtype=torch.bfloat16)
    _, g = _trace(ConstantMask(kind).cuda(), x)
    ops = [str(n.target) for n in g.module.graph.nodes if n.op == "call_function"]
    assert not any("_safe_softmax" in o or "bmm" in o or "where" in o for o in ops), ops
    sdpa = [n for n in g.module.graph.nodes if "_scaled_dot_product_" in str(n.target)]
    bound = [attention._bound(n) for n in sdpa]
    assert len(sdpa) == 2 and all(b.get("attn_mask") is None and b.get("attn_bias") is None for b in bound)
    assert all(bool(b.get("is_causal")) == (kind == "additive_causal") for b in bound)
    with torch.no_grad():
        torch.testing.assert_close(g.module(*g.inputs)[0], ConstantMask(kind).cuda()(x), rtol=2e-2, atol=2e-2)


def test_traced_repeated_keys_and_values_reach_sdpa_grouped():
    """transformers' repeat_kv, traced: with no mask left the fused call takes the two grouped
    key/value heads (enable_gqa) and nothing copies them to six."""
    from test_gqa import Grouped

    q, k, v = (torch.randn(1, h, 16, 8, device="cuda", dtype=torch.bfloat16) for h in (6, 2, 2))
    with torch.no_grad():
        t = graph.trace(Grouped("causal").eval(), (q, k, v), {})
    (g,) = t.graphs
    (call,) = [n for n in g.module.graph.nodes if "_scaled_dot_product_" in str(n.target)]
    assert attention._bound(call)["key"].meta["val"].shape[1] == 2, g.module.code
    assert not [n for n in g.module.graph.nodes if "clone" in str(n.target) or "expand" in str(n.target)]
    with torch.no_grad():
        torch.testing.assert_close(g.module(*g.inputs)[0], Grouped("causal")(q, k, v), rtol=2e-2, atol=2e-2)
