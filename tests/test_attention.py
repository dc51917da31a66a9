"""kforge.attention on the CPU: which fused attention calls are candidates, the decomposition's
numerics and strides against SDPA, the rewrite in the traced graphs kforge.optimize and capture
run, in kforge.compile's pass, and its switches. Measuring (auto mode) needs CUDA: the GPU test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kforge
from kforge import attention, graph

aten = torch.ops.aten


class Heads(torch.nn.Module):
    """Multi-head self-attention over (b, s, c), SDPA's output transposed back (a view that needs
    the fused call's (b, s, h, d) layout), with SDPA's options as arguments."""

    def __init__(self, heads: int = 4, **sdpa):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.proj = torch.nn.Linear(32, 96)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = (t.view(b, s, self.heads, c // self.heads).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, **self.sdpa)
        return o.transpose(1, 2).reshape(b, s, c)


def ops_of(gm) -> list[str]:
    return [n.target.name() for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "name")]


def traced(model, x, monkeypatch, mode="decompose"):
    monkeypatch.setenv("KFORGE_ATTENTION", mode)
    torch._dynamo.reset()
    with torch.no_grad():
        t = graph.trace(model.eval(), (x,), {})
    assert len(t.graphs) == 1
    return t


@pytest.mark.parametrize("heads", [1, 4])
def test_the_traced_graph_runs_matmul_softmax_matmul_and_equals_sdpa(monkeypatch, heads):
    torch.manual_seed(0)
    model, x = Heads(heads), torch.randn(2, 24, 32)
    t = traced(model, x, monkeypatch)
    ops = ops_of(t.graphs[0].module)
    assert not any("scaled_dot_product" in o for o in ops)
    assert ops.count("aten::bmm") == 2 and "aten::_softmax" in ops
    assert any("runs" not in n and "KFORGE_ATTENTION=decompose" in n for n in t.notes)
    with torch.no_grad():
        torch.testing.assert_close(t.graphs[0].module(*t.graphs[0].inputs)[0], model(x), rtol=1e-5, atol=1e-5)
        other = torch.randn(2, 24, 32)
        torch.testing.assert_close(t.graphs[0].module(other, *t.graphs[0].inputs[1:])[0], model(other),
                                   rtol=1e-5, atol=1e-5)


def fused_node(**kwargs) -> torch.fx.Node:
    q = torch.randn(1, 2, 8, 4)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, **kwargs)[0], tracing_mode="fake")(q)
    return next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))


def test_causal_or_dropout_attention_stays_fused(monkeypatch):
    t = traced(Heads(is_causal=True), torch.randn(2, 8, 32), monkeypatch)
    assert any("scaled_dot_product" in o for o in ops_of(t.graphs[0].module))
    assert attention.site(fused_node(is_causal=True)) is None
    assert attention.site(fused_node(dropout_p=0.5)) is None  # (eager on the CPU runs dropout unfused)
    assert attention.site(fused_node()) is not None


def test_a_masked_attention_stays_fused(monkeypatch):
    class Masked(Heads):
        def forward(self, x):
            b, s, c = x.shape
            q = x.view(b, s, 4, c // 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(s, s, dtype=torch.bool).tril())

    t = traced(Masked(), torch.randn(2, 8, 32), monkeypatch)
    assert any("scaled_dot_product" in o for o in ops_of(t.graphs[0].module))


def test_keep_and_the_cpu_without_measurement_leave_it_fused(monkeypatch):
    for mode in ("keep", ""):
        t = traced(Heads(), torch.randn(2, 8, 32), monkeypatch, mode)
        assert any("scaled_dot_product" in o for o in ops_of(t.graphs[0].module))
        assert not any("attention" in n for n in t.notes)


def test_a_call_whose_log_sum_exp_is_used_is_no_candidate():
    q = torch.randn(1, 2, 8, 4)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[1], tracing_mode="fake")(q)
    node = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert attention.site(node) is None
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, scale=0.5)[0], tracing_mode="fake")(q)
    node = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert attention.site(node).scale == 0.5


@pytest.mark.parametrize("shape_q, shape_kv, dv", [((2, 3, 5, 8), (2, 3, 7, 8), 6), ((1, 1, 16, 4), (1, 1, 16, 4), 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decomposition_equals_sdpa_for_other_lengths_value_dims_and_scales(shape_q, shape_kv, dv, dtype):
    torch.manual_seed(1)
    q = torch.randn(shape_q, dtype=dtype)
    k = torch.randn(shape_kv, dtype=dtype)
    v = torch.randn(*shape_kv[:3], dv, dtype=dtype)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for scale in (None, 0.3):
        want = F.scaled_dot_product_attention(q, k, v, scale=scale)
        got = attention.decomposed(q, k, v, scale if scale is not None else shape_q[-1] ** -0.5)
        torch.testing.assert_close(got, want, **tol)


def test_the_output_takes_the_fused_calls_stride_order():
    q = torch.randn(2, 3, 5, 4)
    want_stride = torch.empty(2, 5, 3, 4).transpose(1, 2).stride()
    out = attention.decomposed(q, q, q, 0.5, want_stride)
    assert out.stride() == want_stride
    assert attention.decomposed(q, q, q, 0.5, q.stride()).stride() == q.stride()


def test_scores_over_the_memory_bound_stay_fused(monkeypatch):
    monkeypatch.setattr(attention, "CPU_SCORES_BYTES", 2 * 8 * 8 * 4 * 4 - 1)  # b*h*s*s fp32, one byte short
    t = traced(Heads(), torch.randn(2, 8, 32), monkeypatch)
    assert any("scaled_dot_product" in o for o in ops_of(t.graphs[0].module))
    monkeypatch.setattr(attention, "CPU_SCORES_BYTES", 2 * 8 * 8 * 4 * 4)
    t = traced(Heads(), torch.randn(2, 8, 32), monkeypatch)
    assert not any("scaled_dot_product" in o for o in ops_of(t.graphs[0].module))


def test_kforge_compile_runs_the_rewrite_in_its_pass_and_equals_eager(monkeypatch):
    from test_compile_pass import fake_package

    monkeypatch.setenv("KFORGE_ATTENTION", "decompose")
    seen = []
    real = attention.apply

    def spy(g, notes=None, table=None):
        n = real(g, notes, table)
        seen.append((n, table is not None))
        return n

    monkeypatch.setattr(attention, "apply", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Heads().eval(), torch.randn(2, 16, 32)
    with torch.no_grad():
        got = kforge.compile(model, fake_package())(x)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    assert (1, True) in seen  # rewritten in Inductor's post-grad graph, through Inductor's decompositions


def test_the_rewrite_is_part_of_the_pass_uuid_and_keep_removes_it(monkeypatch):
    from test_compile_pass import fake_package

    pkg = fake_package()
    monkeypatch.setenv("KFORGE_ATTENTION", "")
    measured = pkg.inductor_options()["post_grad_custom_post_pass"]
    assert [r.key for r in measured.rewrites] == [f"attention:{attention.VERSION}:measured"]
    monkeypatch.setenv("KFORGE_ATTENTION", "decompose")
    assert pkg.inductor_options()["post_grad_custom_post_pass"].uuid() != measured.uuid()
    monkeypatch.setenv("KFORGE_ATTENTION", "keep")
    assert pkg.inductor_options()["post_grad_custom_post_pass"].rewrites == []
    torch._dynamo.reset()
    model = torch.nn.ReLU()
    compiled = kforge.compile(model, pkg)  # nothing to put in: plain torch.compile
    assert compiled._orig_mod is model


def test_auto_mode_measures_only_on_cuda():
    q = torch.randn(1, 1, 8, 4)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[0], tracing_mode="fake")(q)
    s = attention.site(next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)))
    d = attention.decide(s)
    assert not d.rewrite and "CUDA" in d.why
