"""Guarded dispatch on the CPU: the CPU key stands in for CUDA, Python functions for kernels."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import pytest

from kforge.cards import ArgSpec, Card, TensorMeta, encode_value, flatten_outputs
from kforge.dispatch import (Dispatcher, DispatchError, Variant, _value_key, differences, dispatch_blocker,
                             installed)

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


@pytest.fixture
def cpu():
    d = Dispatcher("CPU")
    yield d
    for owner, _ in list(d._owners):
        d.remove(owner)
    assert not d.ops


def relu_variant(x, launcher=None, vid=0, **kw):
    launcher = launcher or FakeLauncher(relu_kernel)
    return Variant(make_card(aten.relu.default, x, **kw), vid, launcher), launcher


def test_hit_launches_the_kernel_with_fresh_outputs_and_counts(cpu):
    x = torch.randn(4, 8)
    v, launcher = relu_variant(x)
    cpu.add("pkg", [v])
    y = torch.relu(x)
    assert len(launcher.calls) == 1 and launcher.calls[0][1][0] is x
    assert torch.equal(y, x.clamp(min=0)) and y.stride() == (8, 1)
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
    assert x.shape == (4, 8) or reason == "shape"
    assert torch.equal(torch.relu(x), x.clamp(min=0))
    assert not launcher.calls
    assert v.counters.hits == 0 and v.counters.fallbacks == {reason: 1}


def test_device_type_is_part_of_the_guard(cpu):
    v, launcher = relu_variant(torch.randn(4, 8), device="cuda")
    cpu.add("pkg", [v])
    torch.relu(torch.randn(4, 8))
    assert not launcher.calls and v.counters.fallbacks == {"device": 1}


def test_scalar_arguments_are_part_of_the_guard(cpu):
    x = torch.randn(8, 8)
    launcher = FakeLauncher(softmax_kernel(1))
    v = Variant(make_card(aten._softmax.default, x, 1, False), 0, launcher)
    want1, want0 = F.softmax(x.double(), 1).float(), F.softmax(x.double(), 0).float()
    cpu.add("pkg", [v])
    torch.testing.assert_close(torch.softmax(x, 1), want1)
    torch.testing.assert_close(torch.softmax(x, 0), want0)
    assert len(launcher.calls) == 1
    assert v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 1}


def test_defaults_the_dispatcher_strips_still_hit(cpu):
    # The dispatcher hands Python kernels trailing defaults left out (negative_slope here).
    x = torch.randn(4, 8)
    launcher = FakeLauncher(lambda ins, outs: outs[0].copy_(torch.where(ins[0] > 0, ins[0], ins[0] * 0.01)))
    v = Variant(make_card(aten.leaky_relu.default, x), 0, launcher)
    cpu.add("pkg", [v])
    F.leaky_relu(x)
    F.leaky_relu(x, 0.2)
    assert v.counters.hits == 1 and v.counters.fallbacks == {"scalar": 1}


def test_value_keys_tell_apart_what_cards_tell_apart():
    assert len({_value_key(1), _value_key(1.0), _value_key(True)}) == 3
    assert _value_key(float("nan")) == _value_key(float("nan"))
    assert _value_key(0.0) != _value_key(-0.0) and _value_key([0.0]) != _value_key([-0.0])
    assert _value_key(torch.device("cuda", 1)) == _value_key(torch.device("cuda"))
    assert _value_key([1, 2]) == _value_key((1, 2)) != _value_key([2, 1])


def test_in_place_output_is_the_input_itself(cpu):
    x = torch.randn(4, 8)
    launcher = FakeLauncher(lambda ins, outs: outs[0].clamp_(min=0))
    v = Variant(make_card(aten.relu_.default, x, aliases={0: 0}), 0, launcher)
    cpu.add("pkg", [v])
    expected = x.clamp(min=0)
    y = x.relu_()
    assert y is x and torch.equal(x, expected) and v.counters.hits == 1
    assert launcher.calls[0][2][0] is x


def test_out_variant_writes_into_out(cpu):
    a, b, out = torch.randn(16), torch.randn(16), torch.empty(16)
    launcher = FakeLauncher(lambda ins, outs: outs[0].copy_(ins[0].sub(-ins[1])))  # not add: that would recurse
    v = Variant(make_card(aten.add.out, a, b, out=out, aliases={0: 2}), 0, launcher)
    cpu.add("pkg", [v])
    r = torch.add(a, b, out=out)
    assert r is out and torch.allclose(out, a + b) and v.counters.hits == 1


def test_multi_output_op_under_autograd_no_grad_and_inference_mode(cpu):
    x, w, b = torch.randn(6, 16), torch.randn(16), torch.randn(16)
    launcher = FakeLauncher(layer_norm_kernel)
    v = Variant(make_card(aten.native_layer_norm.default, x, [16], w, b, 1e-5), 0, launcher)
    cpu.add("pkg", [v])
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = F.layer_norm(xr, (16,), wr, br)
    y.square().sum().backward()
    assert v.counters.hits == 1
    cpu.remove("pkg")
    xe, we, be = (t.clone().requires_grad_() for t in (x, w, b))
    ye = F.layer_norm(xe, (16,), we, be)
    ye.square().sum().backward()
    torch.testing.assert_close(y, ye)
    # Backward reads the mean and rstd our kernel returned: their gradients agree only if those are right.
    for got, want in ((xr, xe), (wr, we), (br, be)):
        torch.testing.assert_close(got.grad, want.grad)
    cpu.add("pkg", [v])
    with torch.no_grad():
        torch.testing.assert_close(F.layer_norm(x, (16,), w, b), ye.detach())
    with torch.inference_mode():
        torch.testing.assert_close(F.layer_norm(x, (16,), w, b), ye.detach())
    assert v.counters.hits == 3


def test_missing_optional_tensor_is_no_variant(cpu):
    x, w, b = torch.randn(6, 16), torch.randn(16), torch.randn(16)
    v = Variant(make_card(aten.native_layer_norm.default, x, [16], w, b, 1e-5), 0, FakeLauncher(layer_norm_kernel))
    cpu.add("pkg", [v])
    F.layer_norm(x, (16,), w, None)
    assert v.counters.fallbacks == {"no-variant": 1}


def test_workspaces_are_allocated_per_call(cpu):
    x = torch.randn(4, 8)
    launcher = FakeLauncher(relu_kernel)
    v = Variant(make_card(aten.relu.default, x), 0, launcher, workspace=(64, 4))
    cpu.add("pkg", [v])
    torch.relu(x)
    ws = launcher.calls[0][3]
    assert [t.numel() for t in ws] == [64, 4] and all(t.dtype == torch.uint8 for t in ws)


def test_uninstall_restores_the_dispatch_table_exactly(cpu):
    before = torch._C._dispatch_dump("aten::relu")
    v, launcher = relu_variant(torch.randn(4, 8))
    cpu.add("pkg", [v])
    assert torch._C._dispatch_dump("aten::relu") != before and cpu.ops == ["aten::relu.default"]
    cpu.remove("pkg")
    assert torch._C._dispatch_dump("aten::relu") == before and not cpu.ops
    torch.relu(torch.randn(4, 8))
    assert not launcher.calls and v.counters.hits == 0


def test_two_packages_share_one_override_and_come_off_in_any_order(cpu):
    before = {op: torch._C._dispatch_dump(op) for op in ("aten::relu", "aten::_softmax")}
    x, z = torch.randn(4, 8), torch.randn(2, 3)
    a = FakeLauncher(relu_kernel)
    b = FakeLauncher(relu_kernel, softmax_kernel(-1))
    va = Variant(make_card(aten.relu.default, x), 0, a)
    vb = [Variant(make_card(aten.relu.default, z), 0, b), Variant(make_card(aten._softmax.default, z, -1, False), 1, b)]
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
    first, second = FakeLauncher(relu_kernel), FakeLauncher(relu_kernel)
    card = make_card(aten.relu.default, x)
    cpu.add("first", [Variant(card, 0, first)])
    cpu.add("second", [Variant(card, 0, second)])
    torch.relu(x)
    cpu.remove("second")
    torch.relu(x)
    assert len(first.calls) == 1 and len(second.calls) == 1


def test_several_variants_of_one_op_and_nearest_variant_takes_the_miss(cpu):
    x, y = torch.randn(4, 8), torch.randn(16, 8)
    launcher = FakeLauncher(relu_kernel, relu_kernel)
    v1 = Variant(make_card(aten.relu.default, x), 0, launcher)
    v2 = Variant(make_card(aten.relu.default, y), 1, launcher)
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


def test_cards_that_cannot_be_dispatched_say_why():
    card = make_card(aten.split.Tensor, torch.randn(8), 4)
    assert "does not return plain tensors" in dispatch_blocker(card)
    with pytest.raises(DispatchError, match="split"):
        Variant(card, 0, FakeLauncher())
    gone = make_card(aten.relu.default, torch.randn(3))
    gone.op = "aten::no_such_op.default"
    assert "does not exist" in dispatch_blocker(gone)


def test_differences_are_listed_most_fundamental_first():
    a = ((4, 8), (8, 1), torch.float32, "cpu", 16)
    assert differences((a,), (a,), ("tensor",)) == []
    assert differences((((5, 8), (8, 1), torch.float16, "cpu", 4),), (a,), ("tensor",)) == ["dtype", "shape", "alignment"]
    assert differences((((4, 8), (1, 4), torch.float32, "cpu", 16),), (a,), ("tensor",)) == ["stride"]
    assert differences((a, ("i", 0)), (a, ("i", 1)), ("tensor", "value")) == ["scalar"]
    assert differences(((a,),), ((a, a),), ("tensors",)) == ["no-variant"]
    assert differences((None,), (a,), ("tensor",)) == ["no-variant"]


def test_installed_times_one_kernel_as_dispatched_and_restores():
    before = torch._C._dispatch_dump("aten::relu")
    x = torch.randn(4, 8)
    card, launcher = make_card(aten.relu.default, x), FakeLauncher(relu_kernel)
    with installed(card, launcher, key="CPU") as variant:
        card.call_eager([x])
    card.call_eager([x])
    assert variant.counters.hits == 1 and len(launcher.calls) == 1
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
    """`x + 1e-6` reaches a Python kernel with a float where add.Tensor says Tensor; the
    fallback must still compute what eager does, with eager's result dtype."""
    want = x + scalar
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    card = make_card(aten.add.Tensor, y, y.clone())
    v = Variant(card, 0, FakeLauncher(lambda ins, outs: outs[0].copy_(ins[0] + ins[1])))
    cpu.add("pkg", [v])
    got = x + scalar
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert v.counters.hits == 0 and sum(v.counters.fallbacks.values()) >= 1


def test_python_scalar_falls_back_like_eager_in_place_and_with_out(cpu):
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    cpu.add("pkg", [Variant(make_card(aten.add_.Tensor, y.clone(), y, aliases={0: 0}), 0, FakeLauncher()),
                    Variant(make_card(aten.add.out, y, y, out=y.clone(), aliases={0: 2}), 0, FakeLauncher())])
    x = torch.tensor([1.0, 3.0], dtype=torch.float64)
    assert torch.equal(x.clone().add_(0.1), torch.tensor([1.0 + 0.1, 3.0 + 0.1], dtype=torch.float64))
    # out= does not take part in type promotion: int32 + 0.1 computes in float32, then casts.
    out = torch.empty(2, dtype=torch.float64)
    torch.add(torch.tensor([1, 3], dtype=torch.int32), 0.1, out=out)
    assert torch.equal(out, torch.tensor([1, 3], dtype=torch.float32).add(0.1).double())


def test_conjugate_and_negative_views_never_hit(cpu):
    # copy_ and clone take these views unresolved: a kernel for the plain layout would drop the bit.
    x, z = torch.randn(4, 8), torch.randn(4, 8, dtype=torch.complex64)
    launcher = FakeLauncher(lambda ins, outs: None, lambda ins, outs: None)
    real = Variant(make_card(aten.copy_.default, torch.empty(4, 8), x, aliases={0: 0}), 0, launcher)
    cplx = Variant(make_card(aten.copy_.default, torch.empty_like(z), z, aliases={0: 0}), 1, launcher)
    cpu.add("pkg", [real, cplx])
    y, w = torch.empty(4, 8), torch.empty_like(z)
    y.copy_(x._neg_view())
    w.copy_(z.conj())
    assert real.counters.fallbacks == {"no-variant": 1} and cplx.counters.fallbacks == {"no-variant": 1}
    assert not launcher.calls and torch.equal(y, -x) and torch.equal(w, z.conj())
    y.copy_(x)
    assert real.counters.hits == 1


def test_python_path_out_argument_that_is_also_an_input_falls_back(monkeypatch):
    monkeypatch.setenv("KFORGE_DISPATCH", "python")
    a, b, out = torch.randn(16), torch.randn(16), torch.empty(16)
    card = make_card(torch.ops.aten.add.out, a, b, out=out, aliases={0: 2})
    v = Variant(card, 0, FakeLauncher(lambda ins, outs: outs[0].copy_(ins[0] + ins[1])))
    d = Dispatcher("CPU")
    d.add("pkg", [v])
    try:
        expected = a + b
        assert torch.add(a, b, out=a) is a and torch.equal(a, expected)
        assert v.counters.hits == 0 and v.counters.fallbacks == {"aliasing": 1}
        torch.add(b, b.clone(), out=out)
        assert v.counters.hits == 1
    finally:
        d.remove("pkg")


def test_cards_with_inputs_on_two_device_types_are_not_dispatched():
    import dataclasses

    card = make_card(torch.ops.aten.mul.Tensor, torch.randn(4), torch.tensor(2.0))
    card.args[1] = dataclasses.replace(card.args[1], tensor=dataclasses.replace(card.args[1].tensor, device="cuda"))
    assert "more than one device type" in dispatch_blocker(card)


def test_python_path_a_launch_refused_before_it_ran_falls_back_to_eager(monkeypatch):
    from kforge.errors import LaunchError, LaunchRefused

    monkeypatch.setenv("KFORGE_DISPATCH", "python")

    def refused(ins, outs):
        raise LaunchRefused("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: too large (refused before any kernel ran)",
                            "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 720)

    def failed(ins, outs):
        raise LaunchError("CUDA_ERROR_ILLEGAL_ADDRESS: boom", "CUDA_ERROR_ILLEGAL_ADDRESS")

    x = torch.randn(4, 8)
    d = Dispatcher("CPU")
    v = Variant(make_card(torch.ops.aten.relu.default, x), 0, FakeLauncher(refused))
    d.add("pkg", [v])
    try:
        assert torch.equal(torch.relu(x), x.clamp(min=0))
        assert v.counters.hits == 0 and v.counters.fallbacks == {"refused": 1}
    finally:
        d.remove("pkg")
    w = Variant(make_card(torch.ops.aten.relu.default, x), 0, FakeLauncher(failed))
    d.add("pkg2", [w])
    try:
        with pytest.raises(LaunchError, match="ILLEGAL_ADDRESS"):  # a kernel that ran and failed is not hidden
            torch.relu(x)
    finally:
        d.remove("pkg2")


@pytest.mark.parametrize("path", ["python", "native"])
def test_kernels_that_cannot_be_loaded_on_a_device_leave_it_to_pytorch(monkeypatch, path):
    """A registry whose kernels cannot be prepared where the call runs (here: no CUDA at all)
    warns once and falls back, on either dispatch path, instead of failing the model."""
    from kforge.dispatch import RegistryLauncher, native_status

    if path == "native" and not native_status("CPU")[0]:
        pytest.skip("kforge._dispatch is not built")
    monkeypatch.setenv("KFORGE_DISPATCH", path)
    x = torch.randn(4, 8)
    v = Variant(make_card(torch.ops.aten.relu.default, x), 0, RegistryLauncher([(None, b"")]))
    d = Dispatcher("CPU")
    d.add("pkg", [v])
    try:
        assert d.path("aten::relu.default")[0] == path
        with pytest.warns(UserWarning, match="could not prepare"):
            assert torch.equal(torch.relu(x), x.clamp(min=0))
        assert torch.equal(torch.relu(x), x.clamp(min=0))
        assert v.counters.hits == 0 and v.counters.fallbacks == {"device": 2}
    finally:
        d.remove("pkg")


def to_copy_card(x: torch.Tensor, device: torch.device) -> Card:
    """_to_copy(x, dtype=x.dtype, device=device) as recorded (make_card's own `device`
    keyword is the recorded tensors' device type, so the argument is set afterwards)."""
    card = make_card(torch.ops.aten._to_copy.default, x, dtype=x.dtype)
    args = [dataclasses.replace(a, value=encode_value(device)) if a.name == "device" else a for a in card.args]
    return dataclasses.replace(card, args=args, id="")


def test_a_device_argument_naming_another_device_index_falls_back(cpu):
    """Cards hold device types: x.to("cuda:1") of a cuda:0 tensor matches a card recorded
    from x.to("cuda:0"), and a kernel would write it on the wrong device. Eager serves it."""
    x = torch.randn(4, 8)
    launcher = FakeLauncher(lambda ins, outs: outs[0].copy_(ins[0]))
    v = Variant(to_copy_card(x, torch.device("cpu")), 0, launcher)
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
    launcher = FakeLauncher(cast_softmax_kernel)
    v = Variant(make_card(aten.softmax.int, x, -1, torch.float32), 0, launcher)
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
    # transforms and forward-mode duals; only the decomposition handles those.
    import torch.autograd.forward_ad as fwAD
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    want = torch.softmax(x.float(), -1)
    launcher = FakeLauncher(cast_softmax_kernel)
    v = Variant(make_card(aten.softmax.int, x, -1, torch.float32), 0, launcher)
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
