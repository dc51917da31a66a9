"""Every correctness check on hand-made outputs, the speed flags and verdict, and the vendor scan."""

from __future__ import annotations

import torch

from kforge import tolerance
from kforge import validate as V
from kforge.evaluate import screen
from kforge.tolerance import Tolerance
from kforge.verdict import Measurement, Verdict

from evalkit import fake, relu_card

TOL = Tolerance(1e-6, 1e-5, "test")


def _ref():
    return torch.softmax(torch.randn(8, 4096), -1)


def test_poison_fills_every_byte_and_reads_as_unwritten():
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool, torch.uint8):
        t = V.poison(torch.zeros(5, 3, dtype=dtype).t())
        raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        assert bool((raw == 0xFF).all())
    assert V.poison(torch.zeros(4)).isnan().all()


def test_partial_write_is_caught_with_its_first_element():
    ref = _ref()
    out = V.poison(torch.empty_like(ref))
    out.view(-1)[:100] = ref.view(-1)[:100]
    f = V.check_written(out, ref)
    assert f.check == "unwritten" and f.evidence["index"] == 100 and f.evidence["count"] == ref.numel() - 100
    assert V.check_written(ref.clone(), ref) is None


def test_int_output_unwritten_uses_the_bit_pattern():
    ref = torch.arange(10, dtype=torch.int32)
    out = V.poison(torch.empty_like(ref))
    out[:9] = ref[:9]
    assert V.check_written(out, ref).evidence["index"] == 9
    ref_with_minus_one = ref.clone()
    ref_with_minus_one[9] = -1  # eager's own value equals the poison: not evidence of a missed write
    assert V.check_written(out, ref_with_minus_one) is None


def test_second_poison_catches_what_the_first_cannot_see():
    ref = torch.tensor([3, -1, 0, -1], dtype=torch.int32)
    skips = ref != -1  # a kernel that never writes the elements whose answer is -1
    for byte, caught in ((V.POISON_BYTE, False), (V.SECOND_POISON_BYTE, True)):
        out = V.poison(torch.empty_like(ref), byte)
        out[skips] = ref[skips]
        f = V.check_written(out, ref, byte)
        assert (f is not None) is caught
    assert f.evidence["count"] == 2 and f.evidence["index"] == 1


def test_zeros_and_constants_fail_the_canary():
    ref = _ref()
    assert V.check_not_constant(torch.zeros_like(ref), ref).check == "constant"
    assert V.check_not_constant(torch.full_like(ref, 1 / 4096), ref).evidence["value"] == 1 / 4096
    assert V.check_not_constant(ref.clone(), ref) is None
    flat = torch.ones(10)
    assert V.check_not_constant(torch.ones(10), flat) is None  # eager is constant too


def test_compare_reports_the_worst_element():
    ref = _ref()
    out = ref.clone()
    out.view(-1)[777] += 1e-3
    c = V.compare(out, ref, TOL)
    assert not c.ok and c.failure.check == "mismatch"
    assert c.worst["index"] == 777 and c.failure.evidence["count"] == 1
    assert c.max_abs_err > 9e-4 and c.worst["got"] != c.worst["expected"]
    assert V.compare(ref.clone(), ref, TOL).ok


def test_compare_in_chunks_says_what_one_pass_says(monkeypatch):
    """Runs of 7 elements give the whole pass's maxima, first non-finite mismatch, worst element
    and counts: mismatches, NaN and Inf in several runs, the worst tied twice, complex values."""
    torch.manual_seed(0)
    e = torch.randn(5, 13)
    g = e + 1e-7 * torch.randn(5, 13)
    g[1, 2] += 0.5
    g[3, 9] += 0.5  # ties the worst: the first one is reported
    cases = [(g, e), (g.t().contiguous().t(), e)]
    nan = g.clone()
    nan[2, 11], nan[4, 0] = float("nan"), float("inf")
    cases.append((nan, e))
    allinf = torch.full((3, 5), float("inf"))
    cases.append((allinf, allinf.clone()))
    cases.append((torch.complex(g, g), torch.complex(e, e)))
    tol = Tolerance(1e-3, 1e-3, "test")
    for got, want in cases:
        monkeypatch.setattr(tolerance, "CHUNK", 1 << 24)
        whole = V.compare(got, want, tol)
        monkeypatch.setattr(tolerance, "CHUNK", 7)
        assert V.compare(got, want, tol) == whole
    # and no float64 copy holds more than a run (two values an element for complex ones)
    sizes, as_f64 = [], V._as_f64
    monkeypatch.setattr(V, "_as_f64", lambda flat: sizes.append(flat.numel()) or as_f64(flat))
    for got, want in cases:
        V.compare(got, want, tol)
    assert sizes and max(sizes) <= 7


def test_nan_only_where_eager_has_nan():
    ref = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    assert V.compare(ref.clone(), ref, TOL).ok
    bad = ref.clone()
    bad[3] = float("nan")
    c = V.compare(bad, ref, TOL)
    assert c.failure.check == "nonfinite" and c.worst["index"] == 3
    wrong_inf = ref.clone()
    wrong_inf[2] = -float("inf")
    assert V.compare(wrong_inf, ref, TOL).failure.check == "nonfinite"


def test_wrong_dtype_shape_or_stride_fails():
    ref = torch.randn(4, 6)
    assert V.compare(ref.double(), ref, TOL).failure.check == "dtype"
    assert V.compare(ref.reshape(6, 4), ref, TOL).failure.check == "shape"
    transposed = ref.t().contiguous().t()  # same values, column-major
    assert V.compare(transposed, ref, TOL).failure.check == "stride"
    assert V.check_meta(torch.randn(1, 6).expand(1, 6), torch.randn(1, 6)) is None  # size-1 dims' strides are free


def test_input_mutation_is_caught_bitwise_unless_the_op_writes_it():
    before = [torch.randn(100), torch.randn(10)]
    after = [t.clone() for t in before]
    after[1][4] = after[1][4] + 1e-7
    f = V.check_inputs_unchanged(before, after, written=set())
    assert f.check == "inputs_mutated" and f.evidence["input"] == 1 and f.evidence["index"] == 4
    assert V.check_inputs_unchanged(before, after, written={1}) is None
    nan_in = [torch.tensor([float("nan"), 1.0])]
    assert V.check_inputs_unchanged(nan_in, [nan_in[0].clone()], set()) is None  # NaN inputs compare by bits


def test_repeat_runs_bitwise_unless_atomics_declared():
    a = _ref()
    b = a.clone()
    b.view(-1)[5] = torch.nextafter(b.view(-1)[5], torch.tensor(1.0))
    f = V.check_repeatable([a], [b], None)
    assert f.check == "nondeterministic" and f.evidence["index"] == 5
    assert V.check_repeatable([a], [b], [Tolerance(1e-6, 1e-5, "atomics")]) is None
    assert V.check_repeatable([a], [a.clone()], None) is None


def test_speed_flags():
    assert V.speed_flags(kernel_us=5.0, eager_us=20.0, floor_us=10.0) == ["beyond_roofline"]
    assert V.speed_flags(kernel_us=15.0, eager_us=200.0, floor_us=10.0) == ["over_10x"]
    assert V.speed_flags(kernel_us=15.0, eager_us=20.0, floor_us=10.0) == []


def test_speed_verdict_needs_a_win_beyond_the_noise():
    eager = Measurement([10.0, 10.5, 11.0, 11.5, 12.0] * 20)
    faster = Measurement([8.0, 8.2, 8.4, 8.6, 8.8] * 20)
    noisy_tie = Measurement([8.0, 9.0, 10.5, 12.0, 13.0] * 20)
    assert V.speed_verdict(faster, eager)[0] is Verdict.VALID
    assert V.speed_verdict(noisy_tie, eager)[0] is Verdict.SLOWER
    assert V.speed_verdict(eager, faster)[0] is Verdict.SLOWER


def test_vendor_scan_ignores_comments():
    src = '#include <cub/block/block_reduce.cuh>\n// cublasSgemm( is only mentioned here\n' \
          '__global__ void k(){ thrust::sort(); cudnnConvolutionForward(h); }'
    assert V.vendor_uses(src) == ["cub/block/block_reduce.cuh", "thrust::", "cudnnConvolutionForward"]
    assert V.vendor_uses("/* cutlass::gemm */ __global__ void k(float* x) { x[0] = 1; }") == []


def test_mislabelled_vendor_wrapper_is_incorrect_and_vendor_label_is_allowed():
    card = relu_card()
    cand = fake("relu_good")
    cand.source += "\n// evalkit stand-in\n#include <cublas_v2.h>\n"
    r = screen(card, cand)
    assert r.verdict is Verdict.INCORRECT and r.evidence["check"] == "mislabelled_vendor"
    cand.kind = "vendor"
    assert screen(card, cand) is None


def test_plan_that_does_not_fit_the_card_is_a_load_error():
    card = relu_card()
    cand = fake("relu_good")
    cand.plan.kernels[0].args = [{"in": 0}, {"out": 3}]
    assert screen(card, cand).verdict is Verdict.LOAD_ERROR
