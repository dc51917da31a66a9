"""Guarded dispatch in C++ (kforge._dispatch) on the CPU: the CPU key stands in for CUDA and
a test-only launcher (kforge._dispatch_test, a C function on CPU pointers) for the registry."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from test_dispatch import FakeLauncher, make_card, relu_kernel, to_copy_card

from kforge import dispatch
from kforge.cards import encode_value
from kforge.dispatch import REASONS, Counters, Dispatcher, PlanLauncher, Variant, installed

try:
    from kforge import _dispatch
except ImportError as e:  # a build without torch at build time (plain `pip install .`)
    _dispatch = None
    pytestmark = pytest.mark.skip(reason=f"kforge._dispatch is not built ({e}); "
                                         "build with `pip install --no-build-isolation -e .`")
else:  # never in the shipped kforge._dispatch: a build with it must have its test launcher too
    from kforge import _dispatch_test

aten = torch.ops.aten
COPY, RELU, FAIL = 0, 1, 2  # the test launcher's modes (csrc/testing/dispatch_test_launcher.cpp)


class NativeLauncher:
    """kforge._dispatch's test launcher behind native(): variant vid runs modes[vid] over
    `nbytes` of input 0 into output 0. launch() is the Python path's stand-in (relu)."""

    def __init__(self, *modes: int, nbytes: int = 4 * 8 * 4):
        self.modes, self.nbytes = modes or (RELU,), nbytes
        self.python_calls = 0

    def native(self, vid):
        return _dispatch_test.test_launcher_address(), self.modes[vid], lambda index: self.nbytes

    def launch(self, vid, inputs, outputs, workspaces, device):
        self.python_calls += 1
        relu_kernel(inputs, outputs)


def calls() -> int:
    return _dispatch_test.test_launcher_log()["calls"]


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.delenv("KFORGE_DISPATCH", raising=False)
    d = Dispatcher("CPU")
    yield d
    for owner, _ in list(d._owners):
        d.remove(owner)
    assert not d.ops


def relu_variant(x, *modes, vid=0, nbytes=None, **kw):
    launcher = NativeLauncher(*modes, nbytes=nbytes or x.numel() * x.element_size())
    return Variant(make_card(aten.relu.default, x, **kw), vid, launcher), launcher


def test_reasons_are_the_python_reasons():
    assert _dispatch.REASONS == REASONS
    assert _dispatch.TORCH_VERSION == torch.__version__
    assert dispatch.native_status("CPU") == (True, f"kforge._dispatch, built against torch {torch.__version__}")


def test_hit_runs_the_launcher_in_cpp_with_fresh_outputs_and_counts(cpu):
    x = torch.randn(4, 8)
    v, launcher = relu_variant(x)
    cpu.add("pkg", [v])
    assert cpu.path("aten::relu.default")[0] == "native"
    before = calls()
    y = torch.relu(x)
    log = _dispatch_test.test_launcher_log()
    assert calls() == before + 1 and not launcher.python_calls
    assert torch.equal(y, x.clamp(min=0)) and y is not x and y.stride() == (8, 1) and y.dtype == x.dtype
    assert (log["vid"], log["n_in"], log["n_out"], log["n_ws"], log["stream"]) == (RELU, 1, 1, 0, 0)
    assert log["in0"] == x.data_ptr() and log["out0"] == y.data_ptr()
    assert v.counters.hits == 1 and not v.counters.fallbacks


@pytest.mark.parametrize("call, reason", [
    (lambda: torch.randn(5, 8), "shape"),
    (lambda: torch.randn(8, 4).t(), "stride"),
    (lambda: torch.randn(4, 8, dtype=torch.float64), "dtype"),
    (lambda: torch.randn(33)[1:].view(4, 8), "alignment"),
])
def test_miss_calls_the_original_kernel_and_counts_why(cpu, call, reason):
    v, launcher = relu_variant(torch.randn(4, 8))
    cpu.add("pkg", [v])
    x = call()
    before = calls()
    assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert calls() == before
    assert v.counters.hits == 0 and v.counters.fallbacks == {reason: 1}


def test_device_type_is_part_of_the_guard(cpu):
    v, _ = relu_variant(torch.randn(4, 8), device="cuda")
    cpu.add("pkg", [v])
    torch.relu(torch.randn(4, 8))
    assert v.counters.fallbacks == {"device": 1}


def test_scalar_arguments_are_part_of_the_guard(cpu):
    x = torch.randn(8, 8)
    want0 = F.softmax(x, 0)
    v = Variant(make_card(aten._softmax.default, x, 1, False), 0, NativeLauncher(COPY, nbytes=x.nbytes))
    cpu.add("pkg", [v])
    assert torch.equal(torch.softmax(x, 1), x)  # the stand-in copies: it ran
    assert torch.equal(torch.softmax(x, 0), want0)
    assert v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 1}


@pytest.mark.parametrize("recorded, called, hit", [
    (0.0, 0.0, True), (0.0, -0.0, False), (-0.0, -0.0, True), (float("nan"), float("nan"), True),
    (float("nan"), 0.0, False), (float("inf"), float("inf"), True), (0.01, 0.01, True), (0.01, 0.010000000000000002, False),
])
def test_float_values_match_bit_exactly_and_nan_matches_nan(cpu, recorded, called, hit):
    x = torch.randn(4, 8)
    v = Variant(make_card(aten.leaky_relu.default, x, recorded), 0, NativeLauncher(COPY, nbytes=x.nbytes))
    cpu.add("pkg", [v])
    F.leaky_relu(x, called)
    assert (v.counters.hits, v.counters.fallbacks) == ((1, {}) if hit else (0, {"scalar": 1}))


def test_ints_floats_and_defaults_are_told_apart(cpu):
    a, b = torch.randn(16), torch.randn(16)
    v = Variant(make_card(aten.add.Tensor, a, b), 0, NativeLauncher(COPY, nbytes=a.nbytes))  # alpha=1, the default
    cpu.add("pkg", [v])
    assert torch.equal(torch.add(a, b), a)
    torch.add(a, b, alpha=1.0)
    torch.add(a, b, alpha=2)
    assert v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 2}


def test_enum_values_are_guarded(cpu):
    x = torch.randn(4, 8)
    card = make_card(aten.clone.default, x, memory_format=torch.contiguous_format)
    v = Variant(card, 0, NativeLauncher(COPY, nbytes=x.nbytes))
    cpu.add("pkg", [v])
    assert cpu.path("aten::clone.default")[0] == "native"
    y = aten.clone.default(x, memory_format=torch.contiguous_format)
    aten.clone.default(x, memory_format=torch.preserve_format)
    assert torch.equal(y, x) and v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 1}


def test_wrapped_numbers_never_hit_and_fall_back_like_eager(cpu):
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    calls = [(y, 1e-6), (torch.arange(6, dtype=torch.int32), 0.5), (torch.tensor(1.0, dtype=torch.float16), 0.1)]
    wants = [x + scalar for x, scalar in calls]
    v = Variant(make_card(aten.add.Tensor, y, y.clone()), 0, NativeLauncher(COPY, nbytes=y.nbytes))
    cpu.add("pkg", [v])
    for (x, scalar), want in zip(calls, wants):
        got = x + scalar
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert v.counters.hits == 0 and v.counters.fallbacks == {"no-variant": 3}


def test_conjugate_and_negative_views_never_hit(cpu):
    x, z = torch.randn(4, 8), torch.randn(4, 8, dtype=torch.complex64)
    launcher = NativeLauncher(COPY, COPY)
    real = Variant(make_card(aten.copy_.default, torch.empty(4, 8), x, aliases={0: 0}), 0, launcher)
    cplx = Variant(make_card(aten.copy_.default, torch.empty_like(z), z, aliases={0: 0}), 1, launcher)
    cpu.add("pkg", [real, cplx])
    y, w = torch.empty(4, 8), torch.empty_like(z)
    y.copy_(x._neg_view())
    w.copy_(z.conj())
    assert real.counters.fallbacks == {"no-variant": 1} and cplx.counters.fallbacks == {"no-variant": 1}
    assert torch.equal(y, -x) and torch.equal(w, z.conj())
    assert y.copy_(x) is y and real.counters.hits == 1


def test_in_place_output_is_the_input_itself(cpu):
    x = torch.randn(4, 8)
    v = Variant(make_card(aten.relu_.default, x, aliases={0: 0}), 0, NativeLauncher(RELU, nbytes=x.nbytes))
    cpu.add("pkg", [v])
    expected = x.clamp(min=0)
    y = x.relu_()
    log = _dispatch_test.test_launcher_log()
    assert y is x and torch.equal(x, expected) and v.counters.hits == 1
    assert log["in0"] == log["out0"] == x.data_ptr()


def test_out_variant_returns_out(cpu):
    a, b, out = torch.randn(16), torch.randn(16), torch.empty(16)
    v = Variant(make_card(aten.add.out, a, b, out=out, aliases={0: 2}), 0, NativeLauncher(COPY, nbytes=a.nbytes))
    cpu.add("pkg", [v])
    r = torch.add(a, b, out=out)
    assert r is out and torch.equal(out, a) and v.counters.hits == 1


def test_multi_output_op_returns_every_output_as_the_card_says(cpu):
    x, w, b = torch.randn(6, 16), torch.randn(16), torch.randn(16)
    v = Variant(make_card(aten.native_layer_norm.default, x, [16], w, b, 1e-5), 0, NativeLauncher(COPY, nbytes=x.nbytes))
    cpu.add("pkg", [v])
    got = aten.native_layer_norm.default(x, [16], w, b, 1e-5)
    cpu.remove("pkg")
    want = aten.native_layer_norm.default(x, [16], w, b, 1e-5)
    assert isinstance(got, tuple) and len(got) == 3 and torch.equal(got[0], x)
    assert [(t.shape, t.stride(), t.dtype) for t in got] == [(t.shape, t.stride(), t.dtype) for t in want]
    assert v.counters.hits == 1


def test_missing_optional_tensor_is_no_variant(cpu):
    x, w, b = torch.randn(6, 16), torch.randn(16), torch.randn(16)
    v = Variant(make_card(aten.native_layer_norm.default, x, [16], w, b, 1e-5), 0, NativeLauncher(COPY))
    cpu.add("pkg", [v])
    F.layer_norm(x, (16,), w, None)
    assert v.counters.fallbacks == {"no-variant": 1}


def test_workspaces_are_allocated_per_call(cpu):
    x = torch.randn(4, 8)
    v = Variant(make_card(aten.relu.default, x), 0, NativeLauncher(RELU, nbytes=x.nbytes), workspace=(64, 4))
    cpu.add("pkg", [v])
    torch.relu(x)
    assert _dispatch_test.test_launcher_log()["n_ws"] == 2 and v.counters.hits == 1


def test_several_variants_the_later_wins_and_the_nearest_takes_the_miss(cpu):
    x, y = torch.randn(4, 8), torch.randn(16, 8)
    first = Variant(make_card(aten.relu.default, x), 0, NativeLauncher(COPY, nbytes=x.nbytes))
    second = Variant(make_card(aten.relu.default, x), 0, NativeLauncher(RELU, nbytes=x.nbytes))
    other = Variant(make_card(aten.relu.default, y), 0, NativeLauncher(RELU, nbytes=y.nbytes))
    cpu.add("first", [first, other])
    cpu.add("second", [second])
    assert torch.equal(torch.relu(x), x.clamp(min=0))  # the later package's kernel
    cpu.remove("second")
    assert torch.equal(torch.relu(x), x)  # the first package's stand-in copies
    assert (first.counters.hits, second.counters.hits) == (1, 1)
    torch.relu(y.t().contiguous().t())
    torch.relu(y.double())
    torch.relu(y.double())
    assert other.counters.fallbacks == {"stride": 1, "dtype": 2} and not first.counters.fallbacks


def test_destroy_restores_the_original_kernel_exactly(cpu):
    before = torch._C._dispatch_dump("aten::relu")
    kernel = repr(torch.library.get_kernel(aten.relu.default, "CPU"))
    v, _ = relu_variant(torch.randn(4, 8), COPY)
    cpu.add("pkg", [v])
    assert torch._C._dispatch_dump("aten::relu") != before
    assert "kforge._dispatch" in repr(torch.library.get_kernel(aten.relu.default, "CPU"))
    x = torch.randn(4, 8)
    assert torch.equal(torch.relu(x), x)  # the stand-in copies
    cpu.remove("pkg")
    assert torch._C._dispatch_dump("aten::relu") == before
    assert repr(torch.library.get_kernel(aten.relu.default, "CPU")) == kernel
    assert torch.equal(torch.relu(x), x.clamp(min=0)) and v.counters.hits == 1


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autograd"])
def test_grad_modes(cpu, mode):
    x = torch.randn(4, 8)
    v, _ = relu_variant(x)
    cpu.add("pkg", [v])
    if mode == "autograd":
        xr = x.clone().requires_grad_()
        y = torch.relu(xr)
        y.sum().backward()  # relu's backward reads our output
        assert torch.equal(y.detach(), x.clamp(min=0)) and torch.equal(xr.grad, (x > 0).float())
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert v.counters.hits == 1


def test_a_failing_launch_raises_and_the_process_goes_on(cpu):
    x = torch.randn(4, 8)
    v, _ = relu_variant(x, FAIL)
    cpu.add("pkg", [v])
    with pytest.raises(RuntimeError, match=r"launch failed in kforge's kernel for aten::relu \(variant 2\): "
                                           "the test launcher was told to fail"):
        torch.relu(x)
    z = torch.randn(5, 8)
    assert torch.equal(torch.relu(z), z.clamp(min=0))
    assert v.counters.hits == 0 and v.counters.fallbacks == {"shape": 1}  # a failed launch served nothing


def test_python_launchers_keep_the_op_in_python_and_it_moves_when_they_go(cpu):
    before = torch._C._dispatch_dump("aten::relu")
    x, y = torch.randn(4, 8), torch.randn(2, 3)
    native, _ = relu_variant(x)
    python = Variant(make_card(aten.relu.default, y), 0, FakeLauncher(relu_kernel))
    cpu.add("native", [native])
    cpu.add("python", [python])
    path, why = cpu.path("aten::relu.default")
    assert path == "python" and "FakeLauncher launches from Python only" in why
    torch.relu(x)
    cpu.remove("python")
    assert cpu.path("aten::relu.default")[0] == "native"
    torch.relu(x)
    assert native.counters.hits == 2  # one in Python, one in C++: one Counters
    cpu.remove("native")
    assert torch._C._dispatch_dump("aten::relu") == before


def test_guards_cpp_cannot_express_keep_the_op_in_python(cpu):
    x = torch.randn(4, 8)
    card = make_card(aten.leaky_relu.default, x)
    card.args[1].value = encode_value([0.5, 0.25])
    cpu.add("pkg", [Variant(card, 0, NativeLauncher(COPY))])
    path, why = cpu.path("aten::leaky_relu.default")
    assert path == "python" and "no C++ guard for the value [0.5, 0.25]" in why


def test_kforge_dispatch_env_picks_the_path(cpu, monkeypatch):
    x = torch.randn(4, 8)
    v, launcher = relu_variant(x)
    monkeypatch.setenv("KFORGE_DISPATCH", "python")
    cpu.add("pkg", [v])
    assert cpu.path("aten::relu.default") == ("python", "KFORGE_DISPATCH=python")
    torch.relu(x)
    assert launcher.python_calls == 1 and v.counters.hits == 1
    cpu.remove("pkg")
    monkeypatch.setenv("KFORGE_DISPATCH", "native")
    with pytest.raises(dispatch.DispatchError, match="KFORGE_DISPATCH=native"):
        cpu.add("pkg", [Variant(make_card(aten.relu.default, x), 0, FakeLauncher(relu_kernel))])


def test_counters_read_through_to_cpp():
    c = Counters()
    assert (c.hits, c.fallbacks) == (0, {})
    c.hit()
    c.fell_back("shape")
    cell = c.native_cell(_dispatch)
    assert c.native_cell(_dispatch) is cell and (c.hits, c.fallbacks) == (1, {"shape": 1})


def test_installed_times_one_kernel_through_the_cpp_path_and_restores():
    before = torch._C._dispatch_dump("aten::relu")
    x = torch.randn(4, 8)
    card = make_card(aten.relu.default, x)
    with installed(card, NativeLauncher(RELU, nbytes=x.nbytes), key="CPU") as variant:
        assert torch.equal(card.call_eager([x])[0], x.clamp(min=0))
    card.call_eager([x])
    assert variant.counters.hits == 1 and torch._C._dispatch_dump("aten::relu") == before


def test_plan_launcher_is_native_only_for_a_real_plan():
    assert PlanLauncher(object()).native(0) is None


def test_a_fresh_process_warns_nothing_and_exits_with_the_override_installed():
    script = textwrap.dedent("""
        import torch
        from kforge import _dispatch, _dispatch_test
        o = _dispatch.Override("aten::relu", "", "CPU")
        x = torch.randn(4, 8)
        c = _dispatch.Counts()
        guard = [("tensor", ([4, 8], [8, 1], "float32", "cpu", 16))]
        o.set_variants([(guard, [(None, [4, 8], [8, 1], "float32")], [], _dispatch_test.test_launcher_address(), 1,
                         lambda index: 128, c)])
        assert torch.equal(torch.relu(x), x.clamp(min=0)) and c.hits == 1
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok" and "Overriding a previously registered kernel" not in proc.stderr


def test_stub_names_what_the_module_has():
    import ast
    from pathlib import Path

    import kforge

    tree = ast.parse((Path(kforge.__file__).parent / "_dispatch.pyi").read_text())
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stubbed |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    assert stubbed == {n for n in dir(_dispatch) if not n.startswith("_")}


def test_an_out_argument_that_is_also_an_input_falls_back(cpu):
    """add.out(a, b, out=a) matches a card recorded as add.out(a, b, out=c) key for key, but
    the kernel would write what it reads: eager serves it, counted as aliasing."""
    a, b, out = torch.randn(16), torch.randn(16), torch.empty(16)
    v = Variant(make_card(aten.add.out, a, b, out=out, aliases={0: 2}), 0, NativeLauncher(COPY, nbytes=a.nbytes))
    cpu.add("pkg", [v])
    expected = a + b
    r = torch.add(a, b, out=a)
    assert r is a and torch.equal(a, expected)
    assert v.counters.hits == 0 and v.counters.fallbacks == {"aliasing": 1}
    torch.add(b, b.clone(), out=out)  # no sharing: the kernel runs
    assert v.counters.hits == 1


def test_a_refused_native_override_is_not_kept(cpu, monkeypatch):
    x = torch.randn(4, 8)
    v, _ = relu_variant(x)

    def refuse(self, descriptions):
        raise ValueError("no")

    monkeypatch.setattr(dispatch._NativeOverride, "set_variants", refuse)
    cpu.add("pkg", [v])  # served in Python instead
    path, why = cpu.path("aten::relu.default")
    assert path == "python" and "refused" in why
    cpu.remove("pkg")
    monkeypatch.setenv("KFORGE_DISPATCH", "native")
    with pytest.raises(dispatch.DispatchError, match="KFORGE_DISPATCH=native"):
        cpu.add("pkg", [v])
    assert not cpu.ops and torch.equal(torch.relu(x), x.clamp(min=0))  # nothing half-installed


def test_a_destroyed_override_refuses_new_variants_without_crashing():
    o = _dispatch.Override("aten::relu", "", "CPU")
    o.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        o.set_variants([])
    assert o.counters() == [] and not o.active
    o.destroy()  # twice is fine


def test_a_launch_refused_before_it_ran_falls_back_to_eager(cpu):
    """A cooperative grid the GPU cannot hold right now: eager serves the call, counted."""
    x = torch.randn(4, 8)
    v, _ = relu_variant(x, 3)  # the test launcher's "refused" mode
    cpu.add("pkg", [v])
    assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert v.counters.hits == 0 and v.counters.fallbacks == {"refused": 1}


def test_a_kernel_that_cannot_be_prepared_on_a_device_leaves_that_device_to_eager(cpu):
    x = torch.randn(4, 8)
    asked = []

    class Unpreparable(NativeLauncher):
        def native(self, vid):
            def resolve(index):
                asked.append(index)
                raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU: not this architecture")
            return _dispatch_test.test_launcher_address(), self.modes[vid], resolve

    v = Variant(make_card(aten.relu.default, x), 0, Unpreparable(RELU, nbytes=x.nbytes))
    cpu.add("pkg", [v])
    with pytest.warns(UserWarning, match="could not prepare its kernel on device -1"):
        assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert asked == [-1]  # asked once, remembered
    assert v.counters.hits == 0 and v.counters.fallbacks == {"device": 2}


def test_a_device_argument_naming_another_device_index_falls_back(cpu):
    """As on the Python path: the guard key holds device types, so the index is checked."""
    x = torch.randn(4, 8)
    v = Variant(to_copy_card(x, torch.device("cpu")), 0, NativeLauncher(COPY))
    cpu.add("pkg", [v])
    assert cpu.path("aten::_to_copy.default")[0] == "native"
    before = calls()
    y = torch.ops.aten._to_copy.default(x, dtype=x.dtype, device=torch.device("cpu"))
    assert torch.equal(y, x) and calls() == before + 1 and v.counters.hits == 1
    z = torch.ops.aten._to_copy.default(x, dtype=x.dtype, device=torch.device("cpu", 1))
    assert torch.equal(z, x) and calls() == before + 1 and v.counters.fallbacks == {"device": 1}



def test_composite_op_in_cpp_hits_without_grad_and_leaves_backward_to_eager(cpu):
    before = torch._C._dispatch_dump("aten::softmax.int")
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    launcher = NativeLauncher(COPY, nbytes=x.numel() * x.element_size())
    v = Variant(make_card(aten.softmax.int, x, -1, torch.float32), 0, launcher)
    cpu.add("pkg", [v])
    assert cpu.path("aten::softmax.int")[0] == "native"
    n = calls()
    with torch.inference_mode():
        F.softmax(x, -1, dtype=torch.float32)
    with torch.no_grad():
        F.softmax(x, -1, dtype=torch.float32)
    assert calls() == n + 2 and v.counters.hits == 2
    xr = x.clone().requires_grad_()
    y = F.softmax(xr, -1, dtype=torch.float32)
    assert calls() == n + 2 and y.grad_fn is not None and v.counters.fallbacks == {"autograd": 1}
    y[:, 0].sum().backward()
    assert xr.grad is not None
    # Fake tensors (torch.compile's tracing) never reach the C++ guards, which read pointers.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        assert F.softmax(mode.from_tensor(x), -1, dtype=torch.float32).shape == (4, 8)
    assert calls() == n + 2 and v.counters.hits == 2 and v.counters.fallbacks == {"autograd": 1}
    cpu.remove("pkg")
    assert torch._C._dispatch_dump("aten::softmax.int") == before
    with pytest.raises(ValueError, match="CompositeImplicitAutograd"):
        _dispatch.Override("aten::relu", "", "CPU", "AutogradCPU")
