"""Tolerances derived from eager's own error against float64: per dtype, scale-aware."""

from __future__ import annotations

import pytest
import torch

from evalkit import make_card, softmax_card
from kforge import tolerance as T
from kforge import validate as V


def _derive(card, inputs):
    ref = T.observed(card, inputs, card.call_eager([t.clone() for t in inputs]))
    return ref, T.derive(card, inputs, ref)


def test_fp32_softmax_4096_rows_rejects_zeros_but_takes_a_reordered_sum():
    card = softmax_card(8, 4096)
    x = card.random_inputs(1, "cpu")
    ref, (tol,) = _derive(card, x)
    assert tol.rtol == 1e-5 and 0 < tol.atol < 1e-6  # scaled by the RMS (~2.4e-4), not a blanket 1e-5
    assert not V.compare(torch.zeros_like(ref[0]), ref[0], tol).ok
    assert V.compare(torch.zeros_like(ref[0]), ref[0], T.Tolerance(1e-2, 0.0, "blanket")).ok  # a constant output passes a blanket atol
    other = torch.softmax(x[0].double(), -1).float()  # a correct kernel that sums in another order
    assert V.compare(other, ref[0], tol).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tolerances_derived_in_chunks_match_one_pass(monkeypatch, dtype):
    """The scale and eager's excess taken over runs of 7 elements: the tolerance of one pass
    (a whole 16384x16384 output's float64 copies did not fit an 80 GB GPU)."""
    card = make_card(torch.ops.aten._softmax.default, torch.randn(6, 37, dtype=dtype), -1, False, family="normalization")
    x = card.random_inputs(0, "cpu")
    x[0][1, 3] = float("inf")  # a row of NaN in eager's output and the reference alike
    ref = T.observed(card, x, card.call_eager(x, device="cpu"))
    whole = T.derive(card, x, ref)
    monkeypatch.setattr(T, "CHUNK", 7)
    sizes, real64 = [], T._real64
    monkeypatch.setattr(T, "_real64", lambda t: sizes.append(t.numel()) or real64(t))
    chunked = T.derive(card, x, ref)
    for w, c in zip(whole, chunked):
        assert c.rtol == w.rtol and c.atol == pytest.approx(w.atol, rel=1e-12)
    assert sizes and max(sizes) <= 7  # no float64 copy of more than a run


def test_fp16_accumulation_fails_an_fp32_op():
    card = softmax_card(8, 4096)
    x = card.random_inputs(2, "cpu")
    ref, (tol,) = _derive(card, x)
    assert V.compare(torch.softmax(x[0].half(), -1).float(), ref[0], tol).failure.check == "mismatch"


def test_bf16_floors_allow_one_ulp_and_reject_zeros():
    x = torch.randn(8, 4096).bfloat16()
    card = make_card(torch.ops.aten._softmax.default, x, -1, False)
    ref, (tol,) = _derive(card, [x])
    assert tol.rtol == 2.0**-7
    assert "bfloat16" in tol.how
    assert V.compare(torch.softmax(x.float(), -1).bfloat16(), ref[0], tol).ok  # fp32 math, one rounding
    assert not V.compare(torch.zeros_like(ref[0]), ref[0], tol).ok


def test_atol_follows_the_scale_of_the_values():
    x = torch.randn(4096)
    card = make_card(torch.ops.aten.mul.Tensor, x, x)
    _, (small,) = _derive(card, [x, x])
    _, (large,) = _derive(card, [x * 1000, x])
    assert large.atol == pytest.approx(small.atol * 1000, rel=1e-6)
    assert large.rtol == small.rtol


def test_measured_error_above_the_floor_is_allowed_four_times_capped():
    ref = torch.randn(1000)
    hi = ref.double() + 1e-4 * ref.double().square().mean().sqrt()  # eager 1e-4 x rms off float64
    tol = T._from_error(ref, hi, "test")
    rms = float(hi.square().mean().sqrt())
    assert tol.atol == pytest.approx(T.SLACK * 1e-4 * rms, rel=1e-2)
    worse = T._from_error(ref, ref.double() + 0.5, "test")
    assert worse.atol / float((ref.double() + 0.5).square().mean().sqrt()) == pytest.approx(1e-3)  # fp32 cap


def test_a_correctly_rounded_answer_passes_where_eager_is_off_by_nearly_its_rtol():
    """fp16 cumprod on the H100, where eager rounds every partial product: at one element of 0.9
    among values of 0.1, eager was 1.8 ulps above float64 (inside its rtol, so no atol beyond the
    floor) and a kernel's correctly rounded answer 0.2 ulp below it, 2 ulps from eager."""
    ulp = 2.0**-11  # in [0.5, 1)
    g = torch.full((1000,), 0.1, dtype=torch.float16)
    g[7] = 0.900390625
    hi = g.double()
    hi[7] += 0.22 * ulp
    eager = g.clone()
    eager[7] += 2 * ulp
    tol = T._from_error(eager, hi, "test")
    assert V.compare(hi.half(), eager, tol).ok
    assert not V.compare(g + 8 * ulp * (torch.arange(1000) == 7), eager, tol).ok  # 6 ulps off still fails


def test_integer_outputs_are_exact():
    x = torch.randint(-5, 5, (100,))
    card = make_card(torch.ops.aten.relu.default, x)
    _, (tol,) = _derive(card, [x])
    assert tol.exact


def test_all_zero_reference_needs_exact_zeros():
    x = -torch.rand(100)
    card = make_card(torch.ops.aten.relu.default, x)
    ref, (tol,) = _derive(card, [x])
    assert V.compare(torch.zeros(100), ref[0], tol).ok
    assert not V.compare(torch.full((100,), 1e-30), ref[0], tol).ok


def test_in_place_op_leaves_callers_inputs_alone():
    x = torch.randn(64)
    card = make_card(torch.ops.aten.relu_.default, x.clone())
    before = x.clone()
    ref = T.observed(card, [x.clone()], card.call_eager([x.clone()]))
    T.derive(card, [x], ref)
    assert torch.equal(x, before)
    assert card.aliases == {0: 0}


def test_op_without_float64_falls_back_to_float32_then_to_the_floor(monkeypatch):
    x = torch.randn(256).half()
    card = make_card(torch.ops.aten.exp.default, x)
    ref = T.observed(card, [x], card.call_eager([x]))
    eager = card.call_eager

    def no_double(tensors, device=None):
        if any(t.dtype == torch.float64 for t in tensors):
            raise RuntimeError('"exp" not implemented for \'Double\'')
        return eager(tensors, device)

    monkeypatch.setattr(card, "call_eager", no_double)
    (tol,) = T.derive(card, [x], ref)
    assert "float32 eager on cpu" in tol.how

    def nothing_works(tensors, device=None):
        raise RuntimeError("not implemented")

    monkeypatch.setattr(card, "call_eager", nothing_works)
    (floor,) = T.derive(card, [x], ref)
    assert "no precise reference" in floor.how
    rms = float(ref[0].double().square().mean().sqrt())
    assert floor.atol == pytest.approx(2.0**-11 * rms) and floor.rtol == 2.0**-10


def test_a_bf16_region_gets_one_ulp_per_rounding_on_its_chain(tmp_path):
    """group_norm then silu in bf16: eager rounds twice, so a fused kernel that rounds where
    eager does (another summation order for the statistics) may differ by two ulps, and a
    chain of one rounded op keeps the one-ulp floor. Zeros still fail."""
    from kforge.capturing import capture

    class GroupNormSiLU(torch.nn.Module):
        def __init__(self, then_silu: bool):
            super().__init__()
            self.norm, self.then_silu = torch.nn.GroupNorm(4, 16), then_silu

        def forward(self, x):
            y = self.norm(x).reshape(x.shape)  # a view: no rounding of its own
            return torch.nn.functional.silu(y) * 2 if self.then_silu else y

    x = torch.randn(2, 16, 8, 8).bfloat16()
    with torch.no_grad():
        r = capture(GroupNormSiLU(True).bfloat16(), x, tmp_path, regions=True, time_cards=False)
    (card,) = [c for c in r.cards if c.region is not None]
    assert card.region.roundings(card.region.outputs[0]) == 3  # group_norm, silu, mul
    inputs = card.random_inputs(1, "cpu")
    ref, tols = _derive(card, inputs)
    assert tols[0].rtol == T.MAX_ULPS * 2.0**-7 and "3 roundings" in tols[0].how
    assert not V.compare(torch.zeros_like(ref[0]), ref[0], tols[0]).ok
    assert not V.compare(ref[0] * 1.1, ref[0], tols[0]).ok  # 10 % off is not a rounding
    sub = card.region
    assert sub.roundings({"node": 0, "out": 0}) == 1 and sub.roundings({"in": 0}) == 0
