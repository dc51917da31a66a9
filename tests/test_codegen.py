"""The code generator on the CPU: every op torch tags pointwise is generated from the op
table (compiled by NVRTC for sm_90) or declined with a reason; the table's expressions and
the reduction kinds match eager on edge values through the reference interpreter (which
evaluates the same trees lower.py emits); reductions compile across their knob space for
a spread of shapes, dims, dtypes and layouts, and so do scans and pooling; the generated C itself runs
on the CPU (g++) like eager; the region builder takes a chain of nodes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from builtin_cards import A, BF16, F16, make_card, meta
from codegen_cards import EDGES, card_for, pointwise_overloads
from kforge import compiler
from kforge.cards import TensorMeta
from kforge.codegen import build, card_program, entries, interp, ops
from kforge.codegen.ir import Expr, Node, Ref, broadcast_strides
from kforge.hardware import H200
from kforge.proposers.builtin import BuiltinProposer, generated
from kforge.proposers.builtin import space as knob_space

TAGGED = pointwise_overloads()


def test_every_tagged_pointwise_op_is_in_the_table_or_declined_and_the_declined_list_is_printed(capsys):
    missing = [n for n in TAGGED if entries.table_key(f"aten::{n}.default")[0] not in {**ops.POINTWISE, **ops.DECLINED}]
    assert not missing, f"tagged pointwise but neither in ops.POINTWISE nor ops.DECLINED: {missing}"
    with capsys.disabled():
        print(f"\n{len(ops.DECLINED)} pointwise ops declined by the code generator:")
        for name, why in sorted(ops.DECLINED.items()):
            print(f"  {name}: {why}")
    # Declining grows only with a reason here: the count is pinned.
    assert len(ops.DECLINED) == 37


def _generated_card(op):
    """The first dtype (float32, int64, bool) whose card the generator takes, or (None, why)."""
    why = "no card could be built"
    for dt in (torch.float32, torch.int64, torch.bool):
        card = card_for(op, dt)
        if card is None:
            continue
        prog = card_program.program_for_card(card)
        if not isinstance(prog, str):
            return card, None
        why = prog
    return None, why


@pytest.mark.parametrize("name", sorted(TAGGED))
def test_tagged_pointwise_op_compiles_from_the_table(name):
    key = entries.table_key(f"aten::{name}.default")[0]
    for op in TAGGED[name]:
        card, why = _generated_card(op)
        if key in ops.DECLINED:
            assert card is None, f"{op} is listed as declined but the generator takes it"
            continue
        assert card is not None, f"{op}: {why}"
        assert BuiltinProposer().supports(card) == (True, "")
        cand = generated.build(card, generated.default(card, H200), H200)
        cand.plan.validate(len(card.inputs), len(card.outputs))
        assert compiler.compile(cand.source, arch="sm_90").cubin


def _untagged_table_overloads():
    """Overloads of op-table names whose packet torch tags pointwise nowhere (in-place forms)."""
    out = []
    for name in sorted(ops.POINTWISE):
        for packet in (getattr(torch.ops.aten, n, None) for n in (name, name + "_")):
            if packet is None or name in ("copy", "_to_copy"):
                continue
            ovs = [getattr(packet, o) for o in packet.overloads()]
            if not any(torch.Tag.pointwise in ov.tags for ov in ovs):
                out += [ov for ov in ovs if card_for(ov) is not None and any(str(r.type) == "Tensor"
                                                                              for r in ov._schema.returns)]
    return out


def _generated_matches_eager(op, same_dtype: bool) -> None:
    """A card of `op` (fp32, else int64: bitwise ops and shifts take integers) comes from the
    table, its program matches eager through the interpreter, and its kernel compiles for sm_90."""
    from kforge.cards import flatten_outputs

    for dt in (torch.float32, torch.int64):
        card = card_for(op, dt)
        prog = None if card is None else card_program.program_for_card(card)
        if card is not None and not isinstance(prog, str):
            break
    assert not isinstance(prog, str), prog
    inputs = card.random_inputs(0, "cpu")
    want = flatten_outputs(card.call_eager([t.clone() for t in inputs], "cpu"))
    got = interp.run(prog, [t.clone() for t in inputs])
    for g, w in zip(got, want):
        if same_dtype:
            assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert compiler.compile(generated.build(card, generated.default(card, H200), H200).source, arch="sm_90").cubin


@pytest.mark.parametrize("op", _untagged_table_overloads(), ids=str)
def test_an_op_torch_tags_nowhere_comes_from_the_table_and_matches_eager(op):
    """gelu_, relu6_, hardswish, eq_ ... carry no pointwise tag in any overload: the table
    decides (as for leaky_relu and hardtanh_ on torch 2.11), and the result matches eager."""
    _generated_matches_eager(op, same_dtype=True)


def _untagged_out_forms():
    """.out overloads torch leaves untagged while tagging their packet's default pointwise
    (hardtanh.out, elu.out, relu.out, ...): listed from the tags, not by hand."""
    from kforge.families import out_form_of_pointwise

    out = []
    for name in sorted(ops.POINTWISE):
        packet = getattr(torch.ops.aten, name, None)
        for o in packet.overloads() if packet is not None else ():
            ov = getattr(packet, o)
            if torch.Tag.pointwise not in ov.tags and out_form_of_pointwise(ov) and card_for(ov) is not None:
                out.append(ov)
    return out


@pytest.mark.parametrize("op", _untagged_out_forms(), ids=str)
def test_the_out_form_of_a_tagged_pointwise_op_is_generated_and_matches_eager(op):
    _generated_matches_eager(op, same_dtype=False)


def test_untagged_out_forms_include_hardtanh_and_exclude_other_signatures():
    names = {str(op) for op in _untagged_out_forms()}
    assert {"aten.hardtanh.out", "aten.elu.out", "aten.relu.out"} <= names
    from kforge.families import out_form_of_pointwise

    assert out_form_of_pointwise(torch.ops.aten.clip.Tensor_out)  # of clip.Tensor, not of clip.default
    assert not out_form_of_pointwise(torch.ops.aten.mm.out) and not out_form_of_pointwise(torch.ops.aten.hardtanh.default)


def test_torch_211s_untagged_leaky_relu_and_hardtanh_inplace_are_generated(monkeypatch):
    """torch 2.11 tags neither leaky_relu nor hardtanh_ pointwise in any overload (2.13 does):
    with their tags taken away, the generator still takes both from the table, and their cards
    are pointwise (a region may hold them)."""
    from kforge import families

    class Untagged:  # an overload as torch 2.11 has it: no overload of its packet is tagged pointwise
        def __init__(self, ov):
            self.tags, self.overloadpacket, self.default, self._schema = [], self, self, ov._schema

        def overloads(self):
            return ["default"]

    assert entries.entry_for("aten::where.default")[0] is None  # tagged in where.self: the tag decides
    real_entries, real_families = entries.overload_of, families._resolve
    monkeypatch.setattr(entries, "overload_of", lambda op: Untagged(real_entries(op)))
    monkeypatch.setattr(families, "_resolve", lambda op: Untagged(real_families(op)))
    for op in ("aten::leaky_relu.default", "aten::hardtanh_.default"):
        assert entries.entry_for(op)[0] == "pointwise", entries.entry_for(op)
        assert families.family_of(op) == "pointwise"
    assert families.family_of("aten::cumsum.default") == "other"  # not in the table: no tag, no pointwise


# ---- numerics against eager through the interpreter ------------------------------------

def _gpu_card(op, tensors, *scalars, **kw):
    """A (CUDA) card of op on meta tensors with these tensors' shapes, strides and dtypes."""
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor)
             else t for t in tensors]
    return make_card(op, *metas, *scalars, **kw)


def _run(op, tensors, *scalars, **kw):
    """(interpreter's outputs, eager's) for op on CPU tensors."""
    card = _gpu_card(op, tensors, *scalars, **kw)
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    got = interp.run(prog, [t for t in tensors if isinstance(t, torch.Tensor)])
    want = op(*tensors, *scalars, **kw)
    return got, [want] if isinstance(want, torch.Tensor) else list(want)


X1 = torch.tensor(EDGES)
_XG, _YG = torch.meshgrid(X1, X1, indexing="ij")
X2, Y2 = _XG.contiguous(), _YG.contiguous()
# Eager's CPU fmod (vectorized) gives NaN for denormal or huge operands, its CUDA fmodf does
# not: fmod and remainder are checked on the rest here, on every edge value on the GPU.
_MODEST = torch.tensor([v for v in EDGES if v == 0 or 1e-30 < abs(v) < 1e30])
_XM, _YM = torch.meshgrid(_MODEST, _MODEST, indexing="ij")
XM, YM = _XM.contiguous(), _YM.contiguous()

EDGE_CASES = {
    "gelu_erf": (A.gelu.default, [X1], (), {}),
    "i0": (A.i0.default, [X1], (), {}),  # inf past exp's overflow, NaN at ±inf, as eager
    "special_i1": (A.special_i1.default, [X1], (), {}),
    "gelu_tanh": (A.gelu.default, [X1], (), {"approximate": "tanh"}),
    "softplus": (A.softplus.default, [X1], (), {}),
    "softplus_beta2_threshold5": (A.softplus.default, [X1], (2.0, 5.0), {}),
    "elu": (A.elu.default, [X1], (), {}),
    "elu_alpha_scale": (A.elu.default, [X1], (0.3, 1.7, 0.8), {}),
    "selu": (A.selu.default, [X1], (), {}),
    "celu": (A.celu.default, [X1], (0.7,), {}),
    "silu": (A.silu.default, [X1], (), {}),
    "mish": (A.mish.default, [X1], (), {}),
    "sigmoid": (A.sigmoid.default, [X1], (), {}),
    "hardsigmoid": (A.hardsigmoid.default, [X1], (), {}),
    "hardtanh": (A.hardtanh.default, [X1], (-0.5, 2.0), {}),
    "leaky_relu": (A.leaky_relu.default, [X1], (0.2,), {}),
    "softshrink": (A.softshrink.default, [X1], (), {}),
    "hardshrink": (A.hardshrink.default, [X1], (), {}),
    "threshold": (A.threshold.default, [X1], (0.5, -2.0), {}),
    "clamp": (A.clamp.default, [X1], (-1.0, 0.5), {}),
    "nan_to_num": (A.nan_to_num.default, [X1], (), {}),
    "sign": (A.sign.default, [X1], (), {}),
    "pow_tensor": (A.pow.Tensor_Tensor, [X2, Y2], (), {}),
    "pow_2": (A.pow.Tensor_Scalar, [X1], (2,), {}),
    "pow_half": (A.pow.Tensor_Scalar, [X1], (0.5,), {}),
    "pow_minus_half": (A.pow.Tensor_Scalar, [X1], (-0.5,), {}),
    "pow_3_3": (A.pow.Tensor_Scalar, [X1], (3.3,), {}),
    "div_floor": (A.div.Tensor_mode, [X2, Y2], (), {"rounding_mode": "floor"}),
    "div_trunc": (A.div.Tensor_mode, [X2, Y2], (), {"rounding_mode": "trunc"}),
    "div_scalar": (A.div.Scalar, [X1], (3.0,), {}),
    "remainder": (A.remainder.Tensor, [XM, YM], (), {}),
    "fmod": (A.fmod.Tensor, [XM, YM], (), {}),
    "round": (A.round.default, [X1 * 3.7], (), {}),
    "round_decimals": (A.round.decimals, [X1 * 3.7], (), {"decimals": 2}),
    "round_negative_decimals": (A.round.decimals, [X1 * 370], (), {"decimals": -1}),
    "logaddexp": (A.logaddexp.default, [X2, Y2], (), {}),
    "logaddexp2": (A.logaddexp2.default, [X2, Y2], (), {}),
    "xlogy": (A.xlogy.Tensor, [X2, Y2], (), {}),
    "xlog1py": (A.special_xlog1py.default, [X2, Y2], (), {}),
    "maximum": (A.maximum.default, [X2, Y2], (), {}),
    "atan2": (A.atan2.default, [X2, Y2], (), {}),
    "hypot": (A.hypot.default, [X2, Y2], (), {}),
    "copysign": (A.copysign.Tensor, [X2, Y2], (), {}),
    "heaviside": (A.heaviside.default, [X2, Y2], (), {}),
    "lerp": (A.lerp.Scalar, [X2, Y2], (0.3,), {}),
    "add_alpha": (A.add.Tensor, [X2, Y2], (), {"alpha": 0.5}),
    "logit": (A.logit.default, [X1], (), {}),
    "logit_eps": (A.logit.default, [X1], (1e-3,), {}),
    "sinc": (A.sinc.default, [X1], (), {}),
    "frac": (A.frac.default, [X1], (), {}),
    "angle": (A.angle.default, [X1], (), {}),
    "entr": (A.special_entr.default, [X1], (), {}),
    "gelu_backward": (A.gelu_backward.default, [X2, Y2], (), {}),
    "gelu_backward_tanh": (A.gelu_backward.default, [X2, Y2], (), {"approximate": "tanh"}),
    "silu_backward": (A.silu_backward.default, [X2, Y2], (), {}),
    "sigmoid_backward": (A.sigmoid_backward.default, [X2, Y2], (), {}),
}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
       torch.float16: dict(rtol=2e-3, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, BF16, F16], ids=str)
@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_expression_matches_eager_on_edge_values(name, dtype):
    """0, -0, ±1, denormals, thresholds, large magnitudes, ±inf and NaN (rounded to the
    dtype first); fp16/bf16 computed in fp32 and rounded once, as eager does."""
    op, tensors, scalars, kw = EDGE_CASES[name]
    if name == "logit_eps" and dtype != torch.float32:
        pytest.skip("eager's CPU logit rounds eps to the 16-bit dtype; its CUDA kernel (which the table follows) keeps fp32")
    if name in ("pow_half", "pow_minus_half") and dtype == F16:
        pytest.skip("eager's CPU fp16 pow skips the sqrt/rsqrt shortcut of its CUDA kernel (pow(-inf, 0.5) = inf)")
    got, want = _run(op, [t.to(dtype) for t in tensors], *scalars, **kw)
    if name in SCALAR_EAGER:
        want = [_eager_per_element(op, t.to(dtype)) for t in tensors]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, equal_nan=True, **TOL.get(w.dtype, dict(rtol=0, atol=0)))


# Eager's CPU kernel for these gives another answer at ±inf in its vectorized loop than in its
# scalar tail (gelu: NaN against inf for +inf, by where the element falls and the CPU's vector
# width). Eager's CUDA kernel computes element by element, as the scalar tail does, and the
# generated code follows CUDA: compare with eager one element at a time.
SCALAR_EAGER = {"gelu_erf"}


def _eager_per_element(op, x):
    return torch.stack([op(v.reshape(1))[0] for v in x.reshape(-1)]).reshape(x.shape)


def test_round_decimals_on_16_bit_floats_rounds_as_eagers_cuda_kernel():
    """Eager's CUDA round(decimals=d) computes in the tensor's dtype: 0.3496 (bf16) * 10 is 3.5 in
    bf16, and rint(3.5) = 4, so 0.4, where fp32 arithmetic gives 0.3 (as eager's CPU kernel does,
    so this is checked against that formula, not against CPU eager)."""
    x = torch.tensor([0.35, 0.45, 1.25, -0.35], dtype=BF16)
    card = _gpu_card(A.round.decimals, [x], decimals=1)
    (got,) = interp.run(card_program.program_for_card(card), [x])
    ten = torch.tensor(10.0, dtype=BF16)
    want = (torch.round((x * ten).float()).to(BF16).float() / ten.float()).to(BF16)  # each step rounded to bf16
    assert torch.equal(got, want) and got[0].item() == pytest.approx(0.4, abs=1e-2)


def test_long_float_lines_are_scanned_by_a_block_only():
    """A thread summing 131072 fp32 values in sequence was 0.008 off eager's tree scan on the H200."""
    long_f32 = make_card(A.cumsum.default, meta(8, 1 << 17), 1)
    assert [s["algo"] for s in generated.spaces(long_f32, H200)] == [("gen_scan_block",)]
    short_f32, long_int = make_card(A.cumsum.default, meta(8, 4096), 1), make_card(
        A.cumsum.default, meta(8, 1 << 17, dtype=torch.int32), 1)
    for card in (short_f32, long_int):  # short lines, and integer sums (exact in any order), keep both forms
        assert [s["algo"] for s in generated.spaces(card, H200)] == [("gen_scan",), ("gen_scan_block",)]


INTS = torch.tensor([-7, -3, -1, 0, 1, 2, 5, 100, 2**31 - 1, -2**31])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8], ids=str)
@pytest.mark.parametrize("op, kw", [
    (A.div.Tensor_mode, {"rounding_mode": "floor"}), (A.div.Tensor_mode, {"rounding_mode": "trunc"}),
    (A.div.Tensor, {}), (A.remainder.Tensor, {}), (A.fmod.Tensor, {}), (A.mul.Tensor, {}), (A.add.Tensor, {}),
    (A.bitwise_xor.Tensor, {}), (A.maximum.default, {}), (A.eq.Tensor, {}),
], ids=lambda x: str(x) if not isinstance(x, dict) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_integer_arithmetic_matches_eager(op, kw, dtype):
    """Integer division rounds toward zero or -inf as asked, true division promotes to
    float, arithmetic wraps in the dtype."""
    v = INTS.to(dtype)
    # Divisors leave out 0 and -1 (INT_MIN / -1 traps on the CPU; CUDA has no such trap).
    x, y = torch.meshgrid(v, v[(v != 0) & (v != -1)], indexing="ij")
    got, want = _run(op, [x.contiguous(), y.contiguous()], **kw)
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("op", [A.bitwise_left_shift.Tensor, A.bitwise_right_shift.Tensor])
def test_shifts_past_the_width_match_eager(op):
    a, b = torch.meshgrid(torch.tensor([-5, 1, 7, -128], dtype=torch.int32), torch.arange(-3, 70, dtype=torch.int32),
                          indexing="ij")
    got, want = _run(op, [a.contiguous(), b.contiguous()])
    assert torch.equal(got[0], want[0])


def test_bool_ops_and_comparisons_match_eager():
    a, b = torch.meshgrid(torch.tensor([True, False]), torch.tensor([True, False]), indexing="ij")
    for op in (A.logical_xor.default, A.bitwise_and.Tensor, A.add.Tensor, A.mul.Tensor, A.logical_not.default):
        args = [a.contiguous()] if op == A.logical_not.default else [a.contiguous(), b.contiguous()]
        got, want = _run(op, args)
        assert torch.equal(got[0], want[0]), op
    got, want = _run(A.lt.Tensor, [X2.to(BF16), Y2])
    assert torch.equal(got[0], want[0])


def test_mixed_dtypes_promote_like_eager():
    # bf16 * fp32 0-dim CUDA tensor: eager's CUDA kernel rounds the 0-dim operand to bf16 first
    # (a CPU 0-dim tensor would be a scalar kept in fp32, so this is checked on the tree).
    prog = card_program.program_for_card(make_card(A.mul.Tensor, meta(6, 4, dtype=BF16), meta()))
    assert any(e.op == "cast" and e.value == ("round", "bfloat16") and e.args[0].op == "load"
               for e in prog.results[0].walk())
    i = torch.arange(-5, 5, dtype=torch.int32)
    got, want = _run(A.add.Tensor, [i, torch.randn(10)])
    assert torch.equal(got[0], want[0])


# ---- reductions --------------------------------------------------------------------------

def _red_cases():
    x4 = torch.randn(3, 5, 4, 7)
    cl = x4.to(memory_format=torch.channels_last)
    t = torch.randn(9, 13).t()
    h = torch.randn(6, 1000).to(BF16)
    return {
        "sum_inner": (A.sum.dim_IntList, [x4], ([-1],), {}),
        "sum_middle_keepdim": (A.sum.dim_IntList, [x4], ([1, 2], True), {}),
        "sum_all": (A.sum.default, [x4], (), {}),
        "sum_channels_last_hw": (A.sum.dim_IntList, [cl], ([2, 3],), {}),
        "sum_transposed": (A.sum.dim_IntList, [t], ([0],), {}),
        "sum_bf16_to_f32": (A.sum.dim_IntList, [h], ([1],), {"dtype": torch.float32}),
        "sum_int": (A.sum.dim_IntList, [torch.randint(-50, 50, (4, 9), dtype=torch.int32)], ([1],), {}),
        "sum_bool": (A.sum.dim_IntList, [torch.rand(4, 9) > 0.5], ([0],), {}),
        "mean_bf16": (A.mean.dim, [h], ([-1],), {}),
        "mean_one_element_rows": (A.mean.dim, [torch.randn(7, 1)], ([1],), {}),
        "prod": (A.prod.dim_int, [torch.rand(5, 6) + 0.5], (1,), {}),
        "amax_edges": (A.amax.default, [X2], ([1],), {}),
        "amin_f16": (A.amin.default, [X2.to(F16)], ([0],), {}),
        "max_dim_edges": (A.max.dim, [X2], (1,), {}),
        "min_dim_keepdim": (A.min.dim, [x4], (2, True), {}),
        "argmax_ties": (A.argmax.default, [torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])], (1,), {}),
        "argmax_flat": (A.argmax.default, [cl], (), {}),
        "argmin_transposed": (A.argmin.default, [t], (0,), {}),
        "argmax_nan": (A.argmax.default, [X2], (1,), {}),
        "var": (A.var.correction, [x4], ([1, 3],), {}),
        "std_unbiased_false": (A.std.correction, [x4], ([-1],), {"correction": 0}),
        "var_one_element": (A.var.correction, [torch.randn(4, 1)], ([1],), {}),
        "var_mean": (A.var_mean.correction, [h], ([1],), {}),
        "std_mean_keepdim": (A.std_mean.correction, [x4], ([0, 2],), {"keepdim": True}),
        "any": (A.any.dim, [torch.rand(6, 7) > 0.8], (1,), {}),
        "all_float": (A.all.dim, [torch.randn(6, 7).round()], (0,), {}),
        "logsumexp": (A.logsumexp.default, [x4], ([-1],), {}),
        "logsumexp_edges": (A.logsumexp.default, [X2], ([1],), {}),
        "norm2": (A.linalg_vector_norm.default, [x4], (2.0, [1, 2]), {}),
        "norm1": (A.linalg_vector_norm.default, [x4], (1.0, [-1]), {}),
        "norm_inf": (A.linalg_vector_norm.default, [x4], (float("inf"), [-1]), {}),
        "norm_3": (A.linalg_vector_norm.default, [x4.abs() + 0.1], (3.0, [-1]), {}),
        # losses with their edges: |d| below, at and above beta/delta, a NaN, a beta of 0
        "mse_loss": (A.mse_loss.default, [x4, x4.flip(0)], (), {}),
        "mse_loss_sum_bf16": (A.mse_loss.default, [h, h.flip(0)], (2,), {}),
        "smooth_l1_edges": (A.smooth_l1_loss.default, [X2, torch.zeros_like(X2)], (1, 0.5), {}),
        "smooth_l1_beta_0_sum": (A.smooth_l1_loss.default, [x4, x4.flip(1)], (2, 0.0), {}),
        "huber_delta": (A.huber_loss.default, [torch.tensor([[-2.0, -0.5, 0.0, 0.5, 1.5, 2.0]]),
                                               torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])], (1, 1.5), {}),
        "cumsum_inner": (A.cumsum.default, [x4], (-1,), {}),
        "cumsum_channels_last": (A.cumsum.default, [cl], (1,), {}),
        "cumsum_transposed_bf16": (A.cumsum.default, [t.to(BF16)], (0,), {}),
        "cumsum_int_to_int64": (A.cumsum.default, [torch.randint(-9, 9, (5, 30), dtype=torch.int32)], (1,), {}),
        "cumsum_bool": (A.cumsum.default, [torch.rand(5, 30) > 0.5], (1,), {}),
        "cumsum_dtype": (A.cumsum.default, [h], (1,), {"dtype": torch.float32}),
        "cumprod": (A.cumprod.default, [torch.rand(4, 20) + 0.5], (1,), {}),
        "max_pool_indices_pad": (A.max_pool2d_with_indices.default, [torch.randn(2, 3, 11, 9)], ([3, 3], [2, 2], [1, 1]), {}),
        # eager's pooling takes a point where it is greater or NaN: the last NaN's index, ties to the first,
        # the first point of a window all -inf
        "max_pool_nans_ties_and_neg_inf": (A.max_pool2d_with_indices.default, [_pool_edges()], ([2, 3], [2, 3]), {}),
        "max_pool_dilated_ceil": (A.max_pool2d_with_indices.default, [torch.randn(1, 2, 10, 10)],
                                  ([3, 3], [1, 1], [1, 1], [2, 2], True), {}),
        "max_pool_channels_last_bf16": (A.max_pool2d.default, [torch.randn(2, 4, 8, 8).to(BF16).to(
            memory_format=torch.channels_last)], ([2, 2],), {}),
        "avg_pool_pad": (A.avg_pool2d.default, [torch.randn(2, 3, 11, 9)], ([3, 3], [2, 2], [1, 1]), {}),
        "avg_pool_no_pad_count_ceil": (A.avg_pool2d.default, [torch.randn(3, 11, 9)], ([3, 2], [2, 1], [1, 1], True, False),
                                       {}),
        "avg_pool_divisor": (A.avg_pool2d.default, [torch.randn(2, 3, 11, 9)], ([3, 3], [2, 2], [1, 0], True, True, 5), {}),
        # 1-D pooling reaches CUDA as the 2-D op over a height of 1 (max_pool1d_with_indices unsqueezes)
        "max_pool1d_as_cuda_sees_it": (A.max_pool2d_with_indices.default, [torch.randn(2, 3, 1, 50)],
                                       ([1, 8], [1, 1], [0, 4], [1, 3]), {}),
        "avg_pool1d_as_cuda_sees_it": (A.avg_pool2d.default, [torch.randn(2, 3, 1, 40)], ([1, 4], [1, 2], [0, 1]), {}),
        "max_pool3d_indices_pad": (A.max_pool3d_with_indices.default, [torch.randn(2, 3, 6, 7, 8)],
                                   ([3, 3, 3], [2, 2, 2], [1, 1, 1]), {}),
        "max_pool3d_dilated_ceil": (A.max_pool3d_with_indices.default, [torch.randn(1, 2, 7, 8, 9)],
                                    ([3, 2, 3], [1, 2, 2], [1, 0, 1], [2, 1, 1], True), {}),
        "max_pool3d_channels_last": (A.max_pool3d_with_indices.default, [torch.randn(2, 4, 5, 6, 7).to(
            memory_format=torch.channels_last_3d)], ([2, 2, 2],), {}),
        "avg_pool3d_exclude_pad_ceil": (A.avg_pool3d.default, [torch.randn(2, 3, 6, 7, 8)],
                                        ([3, 3, 3], [2, 2, 2], [1, 1, 1], True, False), {}),
        "avg_pool3d_divisor_4d": (A.avg_pool3d.default, [torch.randn(3, 6, 7, 8)],
                                  ([2, 3, 3], [2, 1, 2], [1, 1, 0], False, True, 5), {}),
    }


def _pool_edges() -> torch.Tensor:
    x = torch.randn(2, 3, 4, 9)
    x[0, 0, 0, 0], x[0, 0, 1, 2] = float("nan"), float("nan")  # two NaNs in one window: eager keeps the last
    x[0, 1, :2, :3] = -float("inf")  # a window all -inf: its first point
    x[0, 2, :2, 3:6] = 1.5  # a window of ties: its first point
    x[1, 0, 2, 6], x[1, 0, 3, 8] = float("nan"), 5.0  # NaN beats a larger value after it
    return x


RED = _red_cases()


@pytest.mark.parametrize("name", sorted(RED))
def test_reduction_matches_eager_through_the_interpreter(name):
    op, tensors, scalars, kw = RED[name]
    got, want = _run(op, tensors, *scalars, **kw)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = dict(rtol=1e-5, atol=1e-5) if w.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(g, w, equal_nan=True, **(tol if w.is_floating_point() else dict(rtol=0, atol=0)))


@pytest.mark.parametrize("name", sorted(RED))
def test_reduction_compiles_for_sm90_across_its_knobs(name):
    """The default and each algorithm's corners compile; every setting has its own digest
    and a plan that fits the card (split > 1: two kernels and a workspace)."""
    op, tensors, scalars, kw = RED[name]
    card = _gpu_card(op, tensors, *scalars, **kw)
    assert BuiltinProposer().supports(card) == (True, "")
    spaces = generated.spaces(card, H200)
    settings = [generated.default(card, H200)]
    for s in spaces:
        settings += [{k: v[0] for k, v in s.items()}, {k: v[-1] for k, v in s.items()}]
    for knobs in settings:
        cand = generated.build(card, knobs, H200)
        cand.plan.validate(len(card.inputs), len(card.outputs))
        assert len(cand.plan.kernels) == (2 if knobs.get("split", 1) > 1 else 1)
        assert compiler.compile(cand.source, arch="sm_90").cubin
    digests = {generated.build(card, k, H200).digest() for s in spaces for k in knob_space.configs(s)[:40]}
    assert len(digests) == sum(len(knob_space.configs(s)[:40]) for s in spaces)


@contextlib.contextmanager
def _scan_with_flags(rows: int, length: int, reverse: bool, exclusive: bool):
    """A cumsum card over rows x length fp32 whose program carries the IR's reverse and exclusive
    flags (registered with the generator while the block runs), an input and torch's answer."""
    import dataclasses

    card = make_card(A.cumsum.default, meta(rows, length), 1)
    prog = card_program.program_for_card(card)
    prog.scan = dataclasses.replace(prog.scan, reverse=reverse, exclusive=exclusive)
    x = torch.randn(rows, length)
    want = x.flip(1).cumsum(1).flip(1) if reverse else x.cumsum(1)
    generated._PROGRAMS[card.id] = prog
    try:
        yield card, prog, x, want - x if exclusive else want
    finally:
        del generated._PROGRAMS[card.id]


@pytest.mark.parametrize("reverse, exclusive", [(True, False), (False, True), (True, True)])
def test_reversed_and_exclusive_scans(reverse, exclusive):
    """The IR's scan flags (regions lower flip + cumsum, or a shifted cumsum, to them): the
    interpreter and the generated C run on the CPU agree with torch."""
    import cuda_on_cpu

    with _scan_with_flags(6, 23, reverse, exclusive) as (card, prog, x, want):
        (got,) = interp.run(prog, [x])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        cand = generated.build(card, generated.default(card, H200), H200)
    (ran,) = cuda_on_cpu.run(card, cand, [x])
    torch.testing.assert_close(ran, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reverse, exclusive", [(False, False), (True, False), (False, True), (True, True)])
def test_contiguous_lines_get_a_parallel_block_scan_that_compiles_for_every_setting(reverse, exclusive):
    """A thread walking a contiguous line reads it a sector at a time: lines along the
    innermost dim get a block per line (the default once a line is long), strided lines keep
    a thread per line; the block scan compiles for sm_90 in every form and setting."""
    with _scan_with_flags(6, 3001, reverse, exclusive) as (card, _, _, _):
        # fp32 states through the stage, 8 elements a thread (KernelBench's cumsum, H100)
        assert generated.default(card, H200) == {"algo": "gen_scan_block", "threads": 32, "items": 8, "stage": "smem"}
        (space,) = [s for s in generated.spaces(card, H200) if s["algo"] == ("gen_scan_block",)]
        for knobs in knob_space.configs(space)[::3]:
            cand = generated.build(card, knobs, H200)
            assert cand.plan.kernels[0].grid[0] == 6 and cand.plan.kernels[0].block[0] == knobs["threads"]
            assert compiler.compile(cand.source, arch="sm_90").cubin
    strided = make_card(A.cumsum.default, meta(3001, 6), 0)
    assert [s["algo"] for s in generated.spaces(strided, H200)] == [("gen_scan",)]
    assert generated.default(make_card(A.cumsum.default, meta(500, 20), 1), H200)["algo"] == "gen_scan"  # short lines


@pytest.mark.parametrize("make", [lambda: make_card(A.sum.dim_IntList, meta(6, 1024), [1]),
                                  lambda: make_card(A.var_mean.correction, meta(4, 512), [1]),
                                  lambda: make_card(A.argmin.default, meta(3, 4, 64))], ids=["sum", "var_mean", "argmin"])
def test_vector_loads_in_reductions_fold_the_same_elements(make):
    """Vector widths where every row is whole aligned vectors; with them the kernel (g++ on the
    CPU, one thread per output) gives what scalar loads give: indices exactly, values up to the
    rounding of another summation order (each unrolled item keeps its own partial state, so the
    vector width changes which elements share one)."""
    import cuda_on_cpu

    card = make()
    (cols,) = [s for s in generated.spaces(card, H200) if s["algo"] == ("gen_cols",)]
    assert cols["vec"] == (1, 2, 4)
    for knobs in [k for k in knob_space.configs(cols) if k["threads"] == 64 and k["vec"] > 1][::3]:
        inputs = card.random_inputs(0, "cpu")
        got = cuda_on_cpu.run(card, generated.build(card, knobs, H200), inputs)
        scalar = cuda_on_cpu.run(card, generated.build(card, {**knobs, "vec": 1}, H200), inputs)
        for g, b in zip(got, scalar):
            torch.testing.assert_close(g, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{knobs}: {m}")
    for odd in (make_card(A.sum.dim_IntList, meta(6, 1001), [1]), make_card(A.sum.dim_IntList, meta(64, 6), [0])):
        # odd rows; rows strided in memory (gen_cols_block's vector runs across outputs, not along a row)
        assert all(s["vec"] == (1,) for s in generated.spaces(odd, H200) if s["algo"] != ("gen_cols_block",))


def test_long_reduction_with_few_outputs_splits_across_blocks():
    card = make_card(A.sum.default, meta(64, 1 << 20))
    knobs = generated.default(card, H200)
    cand = generated.build(card, knobs, H200)
    assert knobs["split"] >= 256 and [k.name for k in cand.plan.kernels] == ["kf_gen", "kf_gen_finish"]
    assert cand.plan.kernels[0].grid[1] == knobs["split"] and cand.plan.workspace_bytes() == [(knobs["split"] * 8, False)]


def _chain(prog, knobs) -> int:
    """Elements one thread folds in sequence under these knobs."""
    from kforge.codegen import lower

    lanes = 1 if knobs["algo"] == "gen_cols" else knobs["threads"] if knobs["lanes"] == "block" else knobs["lanes"]
    return -(-(-(-lower.reduction_layout(prog).rn // knobs["split"])) // lanes)


def test_reduction_knob_spaces_hold_only_settings_whose_sequential_chains_stay_accurate():
    """An fp32 sum of 64 x 262144 to one value folded by 8 lanes without a split chains 2M
    additions per thread and misses eager by more than the evaluator allows (seen on the H200):
    no such setting is in the space, nor is the default; exact folds (amax) keep every setting."""
    card = make_card(A.sum.default, meta(64, 1 << 18))
    prog = generated.program(card)
    configs = [k for s in generated.spaces(card, H200) for k in knob_space.configs(s)]
    assert configs and max(_chain(prog, k) for k in configs) <= generated.CHAIN
    assert not any(k.get("lanes") == 8 and k["split"] == 1 for k in configs)
    assert generated.default(card, H200) in configs
    exact = make_card(A.amax.default, meta(64, 1 << 18), [0, 1])
    assert {k["split"] for s in generated.spaces(exact, H200) for k in knob_space.configs(s)} == set(generated.SPLITS)
    short = make_card(A.sum.dim_IntList, meta(64, 512), [1])  # short rows: the whole space is accurate
    assert [s["lanes"] for s in generated.spaces(short, H200) if "lanes" in s] == [(8, 32, 128, "block")]


def test_each_unrolled_item_folds_its_own_chain():
    """One thread per row of 2048 (g++ on the CPU): with 8 items a thread keeps 8 partial sums,
    each a chain of 256 additions, merged at the end, and the rows' sums come out several times
    closer to float64 than one chain of 2048 gives (the triplet loss's distances, a difference of
    two such sums, had missed eager's tolerance on the H100 with one chain)."""
    import cuda_on_cpu

    card = make_card(A.sum.dim_IntList, meta(64, 2048), [1])
    x = torch.rand(64, 2048, generator=torch.Generator().manual_seed(0)) + 1
    exact = x.double().sum(1)
    err = {}
    for items in (1, 8):
        knobs = {"algo": "gen_cols", "threads": 64, "items": items, "split": 1, "vec": 1}
        (got,) = cuda_on_cpu.run(card, generated.build(card, knobs, H200), [x])
        err[items] = float(((got.double() - exact).abs() / exact).max())
    assert err[8] < err[1] / 4, err


def test_templates_stay_first_and_the_generator_adds_its_algorithms():
    from builtin_cards import softmax
    from kforge.proposers.builtin.proposer import templates_for

    card = softmax(64, 256)
    template, gen = templates_for(card)
    assert (template.name, gen.name) == ("softmax", "generated")
    from test_builtin_templates import ctx

    first = BuiltinProposer().propose(ctx(card)).candidate
    assert first.knobs == template.default(card, H200)  # the template's default
    second = BuiltinProposer().propose(ctx(card, parent=_tried(first), tried=[first.digest()])).candidate
    assert second.knobs == generated.default(card, H200)  # then the generator's, before any neighbour
    both = [first.digest(), second.digest()]
    seen = {BuiltinProposer().propose(ctx(card, parent=_tried(first), tried=both, seed=s)).candidate.knobs["algo"]
            for s in range(40)}
    assert any(a.startswith("gen_") for a in seen) and any(not a.startswith("gen_") for a in seen), seen


def _tried(cand):
    from kforge.proposers.base import Tried
    from kforge.verdict import EvalResult, Verdict

    return Tried(cand, EvalResult(Verdict.VALID))


def test_cards_without_a_template_are_generated():
    from builtin_cards import to_copy

    for card in (make_card(A.leaky_relu.default, meta(16, 1000)), make_card(A.sum.dim_IntList, meta(8, 64), [1]),
                 make_card(A.argmax.default, meta(8, 64), 1), make_card(A.abs.default, meta(9, dtype=torch.int32)),
                 make_card(A.relu.default, meta(8, dtype=torch.float64)),
                 make_card(A.mean.dim, meta(4, 10, 33), [0, 2], True),
                 make_card(A.mean.dim, meta(4, 8), [1], dtype=torch.float64), to_copy(meta(8, 4), torch.int64),
                 to_copy(meta(8, 4, dtype=BF16), torch.bool), to_copy(meta(8, 4), torch.float64)):
        assert BuiltinProposer().supports(card) == (True, ""), card.op


@pytest.mark.parametrize("card, reason", [
    (lambda: make_card(A.sort.default, meta(8, 8)), "no builtin template or generated kernel"),
    (lambda: make_card(A.frexp.Tensor, meta(8)), "two outputs"),
    (lambda: make_card(A.relu.default, meta(8, dtype=torch.complex64)), "complex64"),
    (lambda: make_card(A.sum.dim_IntList, meta(8, 8, dtype=torch.complex64), [1]), "complex64"),
    # Its entry needs a NaN constant, which an integer dtype cannot hold: a decline, not a crash.
    (lambda: make_card(A.logit_backward.default, meta(8, dtype=torch.int32), meta(8, dtype=torch.int32)),
     "cannot express"),
])
def test_generator_declines_with_a_reason(card, reason):
    ok, why = BuiltinProposer().supports(card())
    assert not ok and reason in why, why


# ---- the region builder ------------------------------------------------------------------

def test_region_of_pointwise_nodes_and_a_reduction_with_an_epilogue():
    """x * w -> sum over the last dim -> + bias -> sigmoid: one Program, its prologue and
    epilogue evaluated by the interpreter like eager runs the four ops."""
    x, w, b = torch.randn(6, 40), torch.randn(40), torch.randn(6)
    ins = [TensorMeta.of(t) for t in (x, w, b)]
    m = lambda *s: TensorMeta(s, torch.empty(s).stride(), "float32", "cuda")  # noqa: E731
    nodes = [Node("aten::mul.Tensor", {"self": Ref("in", 0), "other": Ref("in", 1)}, [m(6, 40)]),
             Node("aten::sum.dim_IntList", {"self": Ref("node", 0), "dim": [-1], "keepdim": False, "dtype": None}, [m(6)]),
             Node("aten::add.Tensor", {"self": Ref("node", 1), "other": Ref("in", 2), "alpha": 1}, [m(6)]),
             Node("aten::sigmoid.default", {"self": Ref("node", 2)}, [m(6)])]
    prog = build.from_nodes(nodes, ins, [Ref("node", 3)], [m(6)], {})
    assert not isinstance(prog, str), prog
    assert prog.reduction is not None and prog.in_strides[2] == (1, 0)
    (got,) = interp.run(prog, [x, w, b])
    torch.testing.assert_close(got, torch.sigmoid((x * w).sum(-1) + b))
    from kforge.codegen import lower

    built = lower.lower_reduction(prog, {"algo": "gen_rows", "threads": 128, "lanes": 32, "items": 2, "split": 1}, 132)
    assert compiler.compile(built.source, arch="sm_90").cubin


def test_a_permute_of_a_computed_value_moves_the_region_to_the_permuted_domain():
    """x + y, permuted to channels-last, layer-normed over channels (ConvNeXt's LayerNorm2d),
    with the sum returned too: every load is read through permuted strides, and the sum is
    written through its own strides at the permuted points."""
    x, y = torch.randn(2, 6, 3, 4), torch.randn(2, 6, 3, 4)
    m = lambda *s: TensorMeta(s, torch.empty(s).stride(), "float32", "cuda")  # noqa: E731
    nodes = [Node("aten::add.Tensor", {"self": Ref("in", 0), "other": Ref("in", 1), "alpha": 1}, [m(2, 6, 3, 4)]),
             Node("aten::permute.default", {"self": Ref("node", 0), "dims": [0, 2, 3, 1]}, [m(2, 3, 4, 6)]),
             Node("aten::native_layer_norm.default", {"input": Ref("node", 1), "normalized_shape": [6], "weight": None,
                                                       "bias": None, "eps": 1e-5}, [m(2, 3, 4, 6), m(2, 3, 4, 1), m(2, 3, 4, 1)])]
    prog = build.from_nodes(nodes, [TensorMeta.of(x), TensorMeta.of(y)], [Ref("node", 2), Ref("node", 0)],
                            [m(2, 3, 4, 6), m(2, 6, 3, 4)], {})
    assert not isinstance(prog, str), prog
    assert prog.domain == (2, 3, 4, 6) and prog.out_strides[1] == (72, 4, 1, 12)
    normed, total = interp.run(prog, [x, y])
    torch.testing.assert_close(normed, torch.nn.functional.layer_norm((x + y).permute(0, 2, 3, 1), (6,)))
    torch.testing.assert_close(total, x + y)
    from kforge.codegen import lower

    built = lower.lower_norm(prog, {"algo": "gen_norm", "threads": 64, "lanes": 1, "vec": 1, "staging": "regs"})
    assert compiler.compile(built.source, arch="sm_90").cubin


def test_a_reshape_of_a_computed_value_before_the_reduction_regroups_its_loads():
    """(a + b) viewed per head, (4, 32) -> (4, 2, 16), softmax over the head dim (a QK-norm's
    shape), with the sum returned too; a bias broadcast over the rows cannot follow a view that
    merges the rows into its dim, so the domain stays (4, 32) and the softmax folds both dims."""
    a, b = torch.randn(4, 32), torch.randn(4, 32)
    m = lambda *s: TensorMeta(s, torch.empty(s).stride(), "float32", "cuda")  # noqa: E731
    nodes = [Node("aten::add.Tensor", {"self": Ref("in", 0), "other": Ref("in", 1), "alpha": 1}, [m(4, 32)]),
             Node("aten::view.default", {"self": Ref("node", 0), "size": [4, 2, 16]}, [m(4, 2, 16)]),
             Node("aten::_softmax.default", {"self": Ref("node", 1), "dim": -1, "half_to_float": False}, [m(4, 2, 16)])]
    prog = build.from_nodes(nodes, [TensorMeta.of(a), TensorMeta.of(b)], [Ref("node", 2), Ref("node", 0)],
                            [m(4, 2, 16), m(4, 32)], {})
    assert not isinstance(prog, str), prog
    probs, total = interp.run(prog, [a, b])
    torch.testing.assert_close(probs, torch.softmax((a + b).view(4, 2, 16), -1))
    torch.testing.assert_close(total, a + b)
    bias = torch.randn(32)
    merged = [Node("aten::add.Tensor", {"self": Ref("in", 0), "other": Ref("in", 1), "alpha": 1}, [m(4, 32)]),
              Node("aten::view.default", {"self": Ref("node", 0), "size": [128]}, [m(128)]),
              Node("aten::_softmax.default", {"self": Ref("node", 1), "dim": -1, "half_to_float": False}, [m(128)])]
    prog = build.from_nodes(merged, [TensorMeta.of(a), TensorMeta.of(bias)], [Ref("node", 2)], [m(128)], {})
    assert prog.domain == (4, 32) and prog.reduction.dims == (0, 1)
    torch.testing.assert_close(interp.run(prog, [a, bias])[0], torch.softmax((a + bias).view(128), -1))


def test_a_permute_after_a_keepdim_reduction_is_written_once_per_kept_point():
    x = torch.randn(2, 5, 3, 4)
    m = lambda *s: TensorMeta(s, torch.empty(s).stride(), "float32", "cuda")  # noqa: E731
    nodes = [Node("aten::mul.Tensor", {"self": Ref("in", 0), "other": 2.0}, [m(2, 5, 3, 4)]),
             Node("aten::mean.dim", {"self": Ref("node", 0), "dim": [2, 3], "keepdim": True, "dtype": None}, [m(2, 5, 1, 1)]),
             Node("aten::permute.default", {"self": Ref("node", 1), "dims": [0, 2, 3, 1]}, [m(2, 1, 1, 5)])]
    prog = build.from_nodes(nodes, [TensorMeta.of(x)], [Ref("node", 2)], [m(2, 1, 1, 5)], {})
    assert not isinstance(prog, str), prog
    assert prog.out_strides[0] == (5, 1, 0, 0)  # over (2, 5, 3, 4): channel c at c, nothing over the reduced dims
    (got,) = interp.run(prog, [x])
    torch.testing.assert_close(got, (x * 2).mean((2, 3), keepdim=True).permute(0, 2, 3, 1))
    # ConvNeXt's head: the mean restrided (as_strided over its size-1 dims) before the permute
    restrided = TensorMeta((2, 5, 1, 1), (5, 1, 5, 5), "float32", "cuda")
    head = nodes[:2] + [Node("aten::as_strided.default", {"self": Ref("node", 1), "size": [2, 5, 1, 1],
                                                          "stride": [5, 1, 5, 5], "storage_offset": None}, [restrided]),
                        Node("aten::permute.default", {"self": Ref("node", 2), "dims": [0, 2, 3, 1]}, [m(2, 1, 1, 5)])]
    prog = build.from_nodes(head, [TensorMeta.of(x)], [Ref("node", 3)], [m(2, 1, 1, 5)], {})
    assert not isinstance(prog, str), prog
    torch.testing.assert_close(interp.run(prog, [x])[0], (x * 2).mean((2, 3), keepdim=True).permute(0, 2, 3, 1))
    used = nodes + [Node("aten::relu.default", {"self": Ref("node", 2)}, [m(2, 1, 1, 5)])]
    why = build.from_nodes(used, [TensorMeta.of(x)], [Ref("node", 3)], [m(2, 1, 1, 5)], {})
    assert "only a region output may be one" in why


def test_region_with_two_reductions_is_declined():
    m = lambda *s: TensorMeta(s, torch.empty(s).stride(), "float32", "cuda")  # noqa: E731
    nodes = [Node("aten::amax.default", {"self": Ref("in", 0), "dim": [1], "keepdim": True}, [m(4, 1, 6)]),
             Node("aten::sum.dim_IntList", {"self": Ref("node", 0), "dim": [2], "keepdim": True, "dtype": None}, [m(4, 1, 1)])]
    why = build.from_nodes(nodes, [m(4, 8, 6)], [Ref("node", 1)], [m(4, 1, 1)], {})
    assert isinstance(why, str) and "one reduction level" in why
    # a second reduction over size-1 dims only folds one element a row: pointwise, so generated
    ones = [nodes[0], Node("aten::sum.dim_IntList", {"self": Ref("node", 0), "dim": [1], "keepdim": True, "dtype": None},
                           [m(4, 1, 6)])]
    prog = build.from_nodes(ones, [m(4, 8, 6)], [Ref("node", 1)], [m(4, 1, 6)], {})
    assert not isinstance(prog, str), prog
    x = torch.randn(4, 8, 6)
    torch.testing.assert_close(interp.run(prog, [x])[0], x.amax(1, keepdim=True))


# ---- the generated C itself, run on the CPU ----------------------------------------------

I32 = torch.int32
ON_CPU = {
    "relu_odd": lambda: make_card(A.relu.default, meta(37, 3)),
    "add_broadcast_alpha": lambda: make_card(A.add.Tensor, meta(7, 5, 12), meta(5, 1), alpha=2),
    "mul_sliced": lambda: make_card(A.mul.Tensor, meta(16, 40)[:, :24], meta(24)),
    "elu_transposed": lambda: make_card(A.elu.default, meta(16, 24).t()),
    "div_channels_last": lambda: make_card(A.div.Tensor, meta(2, 8, 3, 5, channels_last=True), meta(8, 1, 1)),
    "hardtanh_inplace": lambda: make_card(A.hardtanh_.default, meta(6, 40)),
    "add_out": lambda: make_card(A.add.out, meta(7, 8), meta(8), out=meta(7, 8)),
    "where_bool": lambda: make_card(A.where.self, meta(9, 8, dtype=torch.bool), meta(9, 8), meta(8)),
    "eq_int": lambda: make_card(A.eq.Tensor, meta(6, 16, dtype=I32), meta(6, 16, dtype=I32)),
    "addcmul_int_fractional_value": lambda: make_card(A.addcmul.default, meta(5, 7, dtype=I32), meta(5, 7, dtype=I32),
                                                      meta(5, 7, dtype=I32), value=0.5),
    "fill_int_fractional_value": lambda: make_card(A.fill_.Scalar, meta(5, 7, dtype=I32), 2.7),
    "fill_transposed_from_a_0_dim_tensor": lambda: make_card(A.fill_.Tensor, meta(16, 24).t(), meta()),
    "zero_": lambda: make_card(A.zero_.default, meta(33, 5)),
    "to_copy_int_to_f64": lambda: make_card(A._to_copy.default, meta(8, 12, dtype=I32), dtype=torch.float64),
    "zero_dim": lambda: make_card(A.exp.default, meta()),
    "sum_rows": lambda: make_card(A.sum.dim_IntList, meta(5, 300), [-1]),
    "sum_dim0_keepdim": lambda: make_card(A.sum.dim_IntList, meta(600, 7), [0], True),
    "sum_all": lambda: make_card(A.sum.default, meta(20, 700)),
    "mean_channels_last": lambda: make_card(A.mean.dim, meta(2, 8, 3, 5, channels_last=True), [2, 3]),
    "sum_int_transposed": lambda: make_card(A.sum.dim_IntList, meta(30, 9, dtype=I32).t(), [1]),
    "max_dim": lambda: make_card(A.max.dim, meta(6, 700), 1),
    "argmin_flat": lambda: make_card(A.argmin.default, meta(3, 4, 70)),
    "var_mean": lambda: make_card(A.var_mean.correction, meta(4, 900), [1]),
    "logsumexp": lambda: make_card(A.logsumexp.default, meta(3, 800), [1]),
    "any_bool": lambda: make_card(A.any.dim, meta(5, 600, dtype=torch.bool), 1),
    "norm2": lambda: make_card(A.linalg_vector_norm.default, meta(6, 500), 2.0, [-1]),
    # out= reductions: the out argument is the output, not an operand broadcast to the domain
    "norm2_out": lambda: make_card(A.linalg_vector_norm.out, meta(6, 500), 2.0, [-1], out=meta(6)),
    "mean_out_keepdim": lambda: make_card(A.mean.out, meta(5, 300), [-1], True, out=meta(5, 1)),
    "cumsum_rows": lambda: make_card(A.cumsum.default, meta(5, 300), 1),
    "cumsum_dim0_int": lambda: make_card(A.cumsum.default, meta(70, 6, dtype=I32), 0),
    "cumprod_channels_last": lambda: make_card(A.cumprod.default, meta(2, 8, 3, 5, channels_last=True), 1),
    "max_pool_indices": lambda: make_card(A.max_pool2d_with_indices.default, meta(2, 3, 11, 9), [3, 3], [2, 2], [1, 1]),
    "max_pool_channels_last_dilated": lambda: make_card(A.max_pool2d.default, meta(1, 4, 10, 10, channels_last=True),
                                                        [3, 3], [1, 1], [1, 1], [2, 2], True),
    "avg_pool_count_exclude_pad": lambda: make_card(A.avg_pool2d.default, meta(3, 11, 9), [3, 2], [2, 1], [1, 1], True, False),
    "max_pool3d_indices": lambda: make_card(A.max_pool3d_with_indices.default, meta(2, 3, 5, 6, 7), [3, 3, 3], [2, 2, 2],
                                            [1, 1, 1]),
    "avg_pool3d_count_exclude_pad": lambda: make_card(A.avg_pool3d.default, meta(2, 3, 5, 6, 7), [3, 2, 3], [2, 1, 2],
                                                      [1, 1, 1], True, False),
}


def _cpu_settings(card):
    """Settings whose threads do not cooperate (every pointwise one; one thread per output or
    line), and pooling tiles of up to 64 threads (their threads meet at a barrier)."""
    out = []
    for s in generated.spaces(card, H200):
        if s["algo"] in (("gen_rows",), ("gen_scan_block",)):
            continue
        for k in knob_space.configs(s):
            if k.get("th", 8) * k.get("tw", 16) <= 64 or \
                    k.get("threads") == 64 or (k.get("threads") == 128 and k.get("grid") == "stride"):
                out.append(k)
    return out


@pytest.mark.parametrize("name", sorted(ON_CPU))
def test_generated_c_runs_on_the_cpu_like_eager(name):
    """g++ runs the very source NVRTC compiles, thread by thread: for each knob setting
    (vector widths, items, grid-stride, splits with their workspace and second kernel) the
    outputs match eager, every element written."""
    import cuda_on_cpu

    card = ON_CPU[name]()
    settings = _cpu_settings(card)
    assert settings
    for seed, knobs in enumerate(settings[::max(1, len(settings) // 6)]):
        inputs = card.random_inputs(seed, "cpu")
        want = card.call_eager([t.clone() for t in inputs], "cpu")
        got = cuda_on_cpu.run(card, generated.build(card, knobs, H200), inputs)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.stride() == w.stride() or g.numel() <= 1, (knobs, g.stride(), w.stride())
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{knobs}: {m}")


def test_narrow_tensors_beside_wide_ones_may_take_vectors_of_several_16_byte_pieces():
    """int64 + fp32 -> fp32: the default keeps every access to 16 bytes (2 elements: the int64
    operand's width); the search may also take 4 to 16 elements a thread, the int64 operand read
    as 16-byte pieces and the fp32 ones 16 bytes at a time. Each compiles and runs like eager; a
    tensor aligned to 8 bytes only is never given a piece of 16."""
    import cuda_on_cpu
    from kforge.codegen import lower

    card = make_card(A.add.Tensor, meta(6, 64, dtype=torch.int64), meta(6, 64))
    prog = generated.program(card)
    assert generated.default(card, H200)["vec"] == 2 == lower.pointwise_vecs(prog, wide=False)[-1]
    assert lower.pointwise_vecs(prog) == (1, 2, 4, 8, 16)
    for v in (4, 8, 16):
        knobs = {**generated.default(card, H200), "vec": v}
        cand = generated.build(card, knobs, H200)
        assert "kf_vec<long long, 2>" in cand.source and ("kf_vec<float, 4>" in cand.source) == (v > 4)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        inputs = card.random_inputs(v, "cpu")
        want = card.call_eager([t.clone() for t in inputs], "cpu")
        torch.testing.assert_close(cuda_on_cpu.run(card, cand, inputs)[0], want[0])
    assert lower.pointwise_vecs(generated.program(make_card(A.add.Tensor, meta(6, 64, dtype=torch.int64), meta(6, 64),
                                                            align=8))) == (1,)


@pytest.mark.parametrize("op, args", [(A.softplus.default, (1.0, 20.0)), (A.softplus.default, (2.0, 5.0)),
                                      (A.mish.default, ())])
def test_log1p_before_a_16_bit_output_takes_a_short_series_or_the_hardware_log(op, args, monkeypatch):
    """softplus and mish rounded to bf16: log1p(e) is the series to e^4 where |e| < 2^-5 and __logf(1 + e)
    past it, not log1pf; in fp32 log1pf stays. The fast form, run on the CPU in fp32 as if the output
    were 16-bit, gives eager's values to a few fp32 ulps over the whole range (the series' edge, 0,
    large inputs, -inf, inf and NaN)."""
    import cuda_on_cpu

    x = torch.cat([torch.linspace(-30, 30, 6001), torch.linspace(-4.0, -3.0, 501), torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    card = make_card(op, meta(x.numel()), *args)
    cuda_on_cpu.check_fast_forms([(make_card(op, meta(x.numel(), dtype=BF16), *args), True), (card, False)],
                                 "log1pf(", "kf_log1p16(")
    cuda_on_cpu.fast_forms_in_fp32(monkeypatch)
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    assert "kf_log1p16(" in cand.source
    (got,) = cuda_on_cpu.run(card, cand, [x])
    want = card.call_eager([x.double()], "cpu")[0]
    torch.testing.assert_close(got.double(), want, rtol=4e-6, atol=1e-30, equal_nan=True)


def test_a_max_pool_with_indices_folds_as_eagers_pooling_kernel_does():
    """Each thread folds its window in order as eager's pooling kernels do (a point taken where it
    is greater or NaN), run on the CPU as generated C: the last NaN's index, ties and all -inf
    windows to their first point; a compare and a NaN test a point, not argmax's tie-break."""
    import cuda_on_cpu

    card = make_card(A.max_pool2d_with_indices.default, meta(2, 3, 4, 9), [2, 3], [2, 3])
    x = _pool_edges()
    want = card.call_eager([x.clone()], "cpu")
    assert want[1][0, 0, 0, 0] == 9 + 2  # the second NaN's index
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    assert "st1[j]<ri" not in cand.source.replace(" ", "") and "isnan(xv)" in cand.source
    got = cuda_on_cpu.run(card, cand, [x])
    torch.testing.assert_close(got[0], want[0], equal_nan=True, rtol=0, atol=0)
    assert torch.equal(got[1], want[1])


def test_pooling_of_integer_tensors_is_declined_since_eager_cuda_cannot_check_it():
    card = make_card(torch.ops.aten.max_pool2d_with_indices.default, meta(2, 5, 17, 13, dtype=torch.int32),
                     [3, 3], [2, 2], [1, 1], [2, 2], True)
    assert "eager has no CUDA kernel" in generated.check(card)


def test_broadcasting_drops_leading_size_1_dims_beyond_the_domain_and_only_those():
    mask = torch.empty(1, 4, 1, 16, 16)  # Swin's window mask, viewed with one more dim than the scores
    assert broadcast_strides(tuple(mask.shape), mask.stride(), (4, 3, 16, 16)) == (256, 0, 16, 1)
    assert broadcast_strides((2, 4, 1, 16, 16), (1024, 256, 256, 16, 1), (4, 3, 16, 16)) is None
    assert broadcast_strides((3, 1), (1, 1), (2, 3, 5)) == (0, 1, 0)


def test_rounding_a_value_the_half_type_already_holds_is_no_node():
    """relu of a bf16-rounded batch norm is exact in bf16: eager's second rounding changes nothing,
    so the IR has none (two instructions an element in ResNet's regions); a value the type may
    not hold (a product, 0.1, a bf16 value into fp16) still rounds."""
    x = Expr.load(0, "bfloat16")
    bn = (x * 1.5 + 0.25).cast("bfloat16")
    relu = Expr("where", (bn < 0.0, Expr.const(0.0, "float32"), bn), "float32")
    assert x.cast("bfloat16") is x and bn.cast("bfloat16") is bn and relu.cast("bfloat16") is relu
    assert (x * 3.0).cast("bfloat16").op == "cast" and Expr.const(0.1, "float32").cast("bfloat16").op == "cast"
    assert bn.cast("float16").op == "cast"
    assert Expr.const(-0.0, "float32").cast("bfloat16").op == "const"
    assert Expr.const(65504.0, "float32").cast("bfloat16").op == "cast"  # fp16's max is not a bf16 value
    assert Expr.const(0.5, "float64").cast("bfloat16").dtype == "float32"  # held as float32 like any rounding


@pytest.mark.parametrize("reverse, exclusive", [(False, False), (True, True)])
def test_a_staged_block_scan_reads_and_writes_consecutive_elements(reverse, exclusive):
    """gen_scan_block with `stage` "smem": each round of the chunk loads (and the epilogue stores)
    consecutive elements at consecutive threads, through a shared stage padded a word every 32;
    without it a thread reads its own `items` consecutive elements. Run on the CPU, every width
    and form gives eager's scan (a mutant without the barrier after the states' write-back fails:
    the epilogue reads other threads' states); a chunk past the stage's budget is not staged."""
    import cuda_on_cpu
    from kforge.codegen import lower

    with _scan_with_flags(3, 300, reverse, exclusive) as (card, prog, x, want):
        for items in (1, 2, 4, 8):
            knobs = {"algo": "gen_scan_block", "threads": 32, "items": items, "stage": "smem"}
            cand = generated.build(card, knobs, H200)
            assert "kf_st[k + (k >> 5)]" in cand.source
            assert "j = c0 + (int)threadIdx.x * IT + u" not in cand.source  # no thread's own consecutive loads
            assert compiler.compile(cand.source, arch="sm_90").cubin
            (got,) = cuda_on_cpu.run(card, cand, [x])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{items}: {m}")
        assert "kf_st" not in generated.build(card, {**knobs, "stage": "none"}, H200).source
    assert lower.scan.scan_stages(prog, {"threads": 1024, "items": 8, "stage": "smem"})  # 33 KB of fp32 states
    wide = make_card(A.cumsum.default, meta(2, 300, dtype=torch.float64), 1)
    assert not lower.scan.scan_stages(card_program.program_for_card(wide), {"threads": 1024, "items": 8, "stage": "smem"})
    assert [s["stage"] for s in generated.spaces(wide, H200) if s["algo"] == ("gen_scan_block",)] == [("none",)]
    assert generated.default(wide, H200) == {"algo": "gen_scan_block", "threads": 32, "items": 2, "stage": "none"}


@pytest.mark.parametrize("name", ["var_mean", "argmin_flat", "logsumexp", "cumsum_rows"])
def test_warp_cooperating_kernels_run_on_the_cpu_like_eager(name):
    """The forms whose threads merge through warp shuffles and shared memory (gen_rows with a warp
    or a block an output, gen_scan_block) run on the CPU, each thread an OS thread and each warp
    meeting at its own barrier around a shuffle: the narrowest and widest lane counts match eager."""
    import cuda_on_cpu

    card = ON_CPU[name]()
    (space,) = [s for s in generated.spaces(card, H200) if s["algo"] in (("gen_rows",), ("gen_scan_block",))]
    configs = [k for k in knob_space.configs(space) if k["threads"] <= 256]
    for knobs in (configs[0], configs[-1]):
        inputs = card.random_inputs(1, "cpu")
        want = card.call_eager([t.clone() for t in inputs], "cpu")
        cand = generated.build(card, knobs, H200)
        assert "__shfl" in cand.source
        for g, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{knobs}: {m}")
