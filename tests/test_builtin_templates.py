"""The built-in templates on a machine without a GPU: every algorithm of every template
compiles with NVRTC for sm_90 at the corners of its knob space, plans fit their cards,
knob revisions give distinct sources, unsupported cards are declined with a reason, and
the proposer's neighbourhood moves, exhaustion and repair behave."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch

from builtin_cards import (A, BF16, F16, GN_COOP, SPREAD, gn, ln, make_card, meta, rms, softmax, softmax_to, to_copy,
                           variance_inputs)
from kforge import compiler
from kforge.candidate import Candidate
from kforge.cards import encode_value
from kforge.errors import ProposerError
from kforge.hardware import H200, Hardware
from kforge.proposers import get_proposer
from kforge.proposers.base import ProposalContext, Tried
from kforge.proposers.builtin import BuiltinProposer, generated, template_for, templates_for
from kforge.proposers.builtin import batch_norm as bn_template
from kforge.proposers.builtin import group_norm as gn_template
from kforge.proposers.builtin import softmax as softmax_template
from kforge.proposers.builtin import space as knob_space
from kforge.verdict import EvalResult, Verdict


def ctx(card, parent=None, tried=(), failures=(), seed=0) -> ProposalContext:
    return ProposalContext(card=card, hardware=H200, parent=parent, sibling_failures=list(failures),
                           tried_digests=set(tried), rng=random.Random(seed))


def tried(cand: Candidate, verdict: Verdict = Verdict.VALID) -> Tried:
    return Tried(cand, EvalResult(verdict))


def corners(card):
    """Each algorithm's most conservative and most aggressive settings, and the default."""
    template = template_for(card)
    out = [template.default(card, H200)]
    for s in template.spaces(card, H200):
        out += [{k: v[0] for k, v in s.items()}, {k: v[-1] for k, v in s.items()}]
    return template, out


@pytest.mark.parametrize("name", sorted(SPREAD))
def test_template_compiles_for_sm90_and_plan_fits(name):
    card = SPREAD[name]()
    ok, why = BuiltinProposer().supports(card)
    assert ok, why
    template, settings = corners(card)
    for knobs in settings:
        cand = template.build(card, knobs, H200)
        assert cand.kind == "custom" and cand.proposer == "builtin" and cand.knobs == knobs
        cand.plan.validate(len(card.inputs), len(card.outputs))
        assert compiler.compile(cand.source, options=cand.plan.options, arch="sm_90").cubin


@pytest.mark.parametrize("name", sorted(SPREAD))
def test_every_knob_setting_has_its_own_digest_and_a_valid_plan(name):
    card = SPREAD[name]()
    template = template_for(card)
    digests = set()
    for s in template.spaces(card, H200):
        for knobs in knob_space.configs(s):
            cand = template.build(card, knobs, H200)
            cand.plan.validate(len(card.inputs), len(card.outputs))
            digests.add(cand.digest())
    assert len(digests) == sum(len(knob_space.configs(s)) for s in template.spaces(card, H200))


@pytest.mark.parametrize("card, reason", [
    (lambda: make_card(A.mm.default, meta(8, 8), meta(8, 8)), "no builtin template"),
    (lambda: make_card(A.gelu.default, meta(0, 4)), "empty"),
])
def test_unsupported_cards_are_declined_with_a_reason(card, reason):
    p = BuiltinProposer()
    ok, why = p.supports(card())
    assert not ok and reason in why
    with pytest.raises(ProposerError, match="no template"):
        p.propose(ctx(card()))


@pytest.mark.parametrize("card, reason", [
    (lambda: make_card(A._softmax.default, meta(8, 16), 0, False), "last"),
    (lambda: make_card(A._softmax.default, meta(16, 8).t(), -1, False), "contiguous"),
    (lambda: gn(1, 64, 8, 8, 32, channels_last=True), "channels_last"),
    (lambda: softmax_to(8, 64, dtype=torch.float32, to=BF16), "only dtype=torch.float32"),
    (lambda: ln(8, 1 << 20), "leaves most SMs idle"),  # KernelBench's LayerNorm: 8 rows of 4M, scaled
    (lambda: rms(4, 65536, BF16), "leaves most SMs idle"),
])
def test_norm_cards_a_template_declines_get_the_generated_kernel(card, reason):
    c = card()
    template = template_for(c)
    assert template.name != "generated" and reason in template.check(c)
    assert BuiltinProposer().supports(c) == (True, "")
    algo = BuiltinProposer().propose(ctx(c)).candidate.knobs["algo"]
    # few long rows: each spread over several blocks (one cooperative launch, by default)
    assert algo == "gen_norm_coop" if reason == "leaves most SMs idle" else algo.startswith("gen_norm")


def test_cpu_tensor_operand_is_declined():
    card = make_card(A.mul.Tensor, meta(4, 4), meta())
    card.args[1].tensor = dataclasses.replace(card.args[1].tensor, device="cpu")
    ok, why = BuiltinProposer().supports(card)
    assert not ok and "not on the GPU" in why


def with_value(card, name: str, value):
    """The card with one non-tensor argument replaced (calls meta tensors cannot make)."""
    args = [dataclasses.replace(a, value=encode_value(value)) if a.name == name else a for a in card.args]
    return dataclasses.replace(card, args=args, id="")


@pytest.mark.parametrize("name, value, reason", [
    ("device", torch.device("cpu"), "to cpu"),
    ("pin_memory", True, "pin_memory"),
    ("layout", torch.sparse_coo, "sparse_coo"),
    ("dtype", F16, "output is bfloat16"),
])
def test_to_copy_that_is_not_an_on_device_copy_is_declined(name, value, reason):
    p = BuiltinProposer()
    assert p.supports(to_copy(meta(8, 4), BF16)) == (True, "")
    ok, why = p.supports(with_value(to_copy(meta(8, 4), BF16), name, value))
    assert not ok and reason in why, why


@pytest.mark.parametrize("name, value", [("device", torch.device("cuda")), ("layout", torch.strided),
                                         ("non_blocking", True), ("memory_format", torch.preserve_format)])
def test_to_copy_on_its_own_device_is_taken_whatever_else_it_says(name, value):
    # F.softmax(x, dtype=...) casts through x.to(options): device and layout set to x's own.
    assert BuiltinProposer().supports(with_value(to_copy(meta(8, 4), BF16), name, value)) == (True, "")


@pytest.mark.parametrize("src, dst, rounding", [(BF16, torch.float32, None), (torch.float32, BF16, "__float2bfloat16_rn"),
                                                (F16, torch.float32, None), (torch.float32, F16, "__float2half_rn"),
                                                (F16, BF16, "__float2bfloat16_rn")])
def test_to_copy_is_the_identity_rounded_on_store(src, dst, rounding):
    """Loaded to fp32 exactly and rounded to nearest even only toward a narrower type, with the
    intrinsic c10's Half/BFloat16 use on sm_80+ (so the bits match torch's cast), in every
    generated setting."""
    card = to_copy(meta(64, 1000, dtype=src), dst)
    assert [f.name for f in templates_for(card)] == ["generated"]
    for knobs in corners(card)[1]:
        text = generated.build(card, knobs, H200).source
        kernel = text[text.index('extern "C"'):]
        assert ("__float2" in kernel) == (rounding is not None) and (rounding is None or rounding in kernel)
        assert compiler.compile(text, arch="sm_90").cubin


COPY_LAYOUTS = {  # SPREAD's _to_copy layouts as 32/64-bit copies (what the CPU emulator runs)
    "odd": lambda: to_copy(meta(1001, 3), torch.float64),
    "same_dtype": lambda: to_copy(meta(999), torch.float32),
    "0dim": lambda: to_copy(meta(), torch.float64),
    "transposed": lambda: to_copy(meta(48, 64).t(), torch.float64),
    "transposed_to_contiguous": lambda: to_copy(meta(48, 64).t(), torch.float64, memory_format=torch.contiguous_format),
    "sliced": lambda: to_copy(meta(64, 100)[:, :50], torch.float64),
    "to_channels_last": lambda: to_copy(meta(2, 8, 5, 5), torch.float64, memory_format=torch.channels_last),
    "int_to_float": lambda: to_copy(meta(37, 129, dtype=torch.int32), torch.float32),
}


@pytest.mark.parametrize("name", sorted(COPY_LAYOUTS))
def test_to_copy_indexing_matches_torch_on_the_cpu(name):
    """For every vector width the generated copy, run on the CPU, puts each element where
    torch's _to_copy does, in the output strides the card records (new memory formats included)."""
    import cuda_on_cpu

    card = COPY_LAYOUTS[name]()
    for seed, vec in enumerate(generated.spaces(card, H200)[0]["vec"]):
        x = card.random_inputs(seed, "cpu")
        want = card.call_eager([t.clone() for t in x], "cpu")[0]
        assert want.stride() == card.outputs[0].stride
        (got,) = cuda_on_cpu.run(card, generated.build(card, {**generated.default(card, H200), "vec": vec}, H200), x)
        assert got.stride() == want.stride() and torch.equal(got, want), vec


def test_get_proposer_gives_the_builtin():
    assert isinstance(get_proposer("builtin"), BuiltinProposer)


def test_in_place_binds_the_output_and_never_a_second_pointer_to_self():
    card = SPREAD["add_inplace_bf16"]()
    cand = BuiltinProposer().propose(ctx(card)).candidate
    (k,) = cand.plan.kernels
    assert k.args == [{"out": 0}, {"in": 1}]
    assert "__restrict__ out" not in cand.source


def test_mixed_dtype_operand_is_rounded_to_the_result_dtype():
    """bf16 * fp32 0-dim tensor: CUDA's kernel casts the fp32 value to bf16 before the fp32 math
    (the CPU's does not); bf16 += fp32 tensor: the common dtype is fp32, so the other operand is
    not rounded before the add. The generated program (its interpreter) rounds where that shows."""
    from kforge.codegen import interp

    x, k = torch.full((6, 4), 3.0).to(BF16), torch.tensor(1 + 2 ** -8 + 2 ** -12)  # k: 1 + 2^-7 in bf16
    card = SPREAD["mul_0dim"]()
    want = (x.float() * k.to(BF16).float()).to(BF16)
    assert not torch.equal(want, (x.float() * k).to(BF16))  # rounding k first shows
    assert torch.equal(interp.run(generated.program(card), [x, k])[0], want)
    card = SPREAD["add_inplace_bf16_fp32_other"]()
    y = torch.full((6, 40), 2 ** -8 + 2 ** -17)  # past half an ulp of 1 in bf16 only unrounded
    want = torch.ones(6, 40).to(BF16).add_(y)
    assert not torch.equal(want, torch.ones(6, 40).to(BF16).add_(y.to(BF16)))
    assert torch.equal(interp.run(generated.program(card), [torch.ones(6, 40).to(BF16), y])[0], want)


def test_defaults_are_designed_for_the_roofline():
    p = BuiltinProposer()
    # Long softmax rows are split over >= 4 blocks per SM per kernel, through a workspace,
    # each chunk in registers: 16-byte loads, 4 to 8 per thread issued back to back.
    c = p.propose(ctx(SPREAD["softmax_long_rows"]())).candidate
    assert c.knobs["algo"] == "split_regs" and len(c.plan.kernels) == 2
    assert all(k.grid[0] * k.grid[1] >= 4 * H200.sm_count for k in c.plan.kernels)
    assert c.plan.workspace_bytes() == [(8 * c.knobs["split"] * 8, False)]
    assert c.knobs["vec"] * 4 == 16 and any(f"constexpr int IT = {it};" in c.source for it in range(4, 9))
    assert "constexpr bool IN_CHUNK" in c.source and f"constexpr int CH = {262144 // c.knobs['split']};" in c.source
    # Group norm at batch 1 is one cooperative launch that fills >= 90 % of the thread slots
    # its registers allow (1024 per SM), and loads 16 bytes per thread.
    for name in ("group_norm_bf16", "group_norm_f32_big"):
        c = p.propose(ctx(SPREAD[name]())).candidate
        (k,) = c.plan.kernels
        assert c.knobs["algo"] == "coop" and k.cooperative
        assert k.grid[0] * k.grid[1] * k.block[0] >= 0.9 * 1024 * H200.sm_count
        card = SPREAD[name]()
        assert c.knobs["vec"] * card.inputs[0].itemsize == 16
    # Row norms and big pointwise ops use 16-byte vectors.
    for name in ("layer_norm_bf16", "rms_norm_bf16", "gelu_tanh_bf16", "add_inplace_bf16"):
        assert p.propose(ctx(SPREAD[name]())).candidate.knobs["vec"] == 8


# Long rows for split_regs: fp32 and bf16 at the benchmark shape, a prime-ish length (scalar
# loads, ragged chunks), log_softmax, fp16 in with fp32 out, and the shortest legal row.
LONG_ROWS = {
    "f32_8x262144": lambda: softmax(8, 262144),
    "bf16_8x262144": lambda: softmax(8, 262144, dtype=BF16),
    "odd_3x100003": lambda: softmax(3, 100003),
    "log_3x70000": lambda: softmax(3, 70000, log=True),
    "half_to_float_4x65536": lambda: softmax(4, 65536, dtype=F16, half_to_float=True),
    "shortest_2x8192": lambda: softmax(2, 8192),
}


def split_regs_space(card):
    (s,) = [s for s in softmax_template.spaces(card, H200) if s["algo"] == ("split_regs",)]
    return s


@pytest.mark.parametrize("name", sorted(LONG_ROWS))
def test_split_regs_compiles_across_its_knobs(name):
    """The default, each knob swept alone from it, and the corners compile for sm_90; the
    plan launches one block per chunk per row and holds every chunk in registers."""
    card = LONG_ROWS[name]()
    rows, cols = card.args[0].tensor.numel // card.args[0].tensor.shape[-1], card.args[0].tensor.shape[-1]
    s = split_regs_space(card)
    base = softmax_template.default(card, H200)
    assert base["algo"] == "split_regs"
    settings = [base] + [{**base, k: v} for k in ("split", "threads", "vec") for v in s[k]]
    settings += [{k: v[0] for k, v in s.items()}, {k: v[-1] for k, v in s.items()}]
    for knobs in [k for i, k in enumerate(settings) if k not in settings[:i]]:
        cand = softmax_template.build(card, knobs, H200)
        cand.plan.validate(len(card.inputs), len(card.outputs))
        ch, it, n = softmax_template._split_geometry(cols, knobs["split"], knobs["threads"], knobs["vec"])
        assert [k.name for k in cand.plan.kernels] == ["kf_softmax_partial", "kf_softmax_finish"]
        assert all(k.grid == (n, rows, 1) and k.block == (knobs["threads"], 1, 1) for k in cand.plan.kernels)
        assert cand.plan.workspace_bytes() == [(rows * n * 8, False)]
        assert f"constexpr int IT = {it};" in cand.source and f"constexpr int CH = {ch};" in cand.source
        assert compiler.compile(cand.source, options=cand.plan.options, arch="sm_90").cubin


@pytest.mark.parametrize("name", sorted(LONG_ROWS))
def test_split_regs_chunks_cover_each_row_once_from_registers(name):
    """Mirror of the kernels' kf_live predicate: over the whole knob space every column is
    loaded (and written) by exactly one (block, thread, load), and no thread holds more than
    SPLIT_REGS values."""
    card = LONG_ROWS[name]()
    cols = card.args[0].tensor.shape[-1]
    for knobs in knob_space.configs(split_regs_space(card)):
        nt, v = knobs["threads"], knobs["vec"]
        ch, it, n = softmax_template._split_geometry(cols, knobs["split"], nt, v)
        assert it * v <= softmax_template.SPLIT_REGS and n <= knobs["split"] and ch % v == 0
        assert (n - 1) * ch < cols <= n * ch
        k = ((torch.arange(it)[:, None] * nt + torch.arange(nt)[None, :]) * v).flatten()  # vector starts in a chunk
        starts = (torch.arange(n)[:, None] * ch + k[None, :]).flatten()
        live = (k[None, :] < ch) & (starts.view(n, -1) < cols)
        starts = starts[live.flatten()]
        covered = torch.zeros(cols, dtype=torch.int32)
        for j in range(v):
            covered.index_add_(0, starts + j, torch.ones_like(starts, dtype=torch.int32))
        assert bool((covered == 1).all()), knobs


def counter_bytes(groups: int) -> int:
    """A cooperative kernel's counters: one per group, each on a 128-byte line of its own,
    the partials after them."""
    return groups * 128


@pytest.mark.parametrize("name", sorted(LONG_ROWS))
def test_split_coop_is_one_cooperative_launch_that_compiles(name):
    """One kernel launched cooperatively, a grid of at most 2 blocks per SM, its counters
    and partials in one zeroed workspace; every setting compiles for sm_90."""
    card = LONG_ROWS[name]()
    rows, cols = card.args[0].tensor.numel // card.args[0].tensor.shape[-1], card.args[0].tensor.shape[-1]
    (s,) = [s for s in softmax_template.spaces(card, H200) if s["algo"] == ("split_coop",)]
    for knobs in knob_space.configs(s):
        cand = softmax_template.build(card, knobs, H200)
        cand.plan.validate(len(card.inputs), len(card.outputs))
        ch, it, n = softmax_template._split_geometry(cols, knobs["split"], knobs["threads"], knobs["vec"])
        (k,) = cand.plan.kernels
        assert k.name == "kf_softmax_coop" and k.cooperative and k.grid == (n, rows, 1)
        assert rows * n <= softmax_template.COOP_BLOCKS_PER_SM * H200.sm_count and it * knobs["vec"] <= softmax_template.SPLIT_REGS
        assert cand.plan.workspace_bytes() == [(counter_bytes(rows) + rows * n * 8, True)]
        assert compiler.compile(cand.source, options=cand.plan.options, arch="sm_90").cubin


def test_split_coop_is_offered_only_where_the_grid_can_be_resident():
    assert not any(s["algo"] == ("split_coop",) for s in softmax_template.spaces(softmax(512, 16384), H200))
    (s,) = [s for s in softmax_template.spaces(softmax(8, 262144), H200) if s["algo"] == ("split_coop",)]
    assert s["split"] == (16, 32) and s["threads"] == (512, 1024)


@pytest.mark.parametrize("name", sorted(GN_COOP))
def test_group_norm_coop_grid_is_resident_and_covers_each_element_once(name):
    card = GN_COOP[name]()
    p = gn_template._problem(card)
    group = p["C"] // p["G"] * p["HW"]
    (s,) = [s for s in gn_template.spaces(card, H200) if s["algo"] == ("coop",)]
    for knobs in knob_space.configs(s):
        nt, v = knobs["threads"], knobs["vec"]
        n, ch, it, minb = gn_template._coop_geometry(p, H200, nt, knobs["hold"], v, knobs["stash"])
        assert ch == it * nt * v and (n - 1) * ch < group <= n * ch, knobs
        # Resident at once: the blocks per SM it needs fit the threads per SM its registers
        # allow, and the shared memory of an SM (228 KB on sm_90, 1 KB of it per block reserved).
        assert n * p["N"] * p["G"] <= minb * H200.sm_count and minb * nt <= gn_template._resident(knobs["hold"], H200), knobs
        assert minb * (knobs["stash"] * nt * 4 + 8 * (p["C"] // p["G"]) + 1024) <= 228 * 1024, knobs
        cand = gn_template.build(card, knobs, H200)
        cand.plan.validate(len(card.inputs), len(card.outputs))
        (k,) = cand.plan.kernels
        assert k.name == "kf_gn_coop" and k.cooperative and k.grid == (n, p["N"] * p["G"], 1)
        assert k.smem == knobs["stash"] * nt * 4
        assert cand.plan.workspace_bytes() == [(counter_bytes(p["N"] * p["G"]) + p["N"] * p["G"] * n * 8, True)]


@pytest.mark.parametrize("name", ["bf16_1x512x128x128", "f32_1x128x512x512", "ragged_2x40x33x31"])
def test_group_norm_coop_compiles_within_its_launch_bounds(name):
    """Every setting compiles under the registers __launch_bounds__ leaves it. How much ptxas
    spills depends on the NVRTC release (24 bytes on 13.0.48, 92 on 13.0.88 for bf16): that is
    a performance figure, measured on the GPU by bench/bench_builtin.py, not a CPU test's."""
    card = GN_COOP[name]()
    (s,) = [s for s in gn_template.spaces(card, H200) if s["algo"] == ("coop",)]
    for knobs in knob_space.configs(s):
        if knobs["stash"] not in (0, 16, s["stash"][-1]):  # the stash is shared memory, not registers
            continue
        cand = gn_template.build(card, knobs, H200)
        out = compiler.compile(cand.source, options=(*cand.plan.options, "--ptxas-options=-v"), arch="sm_90",
                               use_cache=False)
        assert out.cubin and re.search(r"Used \d+ registers", out.log), (knobs, out.log)


def test_group_norm_coop_fits_an_sm_of_1536_threads():
    """sm_89 (L40S) holds 1536 threads and 99 KB of shared memory per block, not 2048 and 227 KB:
    every coop grid must still be resident there."""
    l40s = Hardware("NVIDIA L40S", "sm_89", 142, 96 * 2**20, 99 * 1024, 48 * 10**9, 0.77e12)
    assert l40s.max_threads_per_sm == 1536 and H200.max_threads_per_sm == 2048
    card = gn(1, 512, 64, 64, 32, F16)
    p = gn_template._problem(card)
    (s,) = [s for s in gn_template.spaces(card, l40s) if s["algo"] == ("coop",)]
    for knobs in knob_space.configs(s):
        nt = knobs["threads"]
        n, _, _, minb = gn_template._coop_geometry(p, l40s, nt, knobs["hold"], knobs["vec"], knobs["stash"])
        assert minb * nt <= 1536 and n * p["N"] * p["G"] <= minb * l40s.sm_count, knobs
        assert minb * (knobs["stash"] * nt * 4 + 8 * (p["C"] // p["G"]) + 1024) <= 100 * 1024, knobs


def test_group_norm_coop_needs_a_grid_that_can_be_resident():
    # 1024 (sample, group) pairs: more blocks than 132 SMs hold at 1024 threads each.
    assert not any(s["algo"] == ("coop",) for s in gn_template.spaces(gn(32, 512, 8, 8, 32), H200))
    (s,) = [s for s in gn_template.spaces(gn(16, 512, 8, 8, 32), H200) if s["algo"] == ("coop",)]
    assert s["threads"] == (256,)  # 512 pairs: only 4 blocks per SM are enough
    (s,) = [s for s in gn_template.spaces(gn(1, 512, 128, 128, 32, BF16), H200) if s["algo"] == ("coop",)]
    assert s["threads"] == (256, 512, 1024) and s["hold"] == gn_template.HOLDS and s["stash"] == gn_template.STASHES
    # 200 groups of 4096 channels need 2 blocks per SM, and scale and shift alone take 32 KB
    # of each block's shared memory: 48 values per thread would leave room for one.
    (s,) = [s for s in gn_template.spaces(gn(1, 4096 * 200, 1, 1, 200), H200) if s["algo"] == ("coop",)]
    assert s["threads"] == (256, 512) and s["stash"] == (0, 16, 32)


@pytest.mark.parametrize("name", ["layer_norm_bf16", "layer_norm_many_rows", "layer_norm_odd"])
def test_layer_norm_welford_stats_are_one_block_reduction(name):
    """block_regs offers two-pass and Welford statistics for layer_norm (rms_norm has no
    mean to take); each compiles and differs only in that."""
    card = SPREAD[name]()
    template = template_for(card)
    (s,) = [s for s in template.spaces(card, H200) if s["algo"] == ("block_regs",)]
    assert s["stats"] == ("two_pass", "welford")
    base = {k: v[-1] for k, v in s.items()}
    two, one = (template.build(card, {**base, "stats": st}, H200) for st in s["stats"])
    assert "constexpr bool WELFORD = false;" in two.source and "constexpr bool WELFORD = true;" in one.source
    assert f"kf_block_welford<{base['threads']}>(kf_welford{{" in one.source
    assert compiler.compile(one.source, options=one.plan.options, arch="sm_90").cubin
    rms = SPREAD["rms_norm_many_rows_f16"]()
    assert all("stats" not in s for s in template_for(rms).spaces(rms, H200))


def test_split_regs_pdl_launches_kernel_2_early_on_sm_90_only():
    """pdl: kernel 1 lets kernel 2 start once its loads are issued, and kernel 2 loads x
    before it waits for kernel 1's partials; only offered where griddepcontrol exists."""
    card = softmax(8, 262144)
    space = split_regs_space(card)
    assert space["pdl"] == (False, True) and softmax_template.default(card, H200)["pdl"] is False
    cand = softmax_template.build(card, {**softmax_template.default(card, H200), "pdl": True}, H200)
    first, second = cand.plan.kernels
    assert not first.pdl and second.pdl and not second.cooperative
    src = cand.source
    assert src.index("kf_load_chunk(x + base, lo, v);") < src.index('asm volatile("griddepcontrol.wait;"')
    assert "constexpr bool PDL = true;" in src and "kf_combine<PDL>(ws" in src  # partials via __ldcg
    assert compiler.compile(src, options=cand.plan.options, arch="sm_90").cubin
    a100 = dataclasses.replace(H200, name="NVIDIA A100", arch="sm_80")
    (s80,) = [s for s in softmax_template.spaces(card, a100) if s["algo"] == ("split_regs",)]
    assert "pdl" not in s80 and "pdl" not in softmax_template.default(card, a100)


def test_split_regs_needs_long_rows_and_registers_bound_the_split():
    assert not any(s["algo"] == ("split_regs",) for s in softmax_template.spaces(softmax(64, 8191), H200))
    assert split_regs_space(softmax(8, 262144))["split"] == (64, 128, 256, 512)
    assert split_regs_space(softmax(1, 2**22))["split"] == (1024, 2048, 4096)
    # Many rows: one block per row is already enough blocks.
    assert softmax_template.default(softmax(512, 16384), H200)["algo"] != "split_regs"


def test_unaligned_pointer_falls_back_to_narrower_vectors():
    card = make_card(A.relu.default, meta(1024, dtype=BF16), align=4)
    template = template_for(card)
    assert template.spaces(card, H200)[0]["vec"] == (1, 2)


def test_revision_moves_one_or_two_knobs_and_never_repeats():
    card = SPREAD["softmax_bf16_2048"]()
    p = BuiltinProposer()
    root = p.propose(ctx(card)).candidate
    seen = {root.digest()}
    for seed in range(30):
        c = p.propose(ctx(card, parent=tried(root), tried=seen, seed=seed)).candidate
        assert c.digest() not in seen
        if c.knobs["algo"] == root.knobs["algo"]:
            changed = [k for k in c.knobs if c.knobs[k] != root.knobs[k]]
            assert 1 <= len(changed) <= 2
        seen.add(c.digest())


def test_first_proposal_is_the_default_then_a_neighbour_of_it():
    card = SPREAD["layer_norm_bf16"]()
    p = BuiltinProposer()
    first = p.propose(ctx(card)).candidate
    assert first.knobs == template_for(card).default(card, H200)
    second = p.propose(ctx(card, tried={first.digest()})).candidate
    assert second.digest() != first.digest()


def test_sibling_failures_are_not_repeated():
    card = SPREAD["relu_f32_4d"]()
    p = BuiltinProposer()
    parent = p.propose(ctx(card)).candidate
    template = template_for(card)
    bad = template.build(card, {**parent.knobs, "threads": 1024}, H200)
    for seed in range(40):
        c = p.propose(ctx(card, parent=tried(parent), failures=[tried(bad, Verdict.RUNTIME_ERROR)],
                          tried={parent.digest(), bad.digest()}, seed=seed)).candidate
        assert c.knobs["threads"] != 1024


def test_exhausted_space_raises():
    card = make_card(A._adaptive_avg_pool2d.default, meta(2, 3, 10, 9), [3, 4])  # 4 settings of "threads"
    p = BuiltinProposer()
    seen: set[str] = set()
    parent = None
    for _ in range(4):
        c = p.propose(ctx(card, parent=parent, tried=seen)).candidate
        seen.add(c.digest())
        parent = tried(c)
    with pytest.raises(ProposerError, match="every knob setting"):
        p.propose(ctx(card, parent=parent, tried=seen))


def test_repair_steps_toward_safety():
    card = SPREAD["gelu_tanh_bf16"]()
    p = BuiltinProposer()
    failed = generated.build(card, {"algo": "gen_flat", "threads": 1024, "vec": 8, "items": 8, "grid": "exact"}, H200)
    fix = p.repair(ctx(card, tried={failed.digest()}), tried(failed, Verdict.COMPILE_ERROR)).candidate
    assert fix.knobs == {**failed.knobs, "vec": 4}
    fix2 = p.repair(ctx(card, tried={failed.digest(), fix.digest()}), tried(failed, Verdict.COMPILE_ERROR)).candidate
    assert fix2.knobs == {**failed.knobs, "threads": 512}
    safest = generated.build(card, {"algo": "gen_flat", "threads": 64, "vec": 1, "items": 1, "grid": "exact"}, H200)
    assert p.repair(ctx(card), tried(safest, Verdict.RUNTIME_ERROR)) is None


def test_sources_are_specialized_to_shapes():
    a = BuiltinProposer().propose(ctx(softmax(4096, 256))).candidate
    b = BuiltinProposer().propose(ctx(softmax(4096, 128))).candidate
    assert "constexpr int C = 256;" in a.source and "constexpr int C = 128;" in b.source


def test_large_tensors_switch_to_64_bit_indexing():
    small = BuiltinProposer().propose(ctx(make_card(A.relu.default, meta(1024)))).candidate
    big = BuiltinProposer().propose(ctx(make_card(A.relu.default, meta(2**31 + 64, dtype=BF16)))).candidate
    assert "typedef int kf_idx;" in small.source and "typedef kf_i64 kf_idx;" in big.source
    assert compiler.compile(big.source, arch="sm_90").cubin


def test_rms_norm_without_eps_uses_fp32_epsilon():
    cand = BuiltinProposer().propose(ctx(SPREAD["rms_norm_no_eps"]())).candidate
    assert "constexpr float EPS = 1.1920928955078125e-07f;" in cand.source


def test_layer_norm_stats_follow_the_card_dtypes():
    card = SPREAD["layer_norm_bf16"]()
    assert [m.dtype for m in card.outputs] == ["bfloat16", "float32", "float32"]
    src = BuiltinProposer().propose(ctx(card)).candidate.source
    assert "typedef float Tm;" in src and "typedef float Tr;" in src and "typedef __nv_bfloat16 Ty;" in src


def test_every_template_is_reachable():
    names = {template_for(SPREAD[n]()).name for n in SPREAD}
    assert names == {"generated", "softmax", "layer_norm", "rms_norm", "group_norm", "batch_norm", "pooling"}


def emulate_batch_norm(card, knobs, inputs: list[torch.Tensor]) -> torch.Tensor:
    """kf_bn_eval's indexing and arithmetic done on the CPU in fp32: the element each
    (block, item, thread, lane) handles, the channel it takes its statistics from, and
    which threads write save_mean / save_invstd. Every element must be written once."""
    p = bn_template._problem(card)
    x = inputs[0]
    flat = x.as_strided((x.numel(),), (1,)).float()
    stats = {k: inputs[i].float() for k, i in p["index"].items()}
    nt, v, items, c = knobs["threads"], knobs["vec"], knobs["items"], p["C"]
    plan = bn_template.build(card, knobs, H200).plan.kernels[0]
    blocks = plan.grid[0]
    base = (torch.arange(blocks)[:, None, None] * items + torch.arange(items)[None, :, None]) * (nt * v) \
        + torch.arange(nt)[None, None, :] * v
    base = base.flatten()
    base = base[base < x.numel()]
    i = (base[:, None] + torch.arange(v)).flatten()
    assert bool((torch.bincount(i, minlength=x.numel()) == 1).all()), "every element written once"
    if p["layout"] == "nhwc":
        ch = i % c
    elif p["extent"] % v == 0:
        ch = ((base // p["extent"]) % c)[:, None].expand(-1, v).flatten()  # one channel per vector
    else:
        ch = (i // p["extent"]) % c  # a vector crosses planes: each element's own channel
    mean = stats["running_mean"][ch]
    invstd = torch.rsqrt(stats["running_var"][ch] + torch.tensor(p["eps"], dtype=torch.float32))
    w = stats["weight"][ch] if "weight" in stats else torch.ones_like(mean)
    b = stats["bias"][ch] if "bias" in stats else torch.zeros_like(mean)
    y = torch.empty(x.numel())
    y[i] = (flat[i] - mean) * w * invstd + b
    if p["write_stats"]:
        assert blocks * nt >= c, "the threads that write the statistics exist"
    return y.to(x.dtype).as_strided(x.shape, x.stride())


@pytest.mark.parametrize("name", ["batch_norm_channels_last", "batch_norm_2d_f16_no_affine",
                                  "batch_norm_f16_vectors_cross_planes", "batch_norm_cudnn_f32_7x7",
                                  "batch_norm_bf16_fp32_stats", "batch_norm_legit_no_training_odd"])
def test_batch_norm_indexing_matches_torch_on_the_cpu(name):
    """At every corner of the knob space the kernel's element and channel mapping gives
    torch's inference batch norm (computed on the CPU in fp32). The statistics outputs are
    compared on the GPU (tests/gpu/test_builtin_gpu.py): CPU eager returns them empty."""
    card = SPREAD[name]()
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(m.span(), generator=g).to(m.torch_dtype).as_strided(m.shape, m.stride)
              for m in card.inputs]
    for i in variance_inputs(card):
        inputs[i] = inputs[i].abs()
    p = bn_template._problem(card)
    stat = {k: inputs[i].float() for k, i in p["index"].items()}  # torch.nn.functional's CPU batch norm in fp32
    want = torch.nn.functional.batch_norm(inputs[0].float(), stat["running_mean"], stat["running_var"],
                                          stat.get("weight"), stat.get("bias"), training=False,
                                          eps=p["eps"]).to(card.outputs[0].torch_dtype)
    for knobs in corners(card)[1]:
        got = emulate_batch_norm(card, knobs, inputs)
        torch.testing.assert_close(got, want, rtol=2e-5 if want.dtype == torch.float32 else 1e-2, atol=1e-5,
                                   msg=lambda m: f"{knobs}: {m}")
        assert got.stride() == card.outputs[0].stride


@pytest.mark.parametrize("card, reason", [
    (lambda: make_card(A.native_batch_norm.default, meta(4, 8, 5, 5), meta(8), meta(8), meta(8), meta(8),
                       True, 0.1, 1e-5), "training-mode"),
    (lambda: make_card(A.native_batch_norm.default, *(meta(*s, dtype=torch.float64) for s in ((4, 8, 5, 5),) + ((8,),) * 4),
                       False, 0.1, 1e-5), "dtype float64"),
    (lambda: make_card(A.native_batch_norm.default, meta(4, 8, 5, 5)[:, :, :, :3], meta(8), meta(8), meta(8),
                       meta(8), False, 0.1, 1e-5), "strides differ"),
    (lambda: make_card(A.native_batch_norm.default, meta(8, 100).t(), meta(8), meta(8), meta(8), meta(8),
                       False, 0.1, 1e-5), "channels_last inputs"),
])
def test_batch_norm_declines_what_it_does_not_template(card, reason):
    ok, why = BuiltinProposer().supports(card())
    assert not ok and reason in why, why


def test_batch_norm_vectors_are_16_bytes_even_where_planes_are_odd():
    for name in ("batch_norm_bf16_7x7", "batch_norm_bf16_56x56"):  # 49 elements per plane, and 3136
        card = SPREAD[name]()
        assert template_for(card).spaces(card, H200)[0]["vec"][-1] == 8  # 16 bytes of bf16
        assert BuiltinProposer().propose(ctx(card)).candidate.knobs["vec"] == 8


def test_cudnn_batch_norm_in_inference_is_normalization_and_writes_no_statistics():
    """PyTorch sends fp32 batch norm to cuDNN; in inference its three other outputs are
    empty, so the kernel writes only y (and needs no threads for the statistics)."""
    from kforge.families import family_of

    assert family_of("aten::cudnn_batch_norm.default") == "normalization"
    assert family_of("aten::cudnn_convolution.default") == "vendor"
    card = SPREAD["batch_norm_cudnn_f32"]()
    assert [m.numel for m in card.outputs[1:]] == [0, 0, 0]
    cand = BuiltinProposer().propose(ctx(card)).candidate
    assert "constexpr bool WRITE_STATS = false;" in cand.source
    assert "constexpr bool WRITE_STATS = true;" in BuiltinProposer().propose(ctx(SPREAD["batch_norm_bf16_56x56"]())).candidate.source
    training = make_card(A.cudnn_batch_norm.default, meta(8, 64, 14, 14), meta(64), meta(64), meta(64), meta(64),
                         True, 0.1, 1e-5)
    ok, why = BuiltinProposer().supports(training)
    assert not ok and "training-mode" in why


@pytest.mark.parametrize("log", [False, True])
def test_softmax_with_dtype_is_the_softmax_kernel_reading_x_as_it_is(log):
    # softmax(x_f16, dtype=float32) casts exactly, then softmaxes: the same kernel as
    # _softmax(x_f16, half_to_float=True), knob for knob.
    fused, plain = softmax_to(33, 3001, dtype=F16, log=log), softmax(33, 3001, dtype=F16, log=log, half_to_float=True)
    assert softmax_template.spaces(fused, H200) == softmax_template.spaces(plain, H200)
    for s in softmax_template.spaces(fused, H200):
        for knobs in knob_space.configs(s)[:3]:
            a, b = softmax_template.build(fused, knobs, H200), softmax_template.build(plain, knobs, H200)
            body = a.source.split("\n", 1)[1]  # after the header line, which names the op
            assert body == b.source.split("\n", 1)[1] and a.plan.kernels == b.plan.kernels
            assert ("constexpr bool LOG = true;" in body) == log


@pytest.mark.parametrize("card", [softmax(8, 262144), softmax(3, 100003), softmax_to(8, 262144), softmax(2, 8192)],
                         ids=lambda c: c.summary())
def test_split_cluster_puts_a_row_in_one_cluster_of_chunks_in_registers(card):
    rows, cols = card.inputs[0].shape[0], card.inputs[0].shape[-1]
    spaces = [s for s in softmax_template.spaces(card, H200) if s["algo"] == ("split_cluster",)]
    assert {s["split"][0] for s in spaces} <= set(softmax_template.CLUSTERS) and spaces
    for s in spaces:
        for knobs in knob_space.configs(s):
            (k,) = softmax_template.build(card, knobs, H200).plan.kernels
            ch, it, n = softmax_template._split_geometry(cols, knobs["split"], knobs["threads"], knobs["vec"])
            assert k.name == "kf_softmax_cluster" and k.cluster == n == k.grid[0] and k.grid[1] == rows
            assert n <= 16 and it * knobs["vec"] <= softmax_template.SPLIT_REGS and (n - 1) * ch < cols <= n * ch
    older = dataclasses.replace(H200, arch="sm_80")  # no clusters before sm_90
    assert not any(s["algo"] == ("split_cluster",) for s in softmax_template.spaces(card, older))
