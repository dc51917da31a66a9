"""Normalizations through the code generator on the CPU: softmax, log_softmax, layer, rms,
group, batch and instance norm as single-op cards and as the regions real models have
(a mask add and casts around softmax, a residual add into a norm, an activation after it).
Each program's numerics are checked against eager through the reference interpreter (odd
shapes, 1-element rows, rows longer than a block holds, channels_last, 16-bit and fp32),
every lowered form compiles with NVRTC for sm_90, and the forms whose threads do not
cooperate (a thread per row) run exactly through the generated C on the CPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import cuda_on_cpu
from builtin_cards import A, BF16, F16, F32, make_card, meta
from norm_models import (AddLayerNormGelu, AddRMSNorm, BatchNormReluAdd, BatchNormReluPool, FrobeniusNormalize, GlobalCentre,
                         GroupNormSilu, HandRMSNorm, InstanceNormRelu,
                         MaskSoftmax, ScaleAddLayerNorm2d, ScaleSoftmax, WindowMaskSoftmax)
from kforge import compiler
from kforge.capturing import capture
from kforge.card_files import load_sample
from kforge.codegen import build, card_program, interp, lower
from kforge.codegen.ir import Node, Ref
from kforge.hardware import H200
from kforge.proposers.builtin import BuiltinProposer, generated
from kforge.proposers.builtin import space as knob_space


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _t(shape, dtype=F32, channels_last=False, positive=False):
    x = torch.randn(shape).abs() + 0.1 if positive else torch.randn(shape) * 3
    x = x.to(dtype)
    return x.to(memory_format=torch.channels_last) if channels_last else x


def _meta(t):
    return meta(*t.shape, dtype=t.dtype, channels_last=t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                and not t.is_contiguous())


def _softmax(log, shape, dim, dtype):
    op = A._log_softmax.default if log else A._softmax.default
    x = _t(shape, dtype)
    # eager's CUDA kernels compute 16-bit softmax in fp32 and round once (its CPU log_softmax
    # rounds max + log(sum) to 16 bits first)
    return make_card(op, _meta(x), dim, False), [x], lambda: op(x.float(), dim, False).to(dtype)


def _layer_norm(shape, k, dtype, affine=True):
    x = _t(shape, dtype)
    w, b = (_t(shape[-k:], dtype), _t(shape[-k:], dtype)) if affine else (None, None)
    mw, mb = (_meta(w), _meta(b)) if affine else (None, None)
    ins = [t for t in (x, w, b) if t is not None]
    return (make_card(A.native_layer_norm.default, _meta(x), list(shape[-k:]), mw, mb, 1e-5), ins,
            lambda: A.native_layer_norm.default(x, list(shape[-k:]), w, b, 1e-5))


def _rms_norm(shape, dtype):
    x, w = _t(shape, dtype), _t(shape[-1:], dtype)
    return (make_card(A._fused_rms_norm.default, _meta(x), [shape[-1]], _meta(w), 1e-6), [x, w],
            lambda: A._fused_rms_norm.default(x, [shape[-1]], w, 1e-6))


def _group_norm(shape, groups, dtype, channels_last=False):
    x, w, b = _t(shape, dtype, channels_last), _t(shape[1:2], dtype), _t(shape[1:2], dtype)
    n, c, hw = shape[0], shape[1], math.prod(shape[2:])
    args = (n, c, hw, groups, 1e-5)
    return (make_card(A.native_group_norm.default, _meta(x), _meta(w), _meta(b), *args), [x, w, b],
            lambda: A.native_group_norm.default(x, w, b, *args))


def _bn_inference(shape, dtype, channels_last=False):
    x = _t(shape, dtype, channels_last)
    w, b, rm, rv = tuple(_t(shape[1:2], F32) for _ in range(3)) + (_t(shape[1:2], F32, positive=True),)
    op = A._native_batch_norm_legit_no_training.default
    card = make_card(op, _meta(x), *(_meta(t) for t in (w, b, rm, rv)), 0.1, 1e-5)
    # eager's CUDA kernel returns empty statistics in inference; the meta kernel does not
    card = dataclasses.replace(card, id="", outputs=[card.outputs[0]] + [
        dataclasses.replace(o, shape=(0,), stride=(1,)) for o in card.outputs[1:]])
    return card, [x, w, b, rm, rv], lambda: op(x, w, b, rm, rv, 0.1, 1e-5)


def _instance_stats(shape, dtype):
    """Batch statistics per channel (instance norm's form, on the (1, N*C, ...) view)."""
    x, w, b = _t(shape, dtype), _t(shape[1:2], F32), _t(shape[1:2], F32)
    op = A._native_batch_norm_legit.no_stats
    return make_card(op, _meta(x), _meta(w), _meta(b), True, 0.1, 1e-5), [x, w, b], lambda: op(x, w, b, True, 0.1, 1e-5)


def _softmax_to(log, shape, dtype, to):
    op = A.log_softmax.int if log else A.softmax.int
    x = _t(shape, dtype)
    return make_card(op, _meta(x), -1, to), [x], lambda: op(x, -1, to)


CARDS = {
    "softmax.int bf16 -> fp32 (the composite capture records)": lambda: _softmax_to(False, (3, 8, 65), BF16, F32),
    "log_softmax.int fp32 -> bf16": lambda: _softmax_to(True, (3, 65), F32, BF16),
    "softmax 5x37 fp32": lambda: _softmax(False, (5, 37), -1, F32),
    "softmax 6x1 (1-element rows)": lambda: _softmax(False, (6, 1), 1, F32),
    "softmax dim0 33x7 fp32": lambda: _softmax(False, (33, 7), 0, F32),
    "softmax 3x4x4100 bf16": lambda: _softmax(False, (3, 4, 4100), -1, BF16),
    "softmax 2x70001 fp32 (longer than a block)": lambda: _softmax(False, (2, 70001), -1, F32),
    "log_softmax 7x129 fp16": lambda: _softmax(True, (7, 129), -1, F16),
    "log_softmax 4x3x5 dim1 fp32": lambda: _softmax(True, (4, 3, 5), 1, F32),
    "layer_norm 3x5x40 fp32": lambda: _layer_norm((3, 5, 40), 1, F32),
    "layer_norm 3x5x37 over 2 dims fp16": lambda: _layer_norm((3, 5, 37), 2, F16),
    "layer_norm 4x1 (1-element rows)": lambda: _layer_norm((4, 1), 1, F32),
    "layer_norm 2x9000 bf16 no affine": lambda: _layer_norm((2, 9000), 1, BF16, affine=False),
    "rms_norm 3x5x48 fp32": lambda: _rms_norm((3, 5, 48), F32),
    "rms_norm 3x4096 bf16": lambda: _rms_norm((3, 4096), BF16),
    "group_norm 2x16x5x3 fp32": lambda: _group_norm((2, 16, 5, 3), 4, F32),
    "group_norm 2x16x5x3 channels_last fp32": lambda: _group_norm((2, 16, 5, 3), 4, F32, channels_last=True),
    "group_norm 2x32x9x9 channels_last bf16": lambda: _group_norm((2, 32, 9, 9), 8, BF16, channels_last=True),
    "group_norm 3x6 (2-D)": lambda: _group_norm((3, 6), 3, F32),
    "batch_norm inference 2x16x5x3 fp32": lambda: _bn_inference((2, 16, 5, 3), F32),
    "batch_norm inference channels_last bf16": lambda: _bn_inference((2, 16, 5, 3), BF16, channels_last=True),
    "batch_norm inference channels_last fp32": lambda: _bn_inference((2, 16, 5, 3), F32, channels_last=True),
    "instance stats 1x12x7x5 fp32": lambda: _instance_stats((1, 12, 7, 5), F32),
}


def _sample_knobs(card):
    """The default, then one setting per staging, per lane count and per vector of the default's
    algorithm; every 17th setting of the others (and of the default's, where it has no staging)."""
    out = [generated.default(card, H200)]
    for s in generated.spaces(card, H200):
        if s["algo"] != (out[0]["algo"],):
            out += [k for k in knob_space.configs(s)[::17] if k not in out]
            continue
        for name in ("staging", "lanes", "vec"):
            for value in s.get(name, ()):
                k = {**out[0], name: value}
                if k not in out:
                    out.append(k)
        if "staging" not in s:
            out += [k for k in knob_space.configs(s)[::17] if k not in out]
    return out


def _threads_alone(knobs) -> bool:
    """Settings whose threads do not cooperate: what cuda_on_cpu runs exactly."""
    return knobs["algo"] in ("gen_flat", "gen_window") or (knobs["algo"] == "gen_norm" and knobs["lanes"] == 1)


def _check_outputs(got, want, card):
    for g, w, m in zip(got, want, card.outputs):
        if m.numel:
            # eager's CPU statistics of 16-bit input are 16-bit (CUDA's, which the card has, fp32);
            # fp32 within 1e-4: the table follows CUDA's formulas (group norm's a * x + (b - a * mean))
            tol = {} if w.dtype in (F16, BF16) else dict(rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(g.to(w.dtype), w, **tol, msg=lambda msg: f"{card.summary()}: {msg}")


def _compile_and_run(card, inputs, want, run: bool = True):
    """Every sampled setting compiles for sm_90; those cuda_on_cpu runs exactly match `want`."""
    exact = run and all(m.dtype in ("float32", "float64") for m in card.inputs + card.outputs)
    for knobs in _sample_knobs(card):
        cand = generated.build(card, knobs, H200)
        cand.plan.validate(len(card.inputs), len(card.outputs))
        assert compiler.compile(cand.source, arch="sm_90").cubin, knobs
        if exact and _threads_alone(knobs):
            _check_outputs(cuda_on_cpu.run(card, cand, inputs), want, card)


def test_a_pointwise_kernel_is_one_widest_vector_a_thread_by_default():
    """Batch norm in channels-last (five tensors read) and an add of two tensors alike: one
    16-byte vector of each tensor a thread, 256 threads where there are many waves, 128 where
    there are few; the knob space still holds more items."""
    bn_card = make_card(A._native_batch_norm_legit_no_training.default, meta(32, 256, 56, 56, dtype=BF16, channels_last=True),
                        *(meta(256, dtype=BF16) for _ in range(4)), 0.1, 1e-5)
    bn_card = dataclasses.replace(bn_card, id="", outputs=[bn_card.outputs[0]] + [  # eager's empty statistics
        dataclasses.replace(o, shape=(0,), stride=(1,)) for o in bn_card.outputs[1:]])
    add_card = make_card(A.add.Tensor, meta(32, 256, 56, 56, dtype=BF16), meta(32, 256, 56, 56, dtype=BF16))
    small = make_card(A.relu.default, meta(64, 1000))
    bn, add, few = (generated.default(c, H200) for c in (bn_card, add_card, small))
    assert (bn["algo"], bn["vec"], bn["items"], bn["threads"]) == ("gen_flat", 8, 1, 256)
    assert (add["algo"], add["vec"], add["items"], add["threads"]) == ("gen_flat", 8, 1, 256)
    assert (few["vec"], few["items"], few["threads"]) == (4, 1, 128)
    assert 8 in generated.spaces(add_card, H200)[0]["items"]


@pytest.mark.parametrize("name", sorted(CARDS))
def test_norm_card_matches_eager_compiles_and_runs(name):
    card, inputs, eager = CARDS[name]()
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert BuiltinProposer().supports(card) == (True, "")
    want = eager()
    want = want if isinstance(want, tuple) else (want,)
    _check_outputs(interp.run(prog, inputs), want, card)
    _compile_and_run(card, inputs, want, run=math.prod(prog.domain) <= 4096)


def test_a_norm_is_one_kernel_over_the_reduced_domain():
    card, _, _ = _group_norm((2, 16, 5, 3), 4, F32, channels_last=True)
    prog = card_program.program_for_card(card)
    assert prog.normalizes and prog.domain == (2, 4, 4, 5, 3) and prog.reduce_dims == (2, 3, 4)
    # the channel vectors are read in place through views broadcast over (N, C, H, W)
    assert sorted(prog.source(i) for i in prog.in_strides) == [0, 1, 2]
    cand = generated.build(card, generated.default(card, H200), H200)
    assert len(cand.plan.kernels) == 1 and cand.knobs["algo"] == "gen_norm"


def test_staging_falls_back_when_the_row_does_not_fit():
    card, _, _ = _softmax(False, (2, 70001), -1, F32)
    prog = card_program.program_for_card(card)
    k = {"algo": "gen_norm", "threads": 1024, "lanes": "block", "vec": 1, "staging": "regs"}
    assert lower.norm_staging(prog, k) == "reload"
    card, _, _ = _softmax(False, (8, 8192), -1, F32)
    prog = card_program.program_for_card(card)
    assert lower.norm_staging(prog, {**k, "vec": 4}) == "regs"  # 8 values a thread
    assert lower.norm_staging(prog, {**k, "threads": 128, "vec": 4}) == "smem"  # 64 values a thread, 32 KB a block
    assert lower.norm_staging(prog, {**k, "threads": 128, "vec": 4, "staging": "reload"}) == "reload"


@pytest.mark.parametrize("name, make", [
    ("softmax 5x37", lambda: _softmax(False, (5, 37), -1, F32)),
    ("log_softmax 3x4x101", lambda: _softmax(True, (3, 4, 101), -1, F32)),
    ("layer_norm 3x37, its weight's rows aligned where the input's are not", lambda: _layer_norm((3, 37), 1, F32)),
    ("rms_norm 4x45", lambda: _rms_norm((4, 45), F32))])
def test_rows_of_an_odd_length_are_peeled_to_aligned_vectors(name, make):
    """A row of 37 fp32 starts at element 37 r: no vector width divides every row, so norm_vecs
    allows only 1. Peeled, each row takes its elements before the first 16-byte boundary and after
    the last whole vector one at a time and the rest as vectors: every width, a thread, a warp or a
    block a row, matches eager on the CPU (the vector and the single-element loops both run)."""
    card, ins, eager = make()
    prog = card_program.program_for_card(card)
    assert lower.norm_vecs(prog) == (1,) and 4 in lower.peel_vecs(prog)
    want = eager()
    want = list(want) if isinstance(want, tuple) else [want]
    for v in lower.peel_vecs(prog):
        for lanes, nt in ((1, 64), (32, 64), ("block", 128)):
            cand = generated.build(card, {"algo": "gen_norm", "threads": nt, "lanes": lanes, "vec": v, "staging": "reload"}, H200)
            assert "HD + c * V" in cand.source and "(c < HD ? c : c + NB * V)" in cand.source
            assert compiler.compile(cand.source, arch="sm_90").cubin
            _check_outputs(cuda_on_cpu.run(card, cand, [t.clone() for t in ins]), want, card)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_region_over_odd_rows_is_peeled_too(tmp_path):
    """KernelBench's L1 norm, x / mean(|x|) over rows of an odd length, as one region: peeled
    vectors in both passes, a warp a row, match eager."""
    from test_codegen_regions import region_card

    class L1Norm(torch.nn.Module):
        def forward(self, x):
            return x / torch.mean(torch.abs(x), dim=1, keepdim=True)

    x = torch.randn(6, 1023)
    card = region_card(tmp_path, L1Norm(), x)
    assert card.region.ops == ["abs", "mean", "div"]
    cand = generated.build(card, {"algo": "gen_norm", "threads": 64, "lanes": 32, "vec": 4, "staging": "reload"}, H200)
    assert "(c < HD ? c : c + NB * V)" in cand.source
    torch.testing.assert_close(cuda_on_cpu.run(card, cand, [x.clone()])[0], L1Norm()(x))


def test_a_long_odd_row_defaults_to_peeled_vectors_and_the_search_can_take_them():
    """KernelBench's L2 norm rows (65535 fp32) took one element a thread, the default's only
    width; peeled, 4 (the widest for the output, 16 bytes). Rows of whole vectors are not peeled.
    (Few rows take the cooperative or split forms, which are not peeled.)"""
    card, _, _ = _softmax(False, (512, 65535), -1, F32)
    knobs = generated.default(card, H200)
    assert knobs == {"algo": "gen_norm", "lanes": "block", "vec": 4, "staging": "reload", "threads": 1024}
    assert any(s["algo"] == ("gen_norm",) and s["vec"] == (2, 4) for s in generated.spaces(card, H200))
    bf16, _, _ = _softmax(False, (512, 50257), -1, BF16)  # GPT-2's vocabulary
    assert generated.default(bf16, H200)["vec"] == 8
    whole, _, _ = _softmax(False, (512, 65536), -1, F32)
    assert lower.peel_vecs(card_program.program_for_card(whole)) == ()
    assert "HD" not in generated.build(whole, generated.default(whole, H200), H200).source


def test_the_default_takes_more_threads_where_that_keeps_a_long_row_in_registers():
    """A 16384-long fp32 row (attention scores, kforge.attention): 512 threads would hold 32
    values each, over the limit of 16, and 64 KB does not fit shared memory, so the epilogue
    would read the row again; 1024 threads hold 16 each."""
    card, _, _ = _softmax(False, (4096, 16384), -1, F32)
    knobs = generated.default(card, H200)
    prog = card_program.program_for_card(card)
    assert (knobs["algo"], knobs["threads"], knobs["vec"]) == ("gen_norm", 1024, 4)
    assert lower.norm_staging(prog, knobs) == "regs"
    assert lower.norm_staging(prog, {**knobs, "threads": 512}) == "reload"
    card, _, _ = _softmax(False, (4096, 2048), -1, F32)  # fits at the usual count: unchanged
    assert generated.default(card, H200)["threads"] == 128


def test_a_row_too_long_for_a_warps_registers_takes_the_smallest_block_that_holds_it(tmp_path):
    """Gemma's mask softmax (2048 bf16 scores and a mask a row): 64 values a lane for a warp, 32
    a thread for a 128-thread block, which keeps the row in registers."""
    from test_codegen_regions import region_card

    card = region_card(tmp_path, MaskSoftmax(), torch.randn(1, 64, 2048).bfloat16(), torch.randn(1, 64, 2048).bfloat16())
    knobs = generated.default(card, H200)
    assert knobs == {"algo": "gen_norm", "threads": 128, "lanes": "block", "vec": 8, "staging": "regs"}
    prog = card_program.program_for_card(card)
    assert lower.norm_staging(prog, knobs) == "regs"
    assert lower.norm_staging(prog, {**knobs, "threads": 64}) == "smem"
    assert lower.norm_staging(prog, {**knobs, "threads": 128, "lanes": 32, "staging": "regs"}) == "smem"


@pytest.mark.parametrize("log", [False, True])
def test_a_staged_row_folds_max_then_sum_and_agrees_with_the_online_merge_on_infinities_and_nan(log):
    """With the row held by its thread (staging regs or smem), the logsumexp state is folded in
    phases (max, then the sum of exp(x - max)): the same outputs as the online merge (staging
    reload) and as eager, rows of -inf, with +inf and with NaN included, run on the CPU."""
    card, (x,), eager = _softmax(log, (6, 40), -1, F32)
    x[0] = -math.inf
    x[1, 3] = math.inf
    x[2, 5] = math.nan
    x[3, :20] = -math.inf
    base = {"algo": "gen_norm", "threads": 64, "lanes": 1, "vec": 4}
    runs = {}
    for staging in ("regs", "smem", "reload"):
        cand = generated.build(card, {**base, "staging": staging}, H200)
        assert ("mu1_0" in cand.source) == (staging != "reload")  # the second phase's fold
        runs[staging] = cuda_on_cpu.run(card, cand, [x])[0]
    want = interp.run(card_program.program_for_card(card), [x])[0]
    for staging, got in runs.items():
        torch.testing.assert_close(got, runs["reload"], equal_nan=True, msg=lambda m: f"{staging}: {m}")
    torch.testing.assert_close(runs["regs"], want, equal_nan=True)
    torch.testing.assert_close(runs["regs"][3:], eager()[3:], equal_nan=True)  # finite rows: as eager


def test_a_held_softmax_row_takes_one_exp_an_element_and_one_division_a_row():
    """With the row in registers, the sum's phase keeps exp(x - max) in place of the operand and
    the epilogue multiplies it by 1 / sum, taken once a row after the merges: one expf per
    element and no division per element (Gemma's mask softmax was short of the memory floor by
    its instructions). It runs on the CPU as the online merge does, rows of -inf, with +inf and
    with NaN included."""
    card, (x,), eager = _softmax(False, (6, 24), -1, F32)  # 24 floats a thread: registers
    x[0] = -math.inf
    x[1, 3] = math.inf
    x[2, 5] = math.nan
    x[3, :20] = -math.inf
    base = {"algo": "gen_norm", "threads": 64, "lanes": 1, "vec": 4}
    cand = generated.build(card, {**base, "staging": "regs"}, H200)
    kernel = cand.source[cand.source.index("kf_gen("):]
    assert kernel.count("expf(") == 1
    row, epilogue = kernel.split("if (live)")[-2:]
    assert "(1.0f / st1)" in row and "/" not in epilogue and "xo[u][jj] * rw0" in epilogue
    reload = generated.build(card, {**base, "staging": "reload"}, H200)
    assert "xo[" not in reload.source  # nothing held: the epilogue computes exp(x - max) itself
    got = cuda_on_cpu.run(card, cand, [x])[0]
    torch.testing.assert_close(got, cuda_on_cpu.run(card, reload, [x])[0], equal_nan=True)
    torch.testing.assert_close(got[4:], eager()[4:])


@pytest.mark.usefixtures("fresh_dynamo")
def test_an_epilogue_rounded_to_16_bits_takes_the_fast_exp_and_division(tmp_path):
    """SiLU after a group norm, in bf16: the epilogue's exp and division use the hardware's
    approximations (their few fp32 ulps vanish in the bf16 rounding right after), in every
    form; in fp32 the accurate ones. The statistics' fold is never approximated."""
    for dtype, fast in ((BF16, True), (F32, False)):
        with torch.no_grad():
            r = capture(GroupNormSilu(32, 8).to(dtype), (torch.randn(2, 32, 8, 8, dtype=dtype),), tmp_path / str(dtype),
                        regions=True, time_cards=False)
        (card,) = [c.retarget("cuda", "sm_90") for c in r.cards if c.region is not None]
        for knobs in ({"algo": "gen_norm", "threads": 128, "lanes": 32, "vec": 4, "staging": "reload"},
                      {"algo": "gen_norm_split", "threads": 128, "items": 2, "split": 1, "vec": 4}):
            source = generated.build(card, knobs, H200).source
            kernels = source[source.index('extern "C"'):]
            assert ("__expf(" in kernels, "kf_fdiv(" in kernels, "expf(" in kernels.replace("__expf(", "")) == (
                fast, fast, not fast), knobs
            assert compiler.compile(source, arch="sm_90").cubin
    # a step between the division and the output (a rounding to integers): a few ulps there may
    # move a whole step, so the division stays exact
    with torch.no_grad():
        r = capture(Quantize(), (torch.randn(4, 64, dtype=BF16),), tmp_path / "q", regions=True, time_cards=False)
    (card,) = [c.retarget("cuda", "sm_90") for c in r.cards if c.region is not None]
    source = generated.build(card, generated.default(card, H200), H200).source
    kernels = source[source.index('extern "C"'):]
    assert "kf_fdiv(" not in kernels and " / " in kernels


class Quantize(torch.nn.Module):
    def forward(self, x):
        return torch.round(x / x.abs().amax(-1, keepdim=True) * 127)


def test_few_long_rows_take_one_cooperative_launch_or_the_two_pass_split_form():
    """One image's group norm: 32 rows of 16384 elements cannot fill an H200 a block each. By
    default each row is folded by several blocks of one cooperative launch, every block resident
    (its launch bounds leave room for them all), which wait for their row's other chunks on a
    counter zeroed before the launch and normalize their own chunk. The two-pass split form folds
    the chunks, merges them in a second kernel and applies them grid-wide in a third."""
    card, _, _ = _group_norm((1, 128, 64, 64), 32, F32)
    knobs = generated.default(card, H200)
    assert knobs["algo"] == "gen_norm_coop"
    cand = generated.build(card, knobs, H200)
    (k,) = cand.plan.kernels
    split = lower.coop_split(generated.program(card), knobs["threads"], knobs["vec"], H200.sm_count)
    assert k.cooperative and k.grid == (32, split, 1) and split >= 4
    assert k.grid[0] * k.grid[1] <= H200.sm_count * (1024 // knobs["threads"])  # all resident at once
    assert f"__launch_bounds__(NT, {1024 // knobs['threads']})" in cand.source
    assert cand.plan.workspace[0]["zero"] and "atomicAdd(count, 1u)" in cand.source
    assert compiler.compile(cand.source, arch="sm_90").cubin

    split = generated.build(card, {"algo": "gen_norm_split", "threads": 512, "items": 4, "split": 16, "vec": 4}, H200)
    assert [k.name for k in split.plan.kernels] == ["kf_gen", "kf_gen_finish", "kf_gen_apply"]
    assert not any(k.cooperative for k in split.plan.kernels)
    assert compiler.compile(split.source, arch="sm_90").cubin
    # the statistics read a group's channels and pixels as one run, 4 floats a load, and fold
    # each vector as one Welford chunk (its mean by a multiply, one division per merge)
    for source in (cand.source, split.source.split("kf_gen_finish")[0]):
        assert "constexpr int V = 4;" in source and "kf_vec<float, V>" in source
        assert "* 0.25f" in source and "(4.0f / " in source and "(1.0f / " not in source  # no division per element
    # rows a block each fill the GPU; with more rows than SMs, split first, and the cooperative
    # form only where two blocks a row can be resident (256 threads: 4 an SM)
    card, _, _ = _group_norm((64, 128, 16, 16), 32, F32)
    assert generated.default(card, H200)["algo"] == "gen_norm"
    card, _, _ = _group_norm((5, 128, 64, 64), 32, F32)
    assert generated.default(card, H200)["algo"] == "gen_norm_split"
    assert [s["threads"] for s in generated.spaces(card, H200) if s["algo"] == ("gen_norm_coop",)] == [(256,)]


DECLINED = {
    "batch_norm training with running stats": (
        lambda: make_card(A.native_batch_norm.default, meta(2, 4, 3), meta(4), meta(4), meta(4), meta(4), True, 0.1, 1e-5),
        "updates its running statistics in place"),
    "batch_norm inference writing its statistics": (
        lambda: make_card(A._native_batch_norm_legit_no_training.default, meta(2, 4, 3), meta(4), meta(4), meta(4),
                          meta(4), 0.1, 1e-5), "an inference batch norm's statistics"),
}


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_norm_the_generator_cannot_do_is_declined_with_its_reason(name):
    make, reason = DECLINED[name]
    why = card_program.program_for_card(make())
    assert isinstance(why, str) and reason in why, why


def test_a_node_that_reads_a_norms_statistics_is_declined():
    x, w = make_card(A.native_layer_norm.default, meta(4, 8), [8], None, None, 1e-5), None
    ln = card_program.node_of_card(x)
    nodes = [ln, Node("aten::mul.Tensor", {"self": Ref("node", 0, 0), "other": Ref("node", 0, 2)}, [x.outputs[0]])]
    why = build.from_nodes(nodes, x.inputs, [Ref("node", 1)], [x.outputs[0]], {})
    assert isinstance(why, str) and "statistics" in why, (why, w)


# ---- regions as models have them ----------------------------------------------------------

def cand_kernels(card):
    return generated.build(card, generated.default(card, H200), H200).plan.kernels


REGIONS = {
    "instance_norm relu": (lambda: InstanceNormRelu(16, False), lambda: (_t((2, 16, 5, 7)),),
                           ["_native_batch_norm_legit", "relu"]),
    "instance_norm affine relu": (lambda: InstanceNormRelu(6, True), lambda: (_t((3, 6, 4, 5)),),
                                  ["_native_batch_norm_legit", "relu"]),
    "mask softmax bf16": (MaskSoftmax, lambda: (_t((2, 4, 8, 33), BF16), _t((2, 1, 8, 33), BF16)),
                          ["add", "_to_copy", "_softmax", "_to_copy"]),
    "scale softmax": (ScaleSoftmax, lambda: (_t((4, 33)),), ["mul", "_softmax"]),
    "add layer_norm gelu": (lambda: AddLayerNormGelu(48), lambda: (_t((2, 3, 48)), _t((2, 3, 48))),
                            ["add", "native_layer_norm", "gelu"]),
    "add rms_norm cast": (lambda: AddRMSNorm(48, to=torch.float16), lambda: (_t((2, 3, 48)), _t((2, 3, 48))),
                          ["add", "pow", "mean", "add", "rsqrt", "mul", "mul", "_to_copy"]),
    "rms_norm by hand": (lambda: HandRMSNorm(48), lambda: (_t((4, 48)),), ["pow", "mean", "add", "rsqrt", "mul", "mul"]),
    "group_norm silu": (lambda: GroupNormSilu(16, 4), lambda: (_t((2, 16, 5, 5)),), ["native_group_norm", "silu"]),
    "group_norm silu channels_last": (lambda: GroupNormSilu(16, 4), lambda: (_t((2, 16, 5, 5), channels_last=True),),
                                      ["native_group_norm", "silu"]),
    "batch_norm relu add": (lambda: BatchNormReluAdd(16).eval(), lambda: (_t((2, 16, 5, 5)), _t((2, 16, 5, 5))),
                            ["_native_batch_norm_legit_no_training", "relu", "add"]),
    "batch_norm relu add channels_last": (lambda: BatchNormReluAdd(16).eval(),
                                          lambda: (_t((2, 16, 5, 5), channels_last=True),
                                                   _t((2, 16, 5, 5), channels_last=True)),
                                          ["_native_batch_norm_legit_no_training", "relu", "add"]),
    # a pooling with its prologue (ResNet's stem): the indices unused, so not an output
    "batch_norm relu max_pool channels_last": (lambda: BatchNormReluPool(8).eval(),
                                               lambda: (_t((2, 8, 12, 11), channels_last=True),),
                                               ["_native_batch_norm_legit_no_training", "relu", "max_pool2d_with_indices"]),
    "batch_norm relu avg_pool": (lambda: BatchNormReluPool(8, avg=True).eval(), lambda: (_t((2, 8, 9, 12)),),
                                 ["_native_batch_norm_legit_no_training", "relu", "avg_pool2d"]),
    "scale add layer_norm over channels": (lambda: ScaleAddLayerNorm2d(12), lambda: (_t((2, 12, 5, 3)), _t((2, 12, 5, 3))),
                                           ["mul", "add", "native_layer_norm"]),  # the permute unnamed (a view)
    # a reduction over every dim (its 0-dim result broadcast over them all): one row of all the elements
    "frobenius normalize": (FrobeniusNormalize, lambda: (_t((3, 5, 7, 9)),), ["linalg_vector_norm", "div"]),
    "global centre bf16": (GlobalCentre, lambda: (_t((4, 300), BF16),), ["mean", "sub"]),
    # one image (the mask's window dim lines up with the scores' batch): the mask's extra leading size-1 dim is dropped
    "window mask softmax": (WindowMaskSoftmax, lambda: (_t((4, 3, 16, 16)), _t((3, 16, 16)), _t((4, 16, 16))),
                            ["add", "add", "_softmax"]),
}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", sorted(REGIONS))
def test_norm_region_is_one_program_that_matches_its_replay(tmp_path, name):
    model, make_inputs, ops = REGIONS[name]
    with torch.no_grad():
        r = capture(model(), make_inputs(), tmp_path, regions=True, time_cards=False)
    (cpu_card,) = [c for c in r.cards if c.region is not None and c.region.kind == "fused"]  # not a conv's epilogue
    assert cpu_card.region.ops == ops
    inputs, _ = load_sample(cpu_card, tmp_path, 0)
    card = cpu_card.retarget("cuda", "sm_90")
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert prog.normalizes == ("batch_norm" not in name)
    assert len(cand_kernels(card)) == 1
    assert BuiltinProposer().supports(card) == (True, "")
    want = card.region.replay([t.clone() for t in inputs])
    _check_outputs(interp.run(prog, inputs), want, card)
    _compile_and_run(card, inputs, want)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_safe_softmax_is_zero_on_a_row_that_is_all_minus_inf(dtype):
    """_safe_softmax (what SDPA's math path calls under a mask: MaxViT's attention) is softmax but
    for a row masked whole, where softmax gives NaN and it gives 0; a row masked in part, and a NaN,
    stay softmax's. Every algorithm's default compiles; those the CPU runs match eager exactly."""
    x = torch.randn(6, 33).to(dtype)
    x[1] = -math.inf
    x[2, :5] = -math.inf
    x[3, 7] = math.nan
    card = make_card(A._safe_softmax.default, meta(6, 33, dtype=dtype), -1)
    assert BuiltinProposer().supports(card) == (True, "")
    want = torch.ops.aten._safe_softmax(x, -1)
    assert torch.equal(want[1], torch.zeros(33, dtype=dtype))
    (got,) = interp.run(card_program.program_for_card(card), [x])
    torch.testing.assert_close(got, want, equal_nan=True)
    for space in generated.spaces(card, H200):
        knobs = {k: v[0] for k, v in space.items()}
        cand = generated.build(card, knobs, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        if dtype == F32 and knobs["algo"] not in ("gen_rows", "gen_norm_coop"):
            (ran,) = cuda_on_cpu.run(card, cand, [x])
            torch.testing.assert_close(ran, want, equal_nan=True, msg=lambda m: f"{knobs}: {m}")
