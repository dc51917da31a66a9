"""kforge inside torch.compile, on the CPU: CPU cards in a fake package stand in for CUDA ones,
Python "kernels" (FakeLauncher) compute eager's result and count their calls.

Most tests run the pass on graphs traced as Inductor traces them (make_fx with kforge's
decomposition table, FakeTensors in node.meta["val"]); one compiles a model end to end with
Inductor's C++ backend, which is slow on a small machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import kforge
from kforge import customops, inductor
from kforge.candidate import Candidate, LaunchPlan
from kforge.dispatch import native_status
from kforge.package import CastPackage, PackagedCard
from test_dispatch import FakeLauncher, make_card, relu_kernel, softmax_kernel, to_copy_card

aten = torch.ops.aten

PLAN = LaunchPlan.from_json({"kernels": [{"name": "k", "grid": [1, 1, 1], "block": [32, 1, 1],
                                          "args": [{"in": 0}, {"out": 0}]}]})


def fake_package(*cards, decisions=None, compile_decisions=None, name="fake.cast") -> CastPackage:
    """A package of CPU cards, every one dispatched (eager and compiled) unless `decisions` (both)
    or `compile_decisions` (compiled graphs') say otherwise."""
    decisions = decisions or ["dispatched"] * len(cards)
    compile_decisions = compile_decisions or decisions
    packaged = [PackagedCard(c, d, "test", "custom", {"id": c.id},
                             Candidate(f'extern "C" __global__ void k() {{}} // {c.id}', PLAN),
                             compile_decision=cd, compile_reason="test")
                for c, d, cd in zip(cards, decisions, compile_decisions)]
    manifest = {"format": 2, "gpu": {"name": "cpu", "arch": "cpu"}, "cards": [{"id": c.id} for c in cards]}
    return CastPackage(Path(name), manifest, packaged)


def group_norm_kernel(groups, eps):
    def kernel(ins, outs):
        x, w, b = ins
        n, c = x.shape[:2]
        out, mean, rstd = aten.native_group_norm.default(x, w, b, n, c, x[0, 0].numel(), groups, eps)
        for o, r in zip(outs, (out, mean, rstd)):
            o.copy_(r)
    return kernel


def traced(fn, *inputs, rewrites=()):
    """fn as Inductor's post-grad passes see it: aten ops after kforge's decomposition table."""
    return make_fx(fn, tracing_mode="fake", decomposition_table=inductor._decompositions(rewrites))(*inputs)


def kernel_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("kforge.")]


def test_the_pass_replaces_exactly_the_nodes_a_guard_matches():
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    launcher = FakeLauncher(relu_kernel, softmax_kernel(1))
    pkg = fake_package(make_card(aten.relu.default, x), make_card(aten._softmax.default, y, 1, False))
    rewrites = inductor._rewrites(pkg, launcher)

    def fn(x, xt, xd, y):
        return (torch.relu(x), torch.relu(xt.t()), torch.relu(xd),  # hit; another stride; another dtype
                torch.softmax(y, 1), torch.softmax(y, 0), torch.softmax(y[:4], 1))  # hit; another dim; shape
    inputs = (x, torch.randn(8, 4), x.double(), y)
    gm = traced(fn, *inputs, rewrites=rewrites)
    # The softmax the card matches reached the pass whole; the others decomposed as Inductor's do.
    assert [n.args[1:] for n in gm.graph.nodes if n.target is aten._softmax.default] == [(1, False)]

    assert sum(r(gm.graph) for r in rewrites) == 2
    gm.recompile()
    hits = kernel_nodes(gm)
    assert [n.args[0].name for n in hits] == ["x_1", "y_1"]
    assert len([n for n in gm.graph.nodes if n.target is aten.relu.default]) == 2
    for got, want in zip(gm(*inputs), fn(*inputs)):
        torch.testing.assert_close(got, want)
    assert [vid for vid, *_ in launcher.calls] == [0, 1]
    assert [c.counters.hits for c in pkg.cards] == [1, 1]


def test_a_scalar_argument_and_an_alignment_outside_the_card_are_left_to_inductor():
    x = torch.randn(4, 8)
    launcher = FakeLauncher(lambda ins, outs: outs[0].copy_(F.leaky_relu(ins[0], 0.2)))
    pkg = fake_package(make_card(aten.leaky_relu.default, x, 0.2))
    rewrites = inductor._rewrites(pkg, launcher)

    def fn(x, big):
        return F.leaky_relu(x, 0.2), F.leaky_relu(x, 0.3), F.leaky_relu(big[1:33].view(4, 8), 0.2)
    gm = traced(fn, x, torch.randn(40), rewrites=rewrites)
    assert sum(r(gm.graph) for r in rewrites) == 1
    assert [n.args[0].name for n in kernel_nodes(gm)] == ["x_1"]


def test_a_device_argument_naming_another_device_index_is_left_to_inductor():
    x = torch.randn(4, 8)
    pkg = fake_package(to_copy_card(x, torch.device("cpu")))
    (rewrite,) = inductor._rewrites(pkg, FakeLauncher(lambda ins, outs: outs[0].copy_(ins[0])))
    assert rewrite.match(aten._to_copy.default, (x,), {"dtype": x.dtype, "device": torch.device("cpu")}) is not None
    assert rewrite.match(aten._to_copy.default, (x,), {"dtype": x.dtype, "device": torch.device("cpu", 1)}) is None


def test_fallback_and_in_place_cards_stay_out_of_graphs():
    x = torch.randn(4, 8)
    relu_inplace = make_card(aten.relu_.default, x.clone(), aliases={0: 0})
    assert "writes its inputs" in customops.op_blocker(relu_inplace)
    pkg = fake_package(make_card(aten.relu.default, x), relu_inplace, decisions=["fallback", "dispatched"])
    assert inductor._rewrites(pkg, FakeLauncher(relu_kernel, relu_kernel)) == []


def test_a_card_whose_compile_decision_is_not_dispatched_stays_inductors():
    """Eager dispatch takes the kernel; compiled graphs only where it beat torch.compile's time."""
    x = torch.randn(4, 8)
    relu, sigmoid, tanh = (make_card(op, x) for op in (aten.relu.default, aten.sigmoid.default, aten.tanh.default))
    pkg = fake_package(relu, sigmoid, tanh, decisions=["dispatched", "dispatched", "fallback"],
                       compile_decisions=["fallback", None, "dispatched"])
    launcher = FakeLauncher(relu_kernel, relu_kernel, relu_kernel)
    (rewrite,) = inductor._rewrites(pkg, launcher)
    assert rewrite.ops == [aten.tanh.default]
    gm = traced(lambda t: torch.tanh(torch.sigmoid(torch.relu(t))), x, rewrites=[rewrite])
    assert rewrite(gm.graph) == 1
    assert sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function") == [
        "aten.relu.default", "aten.sigmoid.default", f"kforge.{customops.op_name(tanh, pkg.cards[2].candidate.digest())}.default"]
    assert [v.card.id for v in pkg.variants(launcher)] == [relu.id, sigmoid.id]  # eager's own decision


def test_region_cards_stay_kforge_optimizes_and_op_cards_keep_their_kernel_and_variant():
    x = torch.randn(4, 8)
    relu = make_card(aten.relu.default, x)
    region = dataclasses.replace(make_card(aten.sigmoid.default, x), region=object(), id="0123456789abcdef")
    pkg = fake_package(region, relu)
    launcher = FakeLauncher(relu_kernel, relu_kernel)
    (rewrite,) = inductor._rewrites(pkg, launcher)
    op = rewrite.match(aten.relu.default, (x,), {})
    assert op.name() == f"kforge::{customops.op_name(relu, pkg.cards[1].candidate.digest())}"
    op(x)
    assert [vid for vid, *_ in launcher.calls] == [1]  # its place in the launcher's registry, after the region's


def test_the_custom_op_has_the_cards_outputs_under_fake_mode_and_runs_nothing():
    x, w, b = torch.randn(2, 4, 3, 3).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), torch.randn(4), torch.randn(4)
    card = make_card(aten.native_group_norm.default, x, w, b, 2, 4, 9, 2, 1e-5)
    launcher = FakeLauncher(group_norm_kernel(2, 1e-5))
    (rewrite,) = inductor._rewrites(fake_package(card), launcher)
    op = rewrite.match(aten.native_group_norm.default, (x, w, b, 2, 4, 9, 2, 1e-5), {})
    assert op is not None and op.namespace == "kforge"
    with FakeTensorMode() as mode:
        outs = op(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b))
    assert [(tuple(o.shape), o.stride(), o.dtype) for o in outs] == [(m.shape, m.stride, m.torch_dtype) for m in card.outputs]
    assert outs[0].stride() == x.stride() and not launcher.calls


def test_a_misaligned_input_at_run_time_goes_to_eager_and_is_counted():
    x = torch.randn(4, 8)
    launcher = FakeLauncher(relu_kernel)
    pkg = fake_package(make_card(aten.relu.default, x))
    (rewrite,) = inductor._rewrites(pkg, launcher)
    op = rewrite.match(aten.relu.default, (x,), {})
    base = torch.randn(33)
    shifted = base[1:].view(4, 8)  # the shape and strides the guard saw in the graph, 4 bytes off
    torch.testing.assert_close(op(shifted), shifted.clamp(min=0))
    assert not launcher.calls and pkg.cards[0].counters.fallbacks == {"alignment": 1}
    op(x)
    assert len(launcher.calls) == 1 and pkg.cards[0].counters.hits == 1


def test_uuid_is_the_package_and_changes_with_it():
    x = torch.randn(4, 8)
    relu, sm = make_card(aten.relu.default, x), make_card(aten._softmax.default, x, 1, False)
    launcher = FakeLauncher(relu_kernel, softmax_kernel(1))

    def uuid(pkg, keeps_whole=True):
        return inductor.KforgePass(pkg.digest, inductor._rewrites(pkg, launcher), keeps_whole=keeps_whole).uuid()
    base = uuid(fake_package(relu, sm))
    assert uuid(fake_package(relu, sm)) == base  # a fresh load of the same package: Inductor's caches hit
    assert uuid(fake_package(relu, sm, decisions=["dispatched", "fallback"])) != base
    assert uuid(fake_package(relu, make_card(aten._softmax.default, x, 0, False))) != base
    assert uuid(fake_package(relu, sm), keeps_whole=False) != base  # another decomposition table
    options = fake_package(relu, sm).inductor_options(launcher=launcher)
    assert options["post_grad_custom_post_pass"].uuid() == uuid(fake_package(relu, sm), keeps_whole=False)


def test_an_unsupported_torch_compiles_without_the_pass_and_says_why(monkeypatch):
    import torch._inductor.custom_graph_pass as custom_graph_pass

    monkeypatch.delattr(custom_graph_pass, "CustomGraphPass")
    pkg = fake_package(make_card(aten.relu.default, torch.randn(4, 8)))
    model = torch.nn.ReLU()
    with pytest.warns(inductor.CompileFallbackWarning, match="no torch._inductor.custom_graph_pass.CustomGraphPass"):
        compiled = kforge.compile(model, pkg, launcher=FakeLauncher(relu_kernel))
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule) and compiled._orig_mod is model
    with pytest.warns(inductor.CompileFallbackWarning, match="plain torch.compile"):
        assert pkg.inductor_options(launcher=FakeLauncher(relu_kernel)) == {}
    assert not pkg.cards[0].counters.hits


def test_kforge_compile_is_the_model_api_and_refuses_another_backend():
    assert kforge.compile is inductor.compile and kforge.compiler.compile is not inductor.compile
    pkg = fake_package(make_card(aten.relu.default, torch.randn(4, 8)))
    with pytest.raises(kforge.KforgeError, match="backend='eager' is not Inductor"):
        kforge.compile(torch.nn.ReLU(), pkg, backend="eager")


class GroupNormReLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 4)

    def forward(self, x):
        return torch.relu(self.norm(x)) * 2


def test_compiled_model_runs_the_kernels_inductor_runs_the_rest_and_equals_eager():
    torch._dynamo.reset()
    model = GroupNormReLU().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 4, 3, 3)
    card = make_card(aten.native_group_norm.default, x, model.norm.weight, model.norm.bias, 2, 4, 9, 2, 1e-5)
    launcher = FakeLauncher(group_norm_kernel(2, 1e-5))
    pkg = fake_package(card)
    compiled = pkg.compile(model, launcher=launcher)
    with torch.no_grad():
        want = model(x)
        got = compiled(x)
        again = compiled(torch.randn(2, 4, 3, 3))
    torch.testing.assert_close(got, want)
    assert again.shape == want.shape
    assert len(launcher.calls) == 2 and pkg.cards[0].counters.hits == 2  # the kernel ran each forward


def test_where_kforge_dispatch_serves_it_the_custom_op_is_its_cpp_kernel(monkeypatch):
    monkeypatch.delenv("KFORGE_DISPATCH", raising=False)
    ok, why = native_status("CPU")
    if not ok:
        pytest.skip(why)
    from test_dispatch import RELU, NativeLauncher, calls

    x = torch.randn(4, 8)
    launcher = NativeLauncher(RELU)
    pkg = fake_package(make_card(aten.relu.default, x))
    (rewrite,) = inductor._rewrites(pkg, launcher)
    op = rewrite.match(aten.relu.default, (x,), {})
    before = calls()
    torch.testing.assert_close(op(x), x.clamp(min=0))
    assert calls() == before + 1 and launcher.python_calls == 0  # the C++ launcher ran it, no Python kernel
    shifted = torch.randn(33)[1:].view(4, 8)
    torch.testing.assert_close(op(shifted), shifted.clamp(min=0))  # the C++ guard's miss: eager's relu
    assert calls() == before + 1 and launcher.python_calls == 0
    assert pkg.cards[0].counters.hits == 1 and pkg.cards[0].counters.fallbacks == {"alignment": 1}


def test_the_options_survive_inductors_deepcopy_of_its_config():
    """cudagraph trees deep-copy Inductor's config, options and pass included; the pass holds
    loaded kernels (a C++ registry on the GPU), which must not be copied."""
    import copy

    class Uncopyable:
        def __deepcopy__(self, memo):
            raise TypeError("cannot pickle 'kforge._C.Registry' object")

    x = torch.randn(4, 8)
    launcher = FakeLauncher(relu_kernel)
    launcher.registry = Uncopyable()
    options = fake_package(make_card(aten.relu.default, x)).inductor_options(launcher=launcher)
    copied = copy.deepcopy(options)
    assert copied["post_grad_custom_post_pass"] is options["post_grad_custom_post_pass"]
