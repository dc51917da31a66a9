"""kforge.optimize on the CPU with a fake package: exactly the matched regions replaced, outputs
equal to eager, a new shape falls back."""

from __future__ import annotations

import collections
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kforge
from kforge import customops
from kforge.candidate import Candidate, LaunchPlan
from kforge.capturing import capture
from kforge.optimize import RegionCall, RegionKernel, native_op, optimize
from kforge.package import CastPackage, PackagedCard
from test_graph import Branchy
from test_regions import BasicBlock

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

BN = "_native_batch_norm_legit_no_training"



def resnet() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(BasicBlock(), BasicBlock()).eval()
    for m in model.modules():  # non-trivial statistics, so a wrong kernel would show
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return model


class FakeLauncher:
    """The package's launcher on the CPU: variant id -> the region computed by PyTorch, plus 1
    when asked (a kernel whose use shows in the output)."""

    def __init__(self, cards, offset: float = 0.0, fns: dict | None = None):
        self.cards, self.offset, self.fns = cards, offset, fns or {}
        self.calls: list[int] = []

    def launch(self, vid, inputs, outputs, workspaces, device):
        self.calls.append(vid)
        fn = self.fns.get(vid, self.cards[vid].call_eager)
        for out, ref in zip(outputs, fn(list(inputs))):
            out.copy_(ref + self.offset)


def fake_package(cards, timings: dict[str, tuple[float, float]]) -> CastPackage:
    """A package whose region cards are all dispatched; timings: card id -> (kernel, baseline) µs."""
    plan = LaunchPlan.from_json({"kernels": [{"name": "k", "grid": [1], "block": [1], "args": []}]})
    entries = [PackagedCard(c, "dispatched", "test", "custom",
                            {"timing": {"dispatched_us": timings[c.id][0]},
                             "baseline": {"baseline_us": timings[c.id][1]}}, Candidate("", plan)) for c in cards]
    return CastPackage(Path("fake.cast"), {"gpu": {"arch": "cpu", "name": "cpu"}}, entries)


def region_cards(model, x, tmp_path, kind: str | None = None):
    cards = [c for c in capture(model, x, tmp_path, regions=True, time_cards=False).cards if c.region]
    return [c for c in cards if kind is None or c.region.kind == kind]


def test_a_profile_names_the_card_of_each_region_kernel(tmp_path):
    """Under torch.profiler a region's launch runs inside `kforge::k_<card id>_region`, so a
    profile says which card each kernel is (bench_model's GPU time per card); with no profiler
    running, nothing is recorded."""
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=FakeLauncher(cards))
    with torch.no_grad():
        fast(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
            fast(x)
    names = {e.key for e in prof.key_averages()}
    assert {f"kforge::k_{c.id}_region" for c in cards} <= names


def test_replaces_exactly_the_matched_regions_and_matches_eager(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    assert sorted(c.region.ops for c in cards) == [[BN, "add", "relu"], [BN, "relu"]]
    pkg = fake_package(cards, {c.id: (1.0, 5.0) for c in cards})
    launcher = FakeLauncher(cards)
    fast = optimize(model, pkg, launcher=launcher)
    with torch.no_grad():
        want, got = model(x), fast(x)
    assert torch.equal(got, want)
    assert sorted(launcher.calls) == [0, 0, 1, 1]  # each region at both blocks
    assert len(fast.replaced) == 4
    assert {r["id"]: r["hits"] for r in fast.report()["regions"]} == {c.id: 2 for c in cards}


def test_the_kernel_is_what_runs(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    bn_relu = [c for c in cards if c.region.ops == [BN, "relu"]]
    fast = optimize(model, fake_package(bn_relu, {bn_relu[0].id: (1.0, 5.0)}),
                    launcher=FakeLauncher(bn_relu, offset=1.0))
    with torch.no_grad():
        assert not torch.allclose(fast(x), model(x))  # the fake kernel's +1 reached the output


def test_where_the_model_check_found_it_slower_than_eager_the_model_runs_as_it_is(tmp_path):
    """The package records kforge.optimize op by op slower than eager (from CUDA graphs level): op by
    op the model runs untraced, said once per package; from CUDA graphs, and with
    use_verdict=False, the kernels run."""
    import warnings

    from kforge.optimize import OptimizeFallbackWarning

    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    pkg = fake_package(cards, {c.id: (1.0, 5.0) for c in cards})
    pkg.manifest["model_check"] = {"optimize": {
        "ops": {"verdict": "slower", "use": "eager", "eager_us": 100.0, "optimize_us": 120.0},
        "cuda_graphs": {"verdict": "level", "use": "kforge.optimize", "eager_us": 100.0, "optimize_us": 99.0}}}
    launcher = FakeLauncher(cards)
    with pytest.warns(OptimizeFallbackWarning, match=r"slower than eager \(120.0 µs against 100.0\)"):
        plain = optimize(model, pkg, launcher=launcher)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = optimize(model, pkg, launcher=launcher)  # said once
    with torch.no_grad():
        assert torch.equal(plain(x), model(x)) and torch.equal(again(x), model(x))
    assert launcher.calls == [] and plain.replaced == [] and "runs the model as it is" in plain.report()["notes"][0]
    ours = optimize(model, pkg, launcher=launcher, use_verdict=False)
    with torch.no_grad():
        assert torch.equal(ours(x), model(x))
    assert sorted(launcher.calls) == [0, 0, 1, 1]
    graphed = optimize(model, pkg, launcher=launcher, cuda_graphs=True)  # level there: the kernels run
    assert "_compiled" in graphed.__dict__ and graphed.__dict__["_compiled"] is not model


def test_a_new_shape_falls_back_to_the_original_nodes(tmp_path):
    model = resnet()
    cards = region_cards(model, torch.randn(2, 4, 8, 8), tmp_path, "fused")
    launcher = FakeLauncher(cards)
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=launcher)
    other = torch.randn(3, 4, 6, 6)
    with torch.no_grad():
        assert torch.equal(fast(other), model(other))
    assert launcher.calls == [] and fast.replaced == []


def test_a_guard_miss_runs_the_region_eagerly_and_says_why(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    card = next(c for c in cards if c.region.ops == [BN, "relu"])
    launcher = FakeLauncher([card])
    kernel = RegionKernel(card, lambda ins: launcher.launch(0, ins, [], [], None) or [])
    call = RegionCall(card.region, [kernel])
    ins = [torch.rand(m.shape) + 0.5 for m in card.inputs]  # (a positive running variance)
    ins[0] = torch.randn(ins[0].numel() + 1)[1:].view(ins[0].shape)  # 4-byte aligned, the card says 16
    (got,) = call(*ins)
    assert torch.equal(got, card.region.replay(ins)[0]) and launcher.calls == []
    assert dict(kernel.counters.fallbacks) == {"alignment": 1}


try:
    from kforge import _dispatch_test  # built beside kforge._dispatch (KFORGE_TESTING)
except ImportError:
    _dispatch_test = None
needs_cpp = pytest.mark.skipif(_dispatch_test is None, reason="kforge._dispatch is not built; build with "
                               "`pip install --no-build-isolation -e .`")
RELU_MODE = 1  # kforge._dispatch_test's C launcher: relu of `context / 4` floats of input 0 into output 0


class CLauncher(FakeLauncher):
    """FakeLauncher with kforge._dispatch_test's C launcher behind native(): each kernel writes
    relu of its input 0 into output 0, from C++; launch() is the Python path's same kernel."""

    def __init__(self, cards):
        super().__init__(cards, fns={i: (lambda ins: [torch.relu(ins[0])]) for i in range(len(cards))})

    def native(self, vid):
        nbytes = 4 * math.prod(self.cards[vid].outputs[0].shape)
        return _dispatch_test.test_launcher_address(), RELU_MODE, lambda index: nbytes


def relu_cards(model, x, tmp_path):
    """The model's fused regions whose first input and first output are float tensors of one shape."""
    return [c for c in region_cards(model, x, tmp_path, "fused")
            if c.inputs[0].shape == c.outputs[0].shape and c.outputs[0].dtype == "float32"]


@needs_cpp
def test_a_region_kernel_that_launches_natively_is_called_as_its_op_with_no_python_around_it(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = relu_cards(model, x, tmp_path)
    assert len(cards) == 2
    python = CLauncher(cards)
    python.native = None  # the same kernels, launched from Python through RegionCall
    want = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=python)
    launcher = CLauncher(cards)
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=launcher)
    with torch.no_grad():
        expected = want(x)
        before = _dispatch_test.test_launcher_log()["calls"]
        got = fast(x)
        launched = _dispatch_test.test_launcher_log()["calls"] - before
    assert sorted(python.calls) == [0, 0, 1, 1] and not torch.equal(expected, model(x))
    assert torch.equal(got, expected)
    assert launched == 4 and launcher.calls == []  # all four sites from C++, none through launch()
    targets = [n.target for n in fast.graphs[0].graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if isinstance(t, RegionCall)]
    assert len([t for t in targets if getattr(t, "namespace", None) == "kforge"]) == 4
    assert {r["id"]: (r["hits"], r["fallbacks"]) for r in fast.report()["regions"]} == {c.id: (2, {}) for c in cards}


@needs_cpp
def test_a_model_optimized_with_python_launches_leaves_another_models_region_ops_native(tmp_path):
    """Region ops are named by card and kernel, so a second package's kernels would rebind the
    first one's ops: a launcher that cannot launch from C++ does not touch them (its sites call
    RegionCall), and the first model keeps launching from C++ through its own launcher."""
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = relu_cards(model, x, tmp_path)
    launcher = CLauncher(cards)
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=launcher)
    python = CLauncher(cards)
    python.native = None
    other = optimize(resnet(), fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=python)
    with torch.no_grad():
        fast(x)
        other(x)
        before = _dispatch_test.test_launcher_log()["calls"]
        fast(x)
        assert _dispatch_test.test_launcher_log()["calls"] - before == 4
    assert launcher.calls == [] and sorted(python.calls) == [0, 0, 1, 1]


@needs_cpp
def test_a_native_region_ops_guard_miss_replays_the_region_and_counts_it(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    card = next(c for c in relu_cards(model, x, tmp_path) if c.region.ops == [BN, "relu"])
    launcher = CLauncher([card])
    kernel = RegionKernel(card, lambda ins: [], launch=(0, launcher, ()), digest="nativemiss")
    op = native_op([kernel])
    assert op is not None and op.namespace == "kforge"
    ins = [torch.rand(m.shape) + 0.5 for m in card.inputs]
    assert torch.equal(op(*ins), torch.relu(ins[0])) and kernel.counters.hits == 1
    ins[0] = torch.randn(ins[0].numel() + 1)[1:].view(ins[0].shape)  # 4-byte aligned, the card says 16
    assert torch.equal(op(*ins), card.region.replay(ins)[0]) and launcher.calls == []
    assert dict(kernel.counters.fallbacks) == {"alignment": 1}
    customops.release(op)  # what the evaluation worker does after timing a candidate through it
    assert kernel.counters.hits == 1 and dict(kernel.counters.fallbacks) == {"alignment": 1}  # the C++ counts stay
    with pytest.raises(Exception, match="released"):
        op(*ins)


@needs_cpp
def test_a_site_with_a_card_per_alignment_is_one_native_op_that_picks_the_card(tmp_path):
    """The same region captured with its first input at two alignments is two cards; the
    site's one op has both as variants of its C++ guard, and each call launches the one whose
    alignments its inputs have."""
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    card = next(c for c in relu_cards(model, x, tmp_path) if c.region.ops == [BN, "relu"])
    first = card.args[0]
    shifted = replace(card, args=[replace(first, tensor=replace(first.tensor, align=4)), *card.args[1:]])
    launcher = CLauncher([card, shifted])
    kernels = [RegionKernel(c, lambda ins: [], launch=(vid, launcher, ()), digest=f"aligned{vid}")
               for vid, c in enumerate([card, shifted])]
    op = native_op(kernels)
    assert op is not None and op is not native_op(kernels[:1])
    aligned = [torch.rand(m.shape) + 0.5 for m in card.inputs]
    unaligned = [torch.randn(aligned[0].numel() + 1)[1:].view(aligned[0].shape), *aligned[1:]]
    for ins in (aligned, unaligned, aligned):
        assert torch.equal(op(*ins), torch.relu(ins[0]))
    assert [k.counters.hits for k in kernels] == [2, 1] and launcher.calls == []


def test_overlapping_regions_keep_the_larger_saving(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path)
    fused = next(c for c in cards if c.region.ops == [BN, "add", "relu"])
    epilogue = next(c for c in cards if c.region.ops == ["convolution", BN, "add", "relu"])
    pkg = fake_package([fused, epilogue], {fused.id: (2.0, 5.0), epilogue.id: (10.0, 20.0)})
    launcher = FakeLauncher([fused, epilogue])
    fast = optimize(model, pkg, launcher=launcher)
    with torch.no_grad():
        assert torch.allclose(fast(x), model(x), atol=1e-6)
    assert launcher.calls == [1, 1]  # the conv's epilogue saves 10 µs, the fused region inside it 3


def test_package_optimize_and_kforge_optimize(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    pkg = fake_package(cards, {c.id: (1.0, 5.0) for c in cards})
    for fast in (pkg.optimize(model, launcher=FakeLauncher(cards)), kforge.optimize(model, pkg, launcher=FakeLauncher(cards))):
        with torch.no_grad():
            assert torch.equal(fast(x), model(x))
        assert len(fast.replaced) == 4


def test_op_cards_run_in_the_graph_beside_the_regions_and_nothing_is_installed(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = capture(model, x, tmp_path, regions=True, time_cards=False).cards
    bn_relu = next(c for c in cards if c.region is not None and c.region.ops == [BN, "relu"])
    relu = next(c for c in cards if c.op == "aten::relu.default")
    pkg = fake_package([bn_relu, relu], {bn_relu.id: (1.0, 5.0), relu.id: (1.0, 2.0)})
    # Stand-ins that call no relu: one would be served by the relu override under test.
    launcher = FakeLauncher([bn_relu, relu], fns={
        0: lambda ins: [F.batch_norm(ins[0], ins[3], ins[4], ins[1], ins[2]).clamp(min=0)],
        1: lambda ins: [ins[0].clamp(min=0)]})
    fast = optimize(model, pkg, launcher=launcher)
    with torch.no_grad():
        got = fast(x)
        # bn+relu at both blocks by its region kernel; the relu after each residual add (not a
        # region of the package) by the op card's kernel, its custom op in the graph
        assert sorted(launcher.calls) == [0, 0, 1, 1] and fast.ops_replaced == 2
        assert torch.equal(got, model(x))
    assert sorted(launcher.calls) == [0, 0, 1, 1] and not pkg.installed  # eager's own calls stay eager


class NullLauncher:
    """A kernel that launches nothing: what is left of a hit is the host path around it."""

    def launch(self, vid, inputs, outputs, workspaces, device):
        pass


def aten_calls(fn, *args) -> collections.Counter:
    """How many times `fn(*args)` called each aten op, nested calls included (the profiler sees
    compiled graphs' calls too; a dispatch mode would make dynamo run the model eagerly)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        fn(*args)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def python_calls(fn, *args) -> list[str]:
    """file:function of every Python function `fn(*args)` enters."""
    import sys

    seen = []

    def hook(frame, event, arg):
        if event == "call":
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(hook)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return seen


def test_the_forward_with_hits_calls_no_aten_op_more_than_eager_and_no_wrapper(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=NullLauncher())
    with torch.inference_mode():
        fast(x)
        eager, ours = aten_calls(model, x), aten_calls(fast, x)
        calls = python_calls(fast, x)
    assert len(fast.replaced) == 4 and fast.graphs[0] is not None
    # No copy, clone, alias or detach more than eager: only the kernels' output allocations are new.
    more = {op: n - eager[op] for op, n in ours.items() if n > eager[op]}
    assert more == {"aten::empty_strided": 4}, more
    assert ours["aten::relu"] == eager["aten::relu"] - 4 and ours["aten::add"] == eager["aten::add"] - 2
    assert not [c for c in calls if "runtime_wrapper" in c]  # aot_autograd's: it has nothing to do here
    assert not [c for c in calls if c.endswith("torch/_ops.py:__call__")]  # every aten call through its binding


def test_batch_norms_outside_the_regions_make_eagers_call_in_a_changed_graph(tmp_path):
    """A graph the package changes runs its other batch norms as eager does (aten::batch_norm,
    cuDNN on a GPU), not as the trace spells them (_native_batch_norm_legit_no_training)."""
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")[:1]
    pkg = fake_package(cards, {c.id: (1.0, 5.0) for c in cards})
    with torch.inference_mode():
        assert torch.equal(optimize(model, pkg, launcher=FakeLauncher(cards))(x), model(x))
        fast = optimize(model, pkg, launcher=NullLauncher())  # the calls counted are the graph's own
        fast(x)
        eager, ours = aten_calls(model, x), aten_calls(fast, x)
    assert len(fast.replaced) == 2 and eager["aten::batch_norm"] == 4  # one card, two sites
    assert ours["aten::batch_norm"] == 2 and ours[f"aten::{BN}"] == 0


def test_a_graph_with_no_hits_calls_what_eager_calls(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    fast = optimize(model, fake_package([], {}))
    with torch.inference_mode():
        assert torch.equal(fast(x), model(x))
        assert aten_calls(fast, x) == aten_calls(model, x)
        calls = python_calls(fast, x)
    assert fast.graphs == [None] and fast.report()["replaced"] == []
    assert not [c for c in calls if "runtime_wrapper" in c or c.endswith("torch/_ops.py:__call__")]


def test_cuda_graphs_on_the_cpu_run_op_by_op_with_a_note(tmp_path):
    model, x = resnet(), torch.randn(2, 4, 8, 8)
    cards = region_cards(model, x, tmp_path, "fused")
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=FakeLauncher(cards),
                    cuda_graphs=True)
    with torch.no_grad():
        assert torch.equal(fast(x), model(x)) and torch.equal(fast(x), model(x))
    assert fast.notes == ["graph 0 runs op by op, not from a CUDA graph: not every input is a CUDA tensor"]
    assert fast.report()["cuda_graphs"] == [{"graph": 0, "captured": False, "replays": 0, "misses": 0}]


class HostScalar(nn.Module):
    def forward(self, x):
        y = torch.relu(x) * 2
        return torch.sigmoid(y) + float(y.max())  # a value read back on the host: a graph break


class WritesAView(nn.Module):
    def forward(self, x):
        x[:, 0].mul_(0.5)  # in place on a view of the input, which the caller sees
        y = x.clone()
        y[:, 1:].add_(1.0)  # in place on a view of an intermediate
        return torch.relu(y) * 2


@pytest.mark.parametrize("model, breaks", [(Branchy(), 1), (HostScalar(), 1), (WritesAView(), 0)])
def test_a_model_hard_to_trace_keeps_its_op_cards_and_runs_as_eager(model, breaks, tmp_path):
    x = torch.randn(4, 4).abs()
    r = capture(model, x.clone(), tmp_path, regions=True, time_cards=False)
    notes = [n for n in r.notes if n.startswith("graph break")]
    assert len(notes) == breaks and all("\n" not in n for n in notes)
    assert {"aten::relu.default", "aten::mul.Tensor"} <= {c.op for c in r.cards}  # the op cards are whole
    regions = [c for c in r.cards if c.region]
    fast = optimize(model, fake_package(regions, {c.id: (1.0, 5.0) for c in regions}), launcher=FakeLauncher(regions))
    with torch.no_grad():
        a, b = x.clone(), x.clone()
        assert torch.equal(fast(a), model(b)) and torch.equal(a, b)  # the input written as eager writes it
        assert torch.equal(fast(a), model(b)) and torch.equal(a, b)
    assert len([n for n in fast.notes if n.startswith("graph break")]) == breaks and fast.replaced


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


class Moe(nn.Module):
    """A router whose region the package has, then a loop over the experts that got tokens: each
    expert is called with its own token count, which changes from call to call."""

    def __init__(self, experts: int = 6):
        super().__init__()
        self.gate = nn.Linear(8, experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x):
        choice = (torch.sigmoid(self.gate(x)) * 2).argmax(-1)
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():
            idx = (choice == e).nonzero().flatten()
            out[idx] = self.experts[e](x[idx])
        return out


def test_a_frame_retraced_for_new_shapes_with_nothing_of_the_package_runs_natively(tmp_path):
    torch.manual_seed(0)
    model, x = Moe().eval(), torch.randn(64, 8)
    router = [c for c in region_cards(model, x, tmp_path) if any(n.op == "aten::sigmoid.default" for n in c.region.nodes)]
    assert router
    launcher = FakeLauncher(router)
    fast = optimize(model, fake_package(router, {c.id: (1.0, 5.0) for c in router}), launcher=launcher)
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(64, 8, generator=torch.Generator().manual_seed(seed))
            assert torch.allclose(fast(x), model(x))
            traced = len(fast.graphs)
            if seed == 0:
                first = traced
        guards = [c for c in python_calls(fast, x) if "_dynamo/guards.py" in c]
    natively = [n for n in fast.notes if "runs eagerly from now on" in n]
    assert len(natively) == 1 and natively[0].startswith("forward (") and "test_optimize.py" in natively[0]
    # After the first forward the experts are not traced again however their token counts change,
    # no guard of theirs is checked (the top frame's are: 4 calls), and the router's region still
    # runs its kernel.
    assert traced == first and len(guards) <= 4 and len(launcher.calls) == 5


def test_without_dynamos_private_frame_apis_the_model_still_runs_as_before(tmp_path, monkeypatch):
    """skip_code, reset_code and the current translator are private dynamo APIs: on a torch
    without them every frame stays compiled, and nothing else changes."""
    import torch._dynamo as dynamo
    import torch._dynamo.eval_frame as eval_frame
    from kforge import graph

    monkeypatch.delattr(eval_frame, "skip_code")
    monkeypatch.delattr(dynamo, "reset_code")
    assert not graph.can_run_natively()
    torch.manual_seed(0)
    model, x = Moe().eval(), torch.randn(64, 8)
    router = [c for c in region_cards(model, x, tmp_path) if any(n.op == "aten::sigmoid.default" for n in c.region.nodes)]
    fast = optimize(model, fake_package(router, {c.id: (1.0, 5.0) for c in router}), launcher=FakeLauncher(router))
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(64, 8, generator=torch.Generator().manual_seed(seed))
            assert torch.allclose(fast(x), model(x))
    assert fast.replaced and not [n for n in fast.notes if "runs eagerly from now on" in n]
    monkeypatch.setattr(graph, "tracing_code", lambda: None)  # no translator to ask
    fast = optimize(model, fake_package(router, {c.id: (1.0, 5.0) for c in router}), launcher=FakeLauncher(router))
    with torch.no_grad():
        assert torch.allclose(fast(x), model(x))
    monkeypatch.undo()  # before fresh_dynamo's reset, which calls reset_code


class StdConvBlock(nn.Module):
    """A convolution whose weight is standardized on every forward (timm's StdConv2d: BiT, NFNet),
    then batch norm and ReLU."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        w = self.conv.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.var((1, 2, 3), keepdim=True) + 1e-5).sqrt()
        return torch.relu(self.bn(F.conv2d(x, w, padding=1)))


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_changed_graph_standardizes_its_weights_once_until_they_change(tmp_path, cuda_graphs):
    """The weight's standardization is a value of the model's parameters alone: computed on the first
    forward, again after the weight is written; with cuda_graphs too (on the CPU the graph runs op by
    op; a replay refreshes the kept value in place: tests/gpu/test_optimize_gpu.py)."""
    torch.manual_seed(0)
    model, x = StdConvBlock().eval(), torch.randn(2, 4, 8, 8)
    cards = [c for c in region_cards(model, x, tmp_path, "fused") if "relu" in c.region.ops]  # the norm's, not the weight's
    fast = optimize(model, fake_package(cards, {c.id: (1.0, 5.0) for c in cards}), launcher=FakeLauncher(cards),
                    cuda_graphs=cuda_graphs, use_verdict=False)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
        calls = aten_calls(fast, x)
        assert calls["aten::var"] == 0, calls
        model.conv.weight.mul_(-2)  # as load_state_dict writes a parameter
        torch.testing.assert_close(fast(x), model(x))
