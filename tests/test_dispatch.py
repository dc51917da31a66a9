"""Guarded dispatch on the CPU, each case on each path: the Python override, the C++ override
(kforge._dispatch) and, for the guard cases, the compile pass's match of a traced call. The CPU
key stands in for CUDA, Python functions for kernels: on the C++ path they are reached through
a C launch function (a ctypes callback on tensors rebuilt over the pointers C++ passes), so
every case asserts the same on both paths. The last section is what only one path has."""

from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kforge import guards, native_override
from kforge.cards import ArgSpec, Card, TensorMeta, encode_value, flatten_outputs
from kforge.dispatch import (REASONS, Counters, Dispatcher, DispatchError, PlanLauncher, RegistryLauncher, Variant,
                             differences, dispatch_blocker, installed, native_status)
from kforge.errors import LaunchError, LaunchRefused
from kforge.guards import GuardSpec, value_key

aten = torch.ops.aten


def make_card(op: torch._ops.OpOverload, *args, aliases: dict[int, int] | None = None,
              device: str | None = None, arch: str = "sm_90", **kwargs) -> Card:
    """A card recorded from a real call (every schema argument, defaults filled in)."""
    schema = op._schema
    vals = list(args) + [kwargs.get(a.name, a.default_value if a.has_default_value() else None)
                         for a in schema.arguments[len(args):]]

    def meta(t):
        m = TensorMeta.of(t)
        return TensorMeta(m.shape, m.stride, m.dtype, device or m.device, m.align, m.storage_offset)

    specs = []
    for a, v in zip(schema.arguments, vals):
        written = bool(a.alias_info and a.alias_info.is_write)
        if isinstance(v, torch.Tensor):
            specs.append(ArgSpec(a.name, "tensor", a.kwarg_only, tensor=meta(v), written=written))
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) or t is None for t in v):
            specs.append(ArgSpec(a.name, "tensors", a.kwarg_only, tensors=[meta(t) if t is not None else None for t in v]))
        else:
            specs.append(ArgSpec(a.name, "value", a.kwarg_only, value=encode_value(v)))
    call_args, call_kwargs = [], {}
    for a, v in zip(schema.arguments, vals):
        v = v.clone() if isinstance(v, torch.Tensor) else v
        (call_kwargs.__setitem__(a.name, v) if a.kwarg_only else call_args.append(v))
    outs = flatten_outputs(op(*call_args, **call_kwargs))
    name = f"{op.namespace}::{schema.name.split('::')[1]}.{schema.overload_name or 'default'}"
    return Card(op=name, schema=str(schema), args=specs, outputs=[meta(o) for o in outs], arch=arch,
                aliases=aliases or {})


class FakeLauncher:
    """Stands in for the C++ registry: variant id -> Python "kernel" writing the outputs."""

    def __init__(self, *kernels):
        self.kernels = kernels
        self.calls: list[tuple[int, list, list, list]] = []

    def launch(self, vid, inputs, outputs, workspaces, device):
        self.calls.append((vid, list(inputs), list(outputs), list(workspaces)))
        self.kernels[vid](inputs, outputs)


def relu_kernel(ins, outs):
    outs[0].copy_(ins[0].clamp(min=0))


def softmax_kernel(dim):
    def kernel(ins, outs):
        e = (ins[0] - ins[0].amax(dim, keepdim=True)).exp()
        outs[0].copy_(e / e.sum(dim, keepdim=True))
    return kernel


def layer_norm_kernel(ins, outs):
    x, w, b = ins
    var, mean = torch.var_mean(x, dim=-1, unbiased=False, keepdim=True)
    rstd = (var + 1e-5).rsqrt()
    outs[0].copy_((x - mean) * rstd * w + b)
    outs[1].copy_(mean)
    outs[2].copy_(rstd)


def to_copy_card(x: torch.Tensor, device: torch.device) -> Card:
    """_to_copy(x, dtype=x.dtype, device=device) as recorded (make_card's own `device`
    keyword is the recorded tensors' device type, so the argument is set afterwards)."""
    card = make_card(torch.ops.aten._to_copy.default, x, dtype=x.dtype)
    args = [dataclasses.replace(a, value=encode_value(device)) if a.name == "device" else a for a in card.args]
    return dataclasses.replace(card, args=args, id="")


# ---- the paths -----------------------------------------------------------------------------

try:
    from kforge import _dispatch
except ImportError:  # a build without torch at build time (plain `pip install .`)
    _dispatch = None
else:  # never in the shipped kforge._dispatch: a build with it must have its test launcher too
    from kforge import _dispatch_test

NO_CPP = "kforge._dispatch is not built; build with `pip install --no-build-isolation -e .`"
needs_cpp = pytest.mark.skipif(_dispatch is None, reason=NO_CPP)

_Ptrs = ctypes.POINTER(ctypes.c_uint64)
# kforge_registry_launch's signature (csrc/registry.h): what kforge._dispatch calls on a hit.
_LAUNCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, _Ptrs, ctypes.c_int, _Ptrs, ctypes.c_int,
                              _Ptrs, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)
_LIVE: dict[int, "Kernels"] = {}  # launcher context -> the launcher a C++ hit runs


def _over(ptr: int, m: TensorMeta) -> torch.Tensor:
    """A CPU tensor with m's layout over the memory at ptr."""
    n = m.span() * m.itemsize
    if not n:
        return torch.empty_strided(m.shape, m.stride, dtype=m.torch_dtype)
    buf = (ctypes.c_char * n).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(m.torch_dtype).as_strided(m.shape, m.stride)


@_LAUNCH_FN
def _launch_from_cpp(ctx, vid, ins, n_in, outs, n_out, ws, n_ws, stream, err, err_len):
    launcher = _LIVE[ctx]
    card, workspace = launcher.cards[vid]
    inputs = [_over(ins[i], m) for i, m in enumerate(card.inputs)]
    outputs = [_over(outs[j], m) for j, m in enumerate(card.outputs)]
    spaces = [_over(ws[k], TensorMeta((n,), (1,), "uint8", "cpu")) for k, n in enumerate(workspace)]
    try:
        launcher.launch(vid, inputs, outputs, spaces, torch.device("cpu"))
    except (LaunchError, LaunchRefused) as e:
        text = str(e).encode()[: err_len - 1] + b"\0"
        ctypes.memmove(err, text, len(text))
        return 3 if isinstance(e, LaunchRefused) else 2  # the codes kforge._C's launcher returns
    return 0


class Kernels(FakeLauncher):
    """FakeLauncher that kforge._dispatch launches too: native() hands it a C function that runs
    the same Python kernel on tensors rebuilt over the pointers C++ passes. Calls record those
    tensors, so a test asserts the same on both paths. Variants come from variant()."""

    def __init__(self, *kernels):
        super().__init__(*kernels)
        self.cards: dict[int, tuple[Card, tuple[int, ...]]] = {}
        _LIVE[id(self)] = self

    def native(self, vid):
        return ctypes.cast(_launch_from_cpp, ctypes.c_void_p).value, vid, lambda index: id(self)


def variant(card: Card, launcher: Kernels, vid: int = 0, workspace: tuple[int, ...] = ()) -> Variant:
    launcher.cards[vid] = (card, tuple(workspace))
    return Variant(card, vid, launcher, tuple(workspace))


class OnPath(Dispatcher):
    """A CPU dispatcher that checks every op it overrides is served on `expected`."""

    def __init__(self, expected: str):
        super().__init__("CPU")
        self.expected = expected

    def add(self, owner, variants):
        super().add(owner, variants)
        for op in {v.card.op for v in variants}:
            assert self.path(op)[0] == self.expected, self.path(op)


@pytest.fixture(params=["python", "native"])
def path(request, monkeypatch) -> str:
    monkeypatch.setenv("KFORGE_DISPATCH", request.param)
    if request.param == "native" and _dispatch is None:
        pytest.skip(NO_CPP)
    return request.param


@pytest.fixture
def cpu(path):
    d = OnPath(path)
    yield d
    for owner, _ in list(d._owners):
        d.remove(owner)
    assert not d.ops


def relu_variant(x, **kw):
    launcher = Kernels(relu_kernel)
    return variant(make_card(aten.relu.default, x, **kw), launcher), launcher


def copy_kernel(ins, outs):
    outs[0].copy_(ins[0])


# ---- guard cases: one card and one call, on every path (the compile pass's match included) ---

def _ln(x):
    return (aten.native_layer_norm.default, (x, [16], torch.randn(16), torch.randn(16), 1e-5), {})


# name -> (the card's call, the call, why it misses (None: a hit), the kernel)
GUARD_CASES = {
    "hit": (lambda: (aten.relu.default, (torch.randn(4, 8),), {}), lambda: ((torch.randn(4, 8),), {}), None, relu_kernel),
    "shape": (lambda: (aten.relu.default, (torch.randn(4, 8),), {}), lambda: ((torch.randn(5, 8),), {}), "shape",
              relu_kernel),
    "stride": (lambda: (aten.relu.default, (torch.randn(4, 8),), {}), lambda: ((torch.randn(8, 4).t(),), {}), "stride",
               relu_kernel),
    "memory format": (lambda: (aten.relu.default, (torch.randn(2, 3, 4, 4),), {}),
                      lambda: ((torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last),), {}), "stride",
                      relu_kernel),
    "dtype": (lambda: (aten.relu.default, (torch.randn(4, 8),), {}),
              lambda: ((torch.randn(4, 8, dtype=torch.float64),), {}), "dtype", relu_kernel),
    "alignment": (lambda: (aten.relu.default, (torch.randn(4, 8),), {}),
                  lambda: ((torch.randn(33)[1:].view(4, 8),), {}), "alignment", relu_kernel),
    "device type": (lambda: (aten.relu.default, (torch.randn(4, 8),), {"device": "cuda"}),
                    lambda: ((torch.randn(4, 8),), {}), "device", relu_kernel),
    "scalar": (lambda: (aten.leaky_relu.default, (torch.randn(4, 8), 0.2), {}), lambda: ((torch.randn(4, 8), 0.3), {}),
               "scalar", lambda ins, outs: outs[0].copy_(torch.where(ins[0] > 0, ins[0], ins[0] * 0.2))),
    "an int is not a float": (lambda: (aten.add.Tensor, (torch.randn(16), torch.randn(16)), {}),
                              lambda: ((torch.randn(16), torch.randn(16)), {"alpha": 1.0}), "scalar",
                              lambda ins, outs: outs[0].copy_(ins[0].sub(-ins[1]))),
    "missing optional tensor": (lambda: _ln(torch.randn(6, 16)),
                                lambda: ((torch.randn(6, 16), [16], torch.randn(16), None, 1e-5), {}), "no-variant",
                                layer_norm_kernel),
}


def _guard_case(name):
    recorded, called, reason, kernel = GUARD_CASES[name]
    op, args, kwargs = recorded()
    device = kwargs.pop("device", None)
    card = make_card(op, *args, device=device, **kwargs)
    call_args, call_kwargs = called()
    return card, op, call_args, call_kwargs, reason, kernel


def _fake(mode, x):
    return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("where", ["python", "native", "compile"])
@pytest.mark.parametrize("name", list(GUARD_CASES))
def test_a_call_hits_or_misses_for_the_same_reason_on_every_path(name, where, monkeypatch):
    card, op, args, kwargs, reason, kernel = _guard_case(name)
    launcher = Kernels(kernel)
    v = variant(card, launcher)
    if where == "compile":  # the pass's match of the call as traced: FakeTensors, as node.meta["val"] holds them
        from torch._subclasses.fake_tensor import FakeTensorMode

        from kforge import customops, inductor

        monkeypatch.delenv("KFORGE_DISPATCH", raising=False)
        rewrite = inductor.OpRewrite([(v, customops.kernel_op(v, "guardcase" + card.id))])
        with FakeTensorMode() as mode:
            fake_args = [[_fake(mode, t) for t in a] if isinstance(a, list) else _fake(mode, a) for a in args]
            hit = rewrite.match(op, fake_args, {k: _fake(mode, x) for k, x in kwargs.items()})
        assert (hit is not None) == (reason is None)
        return
    if where == "native" and _dispatch is None:
        pytest.skip(NO_CPP)
    monkeypatch.setenv("KFORGE_DISPATCH", where)
    want = op(*args, **kwargs)  # eager's, before the override exists
    d = OnPath(where)
    d.add("pkg", [v])
    try:
        got = op(*args, **kwargs)
    finally:
        d.remove("pkg")
    assert (v.counters.hits, v.counters.fallbacks) == ((1, {}) if reason is None else (0, {reason: 1}))
    assert len(launcher.calls) == (reason is None)
    for g, w in zip(flatten_outputs(got), flatten_outputs(want)):
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
        torch.testing.assert_close(g, w)


# ---- cases on both override paths ------------------------------------------------------------

def test_hit_launches_the_kernel_with_fresh_outputs_and_counts(cpu):
    x = torch.randn(4, 8)
    v, launcher = relu_variant(x)
    cpu.add("pkg", [v])
    y = torch.relu(x)
    (vid, ins, outs, ws), = launcher.calls
    assert ins[0].data_ptr() == x.data_ptr() and outs[0].data_ptr() == y.data_ptr() != x.data_ptr() and not ws
    assert torch.equal(y, x.clamp(min=0)) and y.stride() == (8, 1) and y.dtype == x.dtype
    assert v.counters.hits == 1 and not v.counters.fallbacks


def test_scalar_arguments_are_part_of_the_guard(cpu):
    x = torch.randn(8, 8)
    launcher = Kernels(softmax_kernel(1))
    v = variant(make_card(aten._softmax.default, x, 1, False), launcher)
    want1, want0 = F.softmax(x.double(), 1).float(), F.softmax(x.double(), 0).float()
    cpu.add("pkg", [v])
    torch.testing.assert_close(torch.softmax(x, 1), want1)
    torch.testing.assert_close(torch.softmax(x, 0), want0)
    assert len(launcher.calls) == 1
    assert v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 1}


def test_defaults_the_dispatcher_strips_still_hit(cpu):
    # The dispatcher hands Python kernels trailing defaults left out (negative_slope here).
    x = torch.randn(4, 8)
    launcher = Kernels(lambda ins, outs: outs[0].copy_(torch.where(ins[0] > 0, ins[0], ins[0] * 0.01)))
    v = variant(make_card(aten.leaky_relu.default, x), launcher)
    cpu.add("pkg", [v])
    F.leaky_relu(x)
    F.leaky_relu(x, 0.2)
    assert v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 1}


def test_ints_floats_and_defaults_are_told_apart(cpu):
    a, b = torch.randn(16), torch.randn(16)
    v = variant(make_card(aten.add.Tensor, a, b), Kernels(copy_kernel))  # alpha=1, the default
    cpu.add("pkg", [v])
    assert torch.equal(torch.add(a, b), a)  # the stand-in copies: it ran
    torch.add(a, b, alpha=1.0)
    torch.add(a, b, alpha=2)
    assert v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 2}


@pytest.mark.parametrize("recorded, called, hit", [
    (0.0, 0.0, True), (0.0, -0.0, False), (-0.0, -0.0, True), (float("nan"), float("nan"), True),
    (float("nan"), 0.0, False), (float("inf"), float("inf"), True), (0.01, 0.01, True), (0.01, 0.010000000000000002, False),
])
def test_float_values_match_bit_exactly_and_nan_matches_nan(cpu, recorded, called, hit):
    x = torch.randn(4, 8)
    v = variant(make_card(aten.leaky_relu.default, x, recorded), Kernels(copy_kernel))
    cpu.add("pkg", [v])
    F.leaky_relu(x, called)
    assert (v.counters.hits, v.counters.fallbacks) == ((1, {}) if hit else (0, {"scalar": 1}))


def test_enum_values_are_guarded(cpu):
    x = torch.randn(4, 8)
    v = variant(make_card(aten.clone.default, x, memory_format=torch.contiguous_format), Kernels(copy_kernel))
    cpu.add("pkg", [v])
    y = aten.clone.default(x, memory_format=torch.contiguous_format)
    aten.clone.default(x, memory_format=torch.preserve_format)
    assert torch.equal(y, x) and v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 1}


def test_value_keys_tell_apart_what_cards_tell_apart():
    assert len({value_key(1), value_key(1.0), value_key(True)}) == 3
    assert value_key(float("nan")) == value_key(float("nan"))
    assert value_key(0.0) != value_key(-0.0) and value_key([0.0]) != value_key([-0.0])
    assert value_key(torch.device("cuda", 1)) == value_key(torch.device("cuda"))
    assert value_key([1, 2]) == value_key((1, 2)) != value_key([2, 1])


def test_in_place_output_is_the_input_itself(cpu):
    x = torch.randn(4, 8)
    launcher = Kernels(lambda ins, outs: outs[0].clamp_(min=0))
    v = variant(make_card(aten.relu_.default, x, aliases={0: 0}), launcher)
    cpu.add("pkg", [v])
    expected = x.clamp(min=0)
    y = x.relu_()
    assert y is x and torch.equal(x, expected) and v.counters.hits == 1
    assert launcher.calls[0][1][0].data_ptr() == launcher.calls[0][2][0].data_ptr() == x.data_ptr()


def test_out_variant_writes_into_out(cpu):
    a, b, out = torch.randn(16), torch.randn(16), torch.empty(16)
    launcher = Kernels(lambda ins, outs: outs[0].copy_(ins[0].sub(-ins[1])))  # not add: that would recurse
    v = variant(make_card(aten.add.out, a, b, out=out, aliases={0: 2}), launcher)
    cpu.add("pkg", [v])
    r = torch.add(a, b, out=out)
    assert r is out and torch.allclose(out, a + b) and v.counters.hits == 1


def test_multi_output_op_under_autograd_no_grad_and_inference_mode(cpu):
    x, w, b = torch.randn(6, 16), torch.randn(16), torch.randn(16)
    launcher = Kernels(layer_norm_kernel)
    v = variant(make_card(aten.native_layer_norm.default, x, [16], w, b, 1e-5), launcher)
    cpu.add("pkg", [v])
    got = aten.native_layer_norm.default(x, [16], w, b, 1e-5)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = F.layer_norm(xr, (16,), wr, br)
    y.square().sum().backward()
    assert v.counters.hits == 2
    cpu.remove("pkg")
    want = aten.native_layer_norm.default(x, [16], w, b, 1e-5)
    assert isinstance(got, tuple) and len(got) == 3  # every output, laid out as the card says
    assert [(t.shape, t.stride(), t.dtype) for t in got] == [(t.shape, t.stride(), t.dtype) for t in want]
    xe, we, be = (t.clone().requires_grad_() for t in (x, w, b))
    ye = F.layer_norm(xe, (16,), we, be)
    ye.square().sum().backward()
    torch.testing.assert_close(y, ye)
    # Backward reads the mean and rstd our kernel returned: their gradients agree only if those are right.
    for g, e in ((xr, xe), (wr, we), (br, be)):
        torch.testing.assert_close(g.grad, e.grad)
    cpu.add("pkg", [v])
    with torch.no_grad():
        torch.testing.assert_close(F.layer_norm(x, (16,), w, b), ye.detach())
    with torch.inference_mode():
        torch.testing.assert_close(F.layer_norm(x, (16,), w, b), ye.detach())
    assert v.counters.hits == 4


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


def test_workspaces_are_allocated_per_call(cpu):
    x = torch.randn(4, 8)
    launcher = Kernels(relu_kernel)
    v = variant(make_card(aten.relu.default, x), launcher, workspace=(64, 4))
    cpu.add("pkg", [v])
    torch.relu(x)
    torch.relu(x)
    first, second = (c[3] for c in launcher.calls)
    assert [t.numel() for t in first] == [64, 4] and all(t.dtype == torch.uint8 for t in first)
    assert v.counters.hits == 2


def test_uninstall_restores_the_dispatch_table_exactly(cpu):
    before = torch._C._dispatch_dump("aten::relu")
    kernel = repr(torch.library.get_kernel(aten.relu.default, "CPU"))
    v, launcher = relu_variant(torch.randn(4, 8))
    cpu.add("pkg", [v])
    assert torch._C._dispatch_dump("aten::relu") != before and cpu.ops == ["aten::relu.default"]
    cpu.remove("pkg")
    assert torch._C._dispatch_dump("aten::relu") == before and not cpu.ops
    assert repr(torch.library.get_kernel(aten.relu.default, "CPU")) == kernel
    torch.relu(torch.randn(4, 8))
    assert not launcher.calls and v.counters.hits == 0


def test_two_packages_share_one_override_and_come_off_in_any_order(cpu):
    before = {op: torch._C._dispatch_dump(op) for op in ("aten::relu", "aten::_softmax")}
    x, z = torch.randn(4, 8), torch.randn(2, 3)
    a = Kernels(relu_kernel)
    b = Kernels(relu_kernel, softmax_kernel(-1))
    va = variant(make_card(aten.relu.default, x), a)
    vb = [variant(make_card(aten.relu.default, z), b), variant(make_card(aten._softmax.default, z, -1, False), b, 1)]
    cpu.add("A", [va])
    cpu.add("B", vb)
    torch.relu(x), torch.relu(z), torch.softmax(z, -1)
    assert [c[0] for c in a.calls] == [0] and [c[0] for c in b.calls] == [0, 1]
    cpu.remove("A")
    torch.relu(x), torch.relu(z)
    assert len(a.calls) == 1 and len(b.calls) == 3
    assert vb[0].counters.fallbacks == {"shape": 1}  # x now misses, charged to B's relu variant
    cpu.remove("B")
    assert {op: torch._C._dispatch_dump(op) for op in before} == before


def test_same_key_in_two_packages_the_later_wins_until_removed(cpu):
    x = torch.randn(4, 8)
    first, second = Kernels(copy_kernel), Kernels(relu_kernel)
    card = make_card(aten.relu.default, x)
    cpu.add("first", [variant(card, first)])
    cpu.add("second", [variant(card, second)])
    assert torch.equal(torch.relu(x), x.clamp(min=0))  # the later package's kernel
    cpu.remove("second")
    assert torch.equal(torch.relu(x), x)  # the first package's stand-in copies
    assert len(first.calls) == 1 and len(second.calls) == 1


def test_several_variants_of_one_op_and_nearest_variant_takes_the_miss(cpu):
    x, y = torch.randn(4, 8), torch.randn(16, 8)
    launcher = Kernels(relu_kernel, relu_kernel)
    v1 = variant(make_card(aten.relu.default, x), launcher)
    v2 = variant(make_card(aten.relu.default, y), launcher, 1)
    cpu.add("pkg", [v1, v2])
    torch.relu(x), torch.relu(y), torch.relu(y), torch.relu(y.t().contiguous().t())
    assert [c[0] for c in launcher.calls] == [0, 1, 1]
    assert v2.counters.fallbacks == {"stride": 1} and not v1.counters.fallbacks
    torch.relu(y.double())
    torch.relu(y.double())  # memoised classification still counts
    assert v2.counters.fallbacks == {"stride": 1, "dtype": 2}


def test_installing_an_owner_twice_is_an_error(cpu):
    v, _ = relu_variant(torch.randn(4, 8))
    cpu.add("pkg", [v])
    with pytest.raises(DispatchError, match="already installed"):
        cpu.add("pkg", [v])


def test_installed_times_one_kernel_as_dispatched_and_restores(path):
    before = torch._C._dispatch_dump("aten::relu")
    x = torch.randn(4, 8)
    card, launcher = make_card(aten.relu.default, x), Kernels(relu_kernel)
    launcher.cards[0] = (card, ())
    with installed(card, launcher, key="CPU") as v:
        assert torch.equal(card.call_eager([x])[0], x.clamp(min=0))
    card.call_eager([x])
    assert v.counters.hits == 1 and len(launcher.calls) == 1
    assert torch._C._dispatch_dump("aten::relu") == before


@pytest.mark.parametrize("x, scalar", [
    (torch.randn(4, 8).to(torch.bfloat16), 1e-6),
    (torch.arange(6, dtype=torch.int32), 2),
    (torch.arange(6, dtype=torch.int32), 0.5),
    (torch.tensor([True, False]), 1),
    # The stand-in 0-dim tensor must keep eager's double precision and eager's result dtype.
    (torch.tensor([1.0, 3.0], dtype=torch.float64), 0.1),
    (torch.tensor([1.0, 3.0], dtype=torch.complex128), 0.1),
    (torch.tensor([1.0, 3.0], dtype=torch.float64), 0.1j),
    (torch.tensor(1.0, dtype=torch.float64), 0.1),
    (torch.tensor(1.0, dtype=torch.float16), 0.1),
    (torch.tensor(7, dtype=torch.int32), 2),
])
def test_python_scalar_in_a_tensor_slot_falls_back_like_eager(cpu, x, scalar):
    """`x + 1e-6` reaches the override with a wrapped number where add.Tensor says Tensor;
    the fallback must still compute what eager does, with eager's result dtype."""
    want = x + scalar
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    launcher = Kernels(lambda ins, outs: outs[0].copy_(ins[0] + ins[1]))
    v = variant(make_card(aten.add.Tensor, y, y.clone()), launcher)
    cpu.add("pkg", [v])
    got = x + scalar
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert v.counters.hits == 0 and v.counters.fallbacks == {"no-variant": 1} and not launcher.calls


def test_python_scalar_falls_back_like_eager_in_place_and_with_out(cpu):
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    cpu.add("pkg", [variant(make_card(aten.add_.Tensor, y.clone(), y, aliases={0: 0}), Kernels()),
                    variant(make_card(aten.add.out, y, y, out=y.clone(), aliases={0: 2}), Kernels())])
    x = torch.tensor([1.0, 3.0], dtype=torch.float64)
    assert torch.equal(x.clone().add_(0.1), torch.tensor([1.0 + 0.1, 3.0 + 0.1], dtype=torch.float64))
    # out= does not take part in type promotion: int32 + 0.1 computes in float32, then casts.
    out = torch.empty(2, dtype=torch.float64)
    torch.add(torch.tensor([1, 3], dtype=torch.int32), 0.1, out=out)
    assert torch.equal(out, torch.tensor([1, 3], dtype=torch.float32).add(0.1).double())


def test_conjugate_and_negative_views_never_hit(cpu):
    # copy_ and clone take these views unresolved: a kernel for the plain layout would drop the bit.
    x, z = torch.randn(4, 8), torch.randn(4, 8, dtype=torch.complex64)
    # Not copy_: that is the override. Both views are contiguous: copying their bytes is copy_.
    launcher = Kernels(lambda ins, outs: ctypes.memmove(outs[0].data_ptr(), ins[1].data_ptr(), ins[1].nbytes),
                       lambda ins, outs: None)
    real = variant(make_card(aten.copy_.default, torch.empty(4, 8), x, aliases={0: 0}), launcher)
    cplx = variant(make_card(aten.copy_.default, torch.empty_like(z), z, aliases={0: 0}), launcher, 1)
    cpu.add("pkg", [real, cplx])
    y, w = torch.empty(4, 8), torch.empty_like(z)
    y.copy_(x._neg_view())
    w.copy_(z.conj())
    assert real.counters.fallbacks == {"no-variant": 1} and cplx.counters.fallbacks == {"no-variant": 1}
    assert not launcher.calls and torch.equal(y, -x) and torch.equal(w, z.conj())
    assert y.copy_(x) is y and torch.equal(y, x) and real.counters.hits == 1


def test_an_out_argument_that_is_also_an_input_falls_back(cpu):
    """add.out(a, b, out=a) matches a card recorded as add.out(a, b, out=c) key for key, but
    the kernel would write what it reads: eager serves it, counted as aliasing."""
    a, b, out = torch.randn(16), torch.randn(16), torch.empty(16)
    v = variant(make_card(aten.add.out, a, b, out=out, aliases={0: 2}),
                Kernels(lambda ins, outs: outs[0].copy_(ins[0] + ins[1])))
    cpu.add("pkg", [v])
    expected = a + b
    assert torch.add(a, b, out=a) is a and torch.equal(a, expected)
    assert v.counters.hits == 0 and v.counters.fallbacks == {"aliasing": 1}
    torch.add(b, b.clone(), out=out)  # no sharing: the kernel runs
    assert v.counters.hits == 1


def refused(ins, outs):
    raise LaunchRefused("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: too large (refused before any kernel ran)",
                        "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 720)


def failed(ins, outs):
    raise LaunchError("CUDA_ERROR_ILLEGAL_ADDRESS: boom", "CUDA_ERROR_ILLEGAL_ADDRESS")


# A kernel that ran and failed surfaces as the path raises it: kforge's LaunchError in Python,
# torch's RuntimeError from the C++ kernel (its message names the kernel and carries the error).
FAILURE = {"python": LaunchError, "native": RuntimeError}


def test_a_launch_refused_before_it_ran_falls_back_to_eager_and_a_failed_one_raises(cpu, path):
    x = torch.randn(4, 8)
    v = variant(make_card(aten.relu.default, x), Kernels(refused))
    cpu.add("pkg", [v])
    assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert v.counters.hits == 0 and v.counters.fallbacks == {"refused": 1}
    cpu.remove("pkg")
    w = variant(make_card(aten.relu.default, x), Kernels(failed))
    cpu.add("pkg2", [w])
    with pytest.raises(FAILURE[path], match="ILLEGAL_ADDRESS: boom"):  # a kernel that ran and failed is not hidden
        torch.relu(x)
    z = torch.randn(5, 8)
    assert torch.equal(torch.relu(z), z.clamp(min=0))  # the process goes on
    assert w.counters.hits == 0 and w.counters.fallbacks == {"shape": 1}  # a failed launch served nothing


def test_kernels_that_cannot_be_loaded_on_a_device_leave_it_to_pytorch(cpu):
    """A registry whose kernels cannot be prepared where the call runs (here: no CUDA at all)
    warns once and falls back, on either dispatch path, instead of failing the model."""
    x = torch.randn(4, 8)
    v = Variant(make_card(aten.relu.default, x), 0, RegistryLauncher([(None, b"")]))
    cpu.add("pkg", [v])
    with pytest.warns(UserWarning, match="could not prepare"):
        assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert v.counters.hits == 0 and v.counters.fallbacks == {"device": 2}


def test_a_device_argument_naming_another_device_index_falls_back(cpu):
    """Cards hold device types: x.to("cuda:1") of a cuda:0 tensor matches a card recorded
    from x.to("cuda:0"), and a kernel would write it on the wrong device. Eager serves it."""
    x = torch.randn(4, 8)
    launcher = Kernels(copy_kernel)
    v = variant(to_copy_card(x, torch.device("cpu")), launcher)
    cpu.add("pkg", [v])
    y = torch.ops.aten._to_copy.default(x, dtype=x.dtype, device=torch.device("cpu"))
    assert torch.equal(y, x) and v.counters.hits == 1
    z = torch.ops.aten._to_copy.default(x, dtype=x.dtype, device=torch.device("cpu", 1))
    assert torch.equal(z, x) and len(launcher.calls) == 1 and v.counters.fallbacks == {"device": 1}


# ---- composite ops (kforge.composite): the override sits above autograd --------------------

def cast_softmax_kernel(ins, outs):
    outs[0].copy_(aten._softmax(ins[0].float(), -1, False))  # not softmax.int: that is the override


def test_composite_op_hits_without_grad_and_leaves_backward_to_eager(cpu):
    before = torch._C._dispatch_dump("aten::softmax.int")
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    launcher = Kernels(cast_softmax_kernel)
    v = variant(make_card(aten.softmax.int, x, -1, torch.float32), launcher)
    want = torch.softmax(x.float(), -1)
    cpu.add("pkg", [v])
    with torch.no_grad():
        torch.testing.assert_close(F.softmax(x, -1, dtype=torch.float32), want)
    with torch.inference_mode():
        torch.testing.assert_close(F.softmax(x, -1, dtype=torch.float32), want)
    F.softmax(x, -1, dtype=torch.float32)  # grad mode on, nothing requires grad: no backward to record
    assert v.counters.hits == 3 and len(launcher.calls) == 3
    xr = x.clone().requires_grad_()
    y = F.softmax(xr, -1, dtype=torch.float32)
    assert y.grad_fn is not None and v.counters.fallbacks == {"autograd": 1}
    y[:, 0].sum().backward()
    assert xr.grad is not None and xr.grad.abs().sum() > 0
    F.softmax(x, -1)  # no dtype=: another call of the same composite, told apart by its value
    assert v.counters.fallbacks == {"autograd": 1, "scalar": 1} and len(launcher.calls) == 3
    cpu.remove("pkg")
    assert torch._C._dispatch_dump("aten::softmax.int") == before


def test_composite_op_leaves_wrapped_tensors_and_tangents_to_eager(cpu):
    # Above autograd the override also sees fake tensors (torch.compile's tracing), functorch
    # transforms and forward-mode duals; only the decomposition handles those (and the C++
    # guards, which read pointers, never see them).
    import torch.autograd.forward_ad as fwAD
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    want = torch.softmax(x.float(), -1)
    launcher = Kernels(cast_softmax_kernel)
    v = variant(make_card(aten.softmax.int, x, -1, torch.float32), launcher)
    cpu.add("pkg", [v])
    with FakeTensorMode() as mode:
        assert F.softmax(mode.from_tensor(x), -1, dtype=torch.float32).shape == (4, 8)
    compiled = torch.compile(lambda t: F.softmax(t, -1, dtype=torch.float32), backend="aot_eager")
    torch.testing.assert_close(compiled(x), want)
    y = torch.func.vmap(lambda t: F.softmax(t, -1, dtype=torch.float32))(x)
    torch.testing.assert_close(y, want)
    assert not launcher.calls and v.counters.hits == 0 and not v.counters.fallbacks  # not calls for a kernel
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        out = F.softmax(dual, -1, dtype=torch.float32)
        assert fwAD.unpack_dual(out).tangent is not None
    assert not launcher.calls and v.counters.fallbacks == {"autograd": 1}


# ---- the guard specification itself -----------------------------------------------------------

def test_cards_that_cannot_be_dispatched_say_why():
    card = make_card(aten.split.Tensor, torch.randn(8), 4)
    assert "does not return plain tensors" in dispatch_blocker(card)
    with pytest.raises(DispatchError, match="split"):
        Variant(card, 0, FakeLauncher())
    gone = make_card(aten.relu.default, torch.randn(3))
    gone.op = "aten::no_such_op.default"
    assert "does not exist" in dispatch_blocker(gone)


def test_a_card_whose_argument_kind_is_not_the_schemas_is_not_dispatched():
    card = make_card(aten.leaky_relu.default, torch.randn(4, 8))
    card.args[1] = dataclasses.replace(card.args[1], kind="tensor", tensor=card.args[0].tensor)
    assert "negative_slope is a tensor in the card and a value in the schema" in dispatch_blocker(card)


def test_cards_with_inputs_on_two_device_types_are_not_dispatched():
    card = make_card(aten.mul.Tensor, torch.randn(4), torch.tensor(2.0))
    card.args[1] = dataclasses.replace(card.args[1], tensor=dataclasses.replace(card.args[1].tensor, device="cuda"))
    assert "more than one device type" in dispatch_blocker(card)


def test_a_card_whose_call_resizes_its_out_tensor_is_not_dispatched():
    """abs(x) as abs.out into an empty tensor the op resizes: a kernel would write past its end, so
    a package carrying such a card (its search never makes one) gets it refused; an out= tensor of
    the output's size is dispatched as any other."""
    resized = make_card(aten.abs.out, torch.randn(8, 16), out=torch.empty(0), aliases={0: 1})
    assert "resizes the tensor it writes (0 before, 8x16 after)" in dispatch_blocker(resized)
    with pytest.raises(DispatchError, match="resizes"):
        Variant(resized, 0, FakeLauncher())
    assert dispatch_blocker(make_card(aten.abs.out, torch.randn(8, 16), out=torch.empty(8, 16), aliases={0: 1})) is None
    for aliases in ({3: 1}, {-1: 1}, {0: 2}):  # a package's aliases naming what the card does not have
        card = make_card(aten.abs.out, torch.randn(8, 16), out=torch.empty(8, 16), aliases=aliases)
        assert "name inputs or outputs the card does not have" in dispatch_blocker(card)


def test_differences_are_listed_most_fundamental_first():
    a = ((4, 8), (8, 1), torch.float32, "cpu", 16)
    assert differences((a,), (a,), ("tensor",)) == []
    assert differences((((5, 8), (8, 1), torch.float16, "cpu", 4),), (a,), ("tensor",)) == ["dtype", "shape", "alignment"]
    assert differences((((4, 8), (1, 4), torch.float32, "cpu", 16),), (a,), ("tensor",)) == ["stride"]
    assert differences((a, ("i", 0)), (a, ("i", 1)), ("tensor", "value")) == ["scalar"]
    assert differences(((a,),), ((a, a),), ("tensors",)) == ["no-variant"]
    assert differences((None,), (a,), ("tensor",)) == ["no-variant"]


def test_the_spec_is_built_once_and_serialized_in_one_versioned_format():
    x = torch.randn(4, 8)
    card = make_card(aten.add.out, x, x.clone(), out=torch.empty(4, 8), aliases={0: 2})
    spec = GuardSpec.of_card(card)
    assert Variant(card, 0, FakeLauncher()).guard == spec
    tensor = ([4, 8], [8, 1], "float32", "cpu", 16)
    assert spec.native() == (guards.FORMAT, [("tensor", tensor), ("tensor", tensor), ("value", ("int", 1)),
                                             ("tensor", tensor)], [2], [])
    assert spec.key == (((4, 8), (8, 1), torch.float32, "cpu", 16),) * 2 + (("i", 1),) + (((4, 8), (8, 1), torch.float32, "cpu", 16),)
    to_copy = GuardSpec.of_card(to_copy_card(x, torch.device("cpu")))
    device = [a.name for a in aten._to_copy.default._schema.arguments].index("device")
    assert to_copy.device_slots == (device,) and to_copy.native()[3] == [device]


def test_every_fallback_reason_is_in_the_one_table():
    assert REASONS == guards.REASONS and all(guards.meaning(r) for r in REASONS)
    c = Counters()
    with pytest.raises(ValueError, match="unknown fallback reason 'slow'"):
        c.fell_back("slow")
    c.fell_back("stride")
    assert c.fallbacks == {"stride": 1}


# ---- which path an op takes, and kforge._dispatch's own contract -------------------------------

COPY, RELU, FAIL, REFUSED = 0, 1, 2, 3  # the modes of kforge._dispatch_test's C launcher


class NativeLauncher:
    """kforge._dispatch_test's C launcher behind native(): variant vid runs modes[vid] over
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
def either(monkeypatch):
    """A CPU dispatcher that picks the path itself (KFORGE_DISPATCH unset)."""
    if _dispatch is None:
        pytest.skip(NO_CPP)
    monkeypatch.delenv("KFORGE_DISPATCH", raising=False)
    d = Dispatcher("CPU")
    yield d
    for owner, _ in list(d._owners):
        d.remove(owner)
    assert not d.ops


@needs_cpp
def test_the_cpp_module_reads_this_kforges_reasons_and_guard_format(monkeypatch):
    monkeypatch.delenv("KFORGE_DISPATCH", raising=False)
    assert _dispatch.REASONS == REASONS and _dispatch.GUARD_FORMAT == guards.FORMAT
    assert _dispatch.TORCH_VERSION == torch.__version__
    assert native_status("CPU") == (True, f"kforge._dispatch, built against torch {torch.__version__}")
    o = _dispatch.Override("aten::relu", "", "CPU")
    try:
        old = (guards.FORMAT + 1, [("tensor", ([4, 8], [8, 1], "float32", "cpu", 16))], [], [])
        with pytest.raises(ValueError, match=f"guard format {guards.FORMAT + 1}, this kforge._dispatch reads"):
            o.set_variants([(old, [(None, [4, 8], [8, 1], "float32")], [], _dispatch_test.test_launcher_address(), 1,
                             lambda index: 128, _dispatch.Counts())])
    finally:
        o.destroy()


def test_the_c_launcher_gets_the_pointers_and_no_stream_on_the_cpu(either):
    x = torch.randn(4, 8)
    v = Variant(make_card(aten.relu.default, x), 0, NativeLauncher(RELU, nbytes=x.nbytes), workspace=(64, 4))
    either.add("pkg", [v])
    assert either.path("aten::relu.default")[0] == "native"
    before = calls()
    y = torch.relu(x)
    log = _dispatch_test.test_launcher_log()
    assert calls() == before + 1 and not v.launcher.python_calls and torch.equal(y, x.clamp(min=0))
    assert (log["vid"], log["n_in"], log["n_out"], log["n_ws"], log["stream"]) == (RELU, 1, 1, 2, 0)
    assert log["in0"] == x.data_ptr() and log["out0"] == y.data_ptr()
    assert "kforge._dispatch" in repr(torch.library.get_kernel(aten.relu.default, "CPU"))


def test_a_failing_c_launch_names_the_kernel(either):
    x = torch.randn(4, 8)
    either.add("pkg", [Variant(make_card(aten.relu.default, x), 0, NativeLauncher(FAIL))])
    with pytest.raises(RuntimeError, match=r"launch failed in kforge's kernel for aten::relu \(variant 2\): "
                                           "the test launcher was told to fail"):
        torch.relu(x)


def test_python_launchers_keep_the_op_in_python_and_it_moves_when_they_go(either):
    before = torch._C._dispatch_dump("aten::relu")
    x, y = torch.randn(4, 8), torch.randn(2, 3)
    native = Variant(make_card(aten.relu.default, x), 0, NativeLauncher(RELU, nbytes=x.nbytes))
    python = Variant(make_card(aten.relu.default, y), 0, FakeLauncher(relu_kernel))
    either.add("native", [native])
    either.add("python", [python])
    path, why = either.path("aten::relu.default")
    assert path == "python" and "FakeLauncher launches from Python only" in why
    torch.relu(x)
    either.remove("python")
    assert either.path("aten::relu.default")[0] == "native"
    torch.relu(x)
    assert native.counters.hits == 2  # one in Python, one in C++: one Counters
    either.remove("native")
    assert torch._C._dispatch_dump("aten::relu") == before


def test_guards_cpp_cannot_express_keep_the_op_in_python(either):
    x = torch.randn(4, 8)
    card = make_card(aten.leaky_relu.default, x)
    card.args[1].value = encode_value([0.5, 0.25])
    either.add("pkg", [Variant(card, 0, NativeLauncher(COPY))])
    path, why = either.path("aten::leaky_relu.default")
    assert path == "python" and "no C++ guard for the value [0.5, 0.25]" in why


def test_kforge_dispatch_env_picks_the_path(either, monkeypatch):
    x = torch.randn(4, 8)
    v = Variant(make_card(aten.relu.default, x), 0, NativeLauncher(RELU, nbytes=x.nbytes))
    monkeypatch.setenv("KFORGE_DISPATCH", "python")
    either.add("pkg", [v])
    assert either.path("aten::relu.default") == ("python", "KFORGE_DISPATCH=python")
    torch.relu(x)
    assert v.launcher.python_calls == 1 and v.counters.hits == 1
    either.remove("pkg")
    monkeypatch.setenv("KFORGE_DISPATCH", "native")
    with pytest.raises(DispatchError, match="KFORGE_DISPATCH=native"):
        either.add("pkg", [Variant(make_card(aten.relu.default, x), 0, FakeLauncher(relu_kernel))])


def test_a_refused_native_override_is_not_kept(either, monkeypatch):
    x = torch.randn(4, 8)
    v = Variant(make_card(aten.relu.default, x), 0, NativeLauncher(RELU, nbytes=x.nbytes))

    def refuse(self, descriptions):
        raise ValueError("no")

    monkeypatch.setattr(native_override.NativeOverride, "set_variants", refuse)
    either.add("pkg", [v])  # served in Python instead
    path, why = either.path("aten::relu.default")
    assert path == "python" and "refused" in why
    either.remove("pkg")
    monkeypatch.setenv("KFORGE_DISPATCH", "native")
    with pytest.raises(DispatchError, match="KFORGE_DISPATCH=native"):
        either.add("pkg", [v])
    assert not either.ops and torch.equal(torch.relu(x), x.clamp(min=0))  # nothing half-installed


def test_a_kernel_that_cannot_be_prepared_on_a_device_is_asked_once(either):
    x = torch.randn(4, 8)
    asked = []

    class Unpreparable(NativeLauncher):
        def native(self, vid):
            def resolve(index):
                asked.append(index)
                raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU: not this architecture")
            return _dispatch_test.test_launcher_address(), self.modes[vid], resolve

    v = Variant(make_card(aten.relu.default, x), 0, Unpreparable(RELU, nbytes=x.nbytes))
    either.add("pkg", [v])
    with pytest.warns(UserWarning, match="could not prepare its kernel on device -1"):
        assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert asked == [-1]  # asked once, remembered
    assert v.counters.hits == 0 and v.counters.fallbacks == {"device": 2}


@needs_cpp
def test_counters_read_through_to_cpp():
    c = Counters()
    assert (c.hits, c.fallbacks) == (0, {})
    c.hit()
    c.fell_back("shape")
    cell = c.native_cell(_dispatch)
    assert c.native_cell(_dispatch) is cell and (c.hits, c.fallbacks) == (1, {"shape": 1})


@needs_cpp
def test_plan_launcher_is_native_only_for_a_real_plan():
    assert PlanLauncher(object()).native(0) is None


@needs_cpp
def test_a_fresh_process_warns_nothing_and_exits_with_the_override_installed():
    script = textwrap.dedent("""
        import torch
        from kforge import _dispatch, _dispatch_test
        o = _dispatch.Override("aten::relu", "", "CPU")
        x = torch.randn(4, 8)
        c = _dispatch.Counts()
        guard = (_dispatch.GUARD_FORMAT, [("tensor", ([4, 8], [8, 1], "float32", "cpu", 16))], [], [])
        o.set_variants([(guard, [(None, [4, 8], [8, 1], "float32")], [], _dispatch_test.test_launcher_address(), 1,
                         lambda index: 128, c)])
        assert torch.equal(torch.relu(x), x.clamp(min=0)) and c.hits == 1
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok" and "Overriding a previously registered kernel" not in proc.stderr


@needs_cpp
def test_stub_names_what_the_module_has():
    import ast
    from pathlib import Path

    import kforge

    tree = ast.parse((Path(kforge.__file__).parent / "_dispatch.pyi").read_text())
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stubbed |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    assert stubbed == {n for n in dir(_dispatch) if not n.startswith("_")}


@needs_cpp
def test_a_destroyed_override_refuses_new_variants_without_crashing():
    o = _dispatch.Override("aten::relu", "", "CPU")
    o.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        o.set_variants([])
    assert o.counters() == [] and not o.active
    o.destroy()  # twice is fine
    with pytest.raises(ValueError, match="CompositeImplicitAutograd"):
        _dispatch.Override("aten::relu", "", "CPU", "AutogradCPU")
