"""Values a traced graph computes from none of its inputs are computed once (kforge.fold): a
causal mask and a position range become one call each that returns the same tensor on every
forward; what could change or be written (random draws, undefined allocations, graph outputs,
values a reader writes in place, values over the size cap) is left as it is."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from kforge import fold


def _traced(f, *args):
    return make_fx(f, tracing_mode="fake")(*args)


def _calls(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def masked_softmax(x):
    mask = torch.full((x.shape[-1], x.shape[-1]), float("-inf")).triu(1)
    pos = torch.arange(x.shape[-1], dtype=torch.float32)
    return torch.softmax(x + mask, -1) * pos


def test_a_causal_mask_and_positions_are_computed_once():
    x = torch.randn(2, 8, 8)
    gm = _traced(masked_softmax, x)
    assert fold.fold(gm.graph) == 2
    gm.recompile()
    assert not {"full.default", "triu.default", "arange.start_step", "arange.default"} & set(_calls(gm))
    torch.testing.assert_close(gm(x), masked_softmax(x), rtol=0, atol=0)
    want, y = masked_softmax(2 * x), 2 * x
    with _Ops() as seen:
        got = gm(y)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not {"full", "triu", "arange"} & set(seen.names), seen.names  # the second forward makes none


def test_what_could_change_or_be_written_is_not_folded(monkeypatch):
    def f(x):
        noise = torch.rand(4)  # a random draw
        scratch = torch.empty(4)  # undefined contents
        out_const = torch.ones(4) * 3  # a graph output: the caller may write it
        acc = torch.zeros(4)
        acc.add_(x)  # written in place by its reader
        return x + noise + scratch.fill_(1), out_const, acc

    gm = _traced(f, torch.randn(4))
    before = _calls(gm)
    assert fold.fold(gm.graph) == 0
    gm.recompile()
    assert _calls(gm) == before

    monkeypatch.setattr(fold, "MAX_BYTES", 63)  # the mask is 256 bytes, the positions 32
    gm = _traced(masked_softmax, torch.randn(2, 8, 8))
    assert fold.fold(gm.graph) == 1
    gm.recompile()
    assert "triu.default" in _calls(gm) and "arange.start_step" not in _calls(gm)


def standardized(w, x):
    """A weight standardization (NFNet's, BiT's) before a matmul, and the weight's transpose."""
    ws = (w - w.mean(1, keepdim=True)) / (w.var(1, keepdim=True, unbiased=False) + 1e-5).sqrt()
    return x @ ws.t() + x @ w.t()


def test_a_value_of_weights_is_computed_again_only_when_a_weight_changes():
    w, x = torch.randn(6, 5), torch.randn(3, 5)
    gm = _traced(standardized, w, x)
    assert fold.fold(gm.graph) == 0  # no weights named: both are inputs like any other
    assert fold.fold(gm.graph, [0]) == 1  # the standardized weight; the transpose alone is a view, left
    gm.recompile()
    assert "t.default" in _calls(gm) and "var.correction" not in _calls(gm)
    torch.testing.assert_close(gm(w, x), standardized(w, x), rtol=0, atol=0)
    with _Ops() as seen:
        gm(w, 2 * x)
    assert "var" not in seen.names and "mean" not in seen.names, seen.names  # the second forward reuses it
    with torch.no_grad():
        w.mul_(3).add_(1)  # written in place (load_state_dict copies into the parameter so)
    with _Ops() as seen:
        torch.testing.assert_close(gm(w, x), standardized(w, x), rtol=0, atol=0)
    assert "var" in seen.names
    other = torch.randn(6, 5)  # another tensor (a parameter replaced)
    torch.testing.assert_close(gm(other, x), standardized(other, x), rtol=0, atol=0)
    other.data = torch.randn(6, 5)  # other memory, the same version
    torch.testing.assert_close(gm(other, x), standardized(other, x), rtol=0, atol=0)
    with torch.inference_mode():  # no version counter: computed on every call
        frozen = torch.randn(6, 5)
    for _ in range(2):
        with _Ops() as seen:
            torch.testing.assert_close(gm(frozen, x), standardized(frozen, x), rtol=0, atol=0)
        assert "var" in seen.names


def test_a_value_of_weights_is_recomputed_in_its_own_memory_before_a_graph_replay():
    """A CUDA graph reads the kept value at its address (kforge.replay): a weight written since is
    recomputed into that memory, by the call or, before a replay, by refresh() of each holder the
    graph's capture recorded."""
    w, x = torch.randn(6, 5), torch.randn(3, 5)
    gm = _traced(standardized, w, x)
    fold.fold(gm.graph, [0])
    gm.recompile()
    (holder,) = [n.target for n in gm.graph.nodes if isinstance(n.target, fold.Folded)]
    with fold.recording() as held:
        gm(w, x)
    assert held == [holder] and holder.refresh() and holder.weights() == [w]
    kept = holder.value
    with torch.no_grad():
        w.mul_(-2)
    with _Ops() as seen:
        assert holder.refresh()
    assert "var" in seen.names and holder.value is kept
    torch.testing.assert_close(gm(w, x), standardized(w, x), rtol=0, atol=0)
    w.data = torch.randn(6, 5)  # other memory: the graph must run op by op, which recomputes in place
    assert not holder.refresh()
    torch.testing.assert_close(gm(w, x), standardized(w, x), rtol=0, atol=0)
    assert holder.value is kept and holder.refresh()


def test_values_of_weights_stay_within_their_budget(monkeypatch):
    monkeypatch.setattr(fold, "WEIGHT_BYTES", 6 * 5 * 4 - 1)  # the standardized weight is 120 bytes
    gm = _traced(standardized, torch.randn(6, 5), torch.randn(3, 5))
    assert fold.fold(gm.graph, [0]) == 0


def scaled_standardized(w, g, x):
    """timm's ScaledStdConv2d: the weight standardized by a batch norm in training form (three outputs)."""
    ws = torch.nn.functional.batch_norm(w.reshape(1, 6, -1), None, None, weight=g.view(-1), training=True,
                                        momentum=0.0, eps=1e-5).reshape_as(w)
    return x @ ws.t()


def test_one_output_of_a_node_with_several_is_folded():
    w, g, x = torch.randn(6, 5), torch.randn(6), torch.randn(3, 5)
    gm = _traced(scaled_standardized, w, g, x)
    assert fold.fold(gm.graph, [0, 1]) == 1
    gm.recompile()
    assert not any("batch_norm" in c for c in _calls(gm)), _calls(gm)
    torch.testing.assert_close(gm(w, g, x), scaled_standardized(w, g, x), rtol=0, atol=0)
    with torch.no_grad():
        g.mul_(2)
    torch.testing.assert_close(gm(w, g, x), scaled_standardized(w, g, x), rtol=0, atol=0)


def test_views_of_weights_alone_are_left_as_they_are():
    """A weight split in three and transposed (a fused qkv projection's weight) is views only."""
    def qkv(w, x):
        q, k, v = w.unbind(0)
        return x @ q.t() + x @ k.t() + x @ v.t()

    gm = _traced(qkv, torch.randn(3, 4, 5), torch.randn(2, 5))
    before = _calls(gm)
    assert fold.fold(gm.graph, [0]) == 0
    gm.recompile()
    assert _calls(gm) == before
