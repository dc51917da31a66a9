"""The built-in templates on a real GPU: every algorithm of every template against eager on
fresh inputs, with poisoned outputs, unchanged inputs (unless in-place) and bitwise
repeatable results, over odd sizes, 1-element rows, rows longer than a block, widths that
are not a multiple of the vector, channels_last, broadcast and in-place cards."""

from __future__ import annotations

import random

import pytest
import torch

from builtin_cards import GN_COOP, SPREAD, fresh_inputs, make_card, meta, softmax, A, BF16, F16
from kforge import compiler, runtime
from kforge.cards import empty_like_meta, faithful_clone
from kforge.errors import LaunchError
from kforge.hardware import current
from kforge.proposers.builtin import template_for
from kforge.proposers.builtin import space as knob_space

pytestmark = pytest.mark.gpu

# Tight: one rounding of the output plus fp32 reduction-order noise.
TOL = {"float32": dict(rtol=2e-5, atol=2e-5), "float16": dict(rtol=2e-3, atol=1e-3),
       "bfloat16": dict(rtol=1.6e-2, atol=1e-2)}


def settings(card, n_random: int = 2):
    """The default, each algorithm's two corners, and a few random settings (seeded)."""
    hw = current()
    template = template_for(card)
    out = [template.default(card, hw)]
    rng = random.Random(card.id)
    for s in template.spaces(card, hw):
        configs = knob_space.configs(s)
        out += [configs[0], configs[-1]] + rng.sample(configs, min(n_random, len(configs)))
    unique = []
    for k in out:
        if k not in unique:
            unique.append(k)
    return template, hw, unique


def run(card, cand, inputs):
    """Launch the candidate on copies of `inputs`; returns (outputs, inputs after the launch)."""
    dev = inputs[0].device
    ins = [faithful_clone(t) for t in inputs]
    plan = runtime.build_plan(cand, compiler.compile(cand.source, options=cand.plan.options).cubin, dev.index or 0)
    outs = []
    for j, m in enumerate(card.outputs):
        if j in card.aliases:
            outs.append(ins[card.aliases[j]])
        else:
            t = empty_like_meta(m, dev)
            if t.is_floating_point():
                t.fill_(float("nan"))  # every element must be written (cuDNN's uint8 reserve is not)
            outs.append(t)
    runtime.launch(plan, ins, outs, runtime.alloc_workspaces(cand.plan, dev))
    torch.cuda.synchronize()
    return outs, ins


def check_candidate(card, cand, seed: int) -> None:
    inputs = fresh_inputs(card, seed)
    ref = card.call_eager([faithful_clone(t) for t in inputs], "cuda")
    outs, after = run(card, cand, inputs)
    for j, (got, want) in enumerate(zip(outs, ref)):
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride(), f"output {j}"
        assert not got.isnan().any() or want.isnan().any(), f"output {j} has unwritten (NaN) elements"
        tol = TOL.get(card.outputs[j].dtype, dict(rtol=0, atol=0))  # exact for cuDNN's (empty) uint8 reserve
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{cand.knobs}: output {j}: {m}")
    for i, (a, b) in enumerate(zip(inputs, after)):
        if i not in card.aliases.values():
            assert torch.equal(a, b), f"input {i} was modified"
    again, _ = run(card, cand, inputs)
    for j, (x, y) in enumerate(zip(outs, again)):
        assert torch.equal(x, y), f"output {j} differs between two runs"


@pytest.mark.parametrize("name", sorted(SPREAD))
def test_template_matches_eager(name):
    card = SPREAD[name]()
    try:
        card.overload()
    except Exception as e:  # e.g. _fused_rms_norm on an older torch
        pytest.skip(str(e))
    template, hw, knobs_list = settings(card)
    for seed, knobs in enumerate(knobs_list):
        check_candidate(card, template.build(card, knobs, hw), seed)


def test_unaligned_view_uses_narrow_vectors_and_is_correct():
    card = make_card(A.gelu.default, meta(4097, dtype=BF16), align=2)
    template, hw, knobs_list = settings(card)
    assert {k["vec"] for k in knobs_list} == {1}
    for seed, knobs in enumerate(knobs_list):
        check_candidate(card, template.build(card, knobs, hw), seed)


# Long softmax rows through split_regs (two kernels, chunks in registers): every setting of
# the benchmark shape, a sample of the others.
LONG_ROWS = {
    "f32_8x262144": (lambda: softmax(8, 262144), None),
    "bf16_8x262144": (lambda: softmax(8, 262144, dtype=BF16), 12),
    "odd_3x100003": (lambda: softmax(3, 100003), None),
    "log_3x70000": (lambda: softmax(3, 70000, log=True), 12),
    "log_bf16_4x131072": (lambda: softmax(4, 131072, dtype=BF16, log=True), 8),
    "half_to_float_4x65536": (lambda: softmax(4, 65536, dtype=F16, half_to_float=True), 8),
    "shortest_2x8192": (lambda: softmax(2, 8192), None),
}


def split_regs_settings(card, n: int | None):
    hw = current()
    template = template_for(card)
    (s,) = [s for s in template.spaces(card, hw) if s["algo"] == ("split_regs",)]
    configs = knob_space.configs(s)
    picked = configs if n is None else [configs[0], configs[-1]] + random.Random(card.id).sample(configs, min(n, len(configs)))
    default = template.default(card, hw)
    assert default["algo"] == "split_regs"
    return template, hw, [default] + [k for i, k in enumerate(picked) if k not in picked[:i] and k != default]


@pytest.mark.parametrize("name", sorted(LONG_ROWS))
def test_split_regs_matches_eager_on_long_rows(name):
    factory, n = LONG_ROWS[name]
    card = factory()
    template, hw, knobs_list = split_regs_settings(card, n)
    for seed, knobs in enumerate(knobs_list):
        check_candidate(card, template.build(card, knobs, hw), seed)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("shape, dtype", [((4, 262144), torch.float32), ((3, 100003), torch.float32),
                                          ((4, 65536), torch.bfloat16)])
def test_split_regs_handles_minus_inf_like_torch(shape, dtype, log):
    """Whole chunks of -inf contribute nothing, scattered -inf give 0 (or -inf), a row of
    -inf gives NaN, and a row whose only finite value sits in the last chunk gives one 1."""
    card = softmax(*shape, dtype=dtype, log=log)
    rows, cols = shape
    x = torch.randn(shape, device="cuda", dtype=torch.float32).mul_(8).to(dtype)
    x[0, : cols // 2] = -float("inf")
    x[1, ::7] = -float("inf")
    x[2] = -float("inf")
    if rows > 3:
        x[3] = -float("inf")
        x[3, -1] = 1.0
    want = (torch.log_softmax if log else torch.softmax)(x, -1)
    template, hw, knobs_list = split_regs_settings(card, 6)
    for knobs in knobs_list:
        (got,), _ = run(card, template.build(card, knobs, hw), [x])
        assert got[2].isnan().all()
        torch.testing.assert_close(got, want, equal_nan=True, **TOL[card.outputs[0].dtype],
                                   msg=lambda m: f"{knobs}: {m}")


# split_coop: one cooperative launch with a grid-wide wait per row. Every setting of every
# long-row card; a grid the GPU cannot hold resident is refused at launch (a recoverable
# error), never run, so those settings must fail cleanly or pass.
def every_setting_of(algo: str):
    """settings(card): the template, the hardware and every setting of `algo`'s spaces."""
    def settings(card):
        hw = current()
        template = template_for(card)
        spaces = [s for s in template.spaces(card, hw) if s["algo"] == (algo,)]
        return template, hw, [k for s in spaces for k in knob_space.configs(s)]
    return settings


split_coop_settings = every_setting_of("split_coop")


def check_every_setting_or_refused(card, settings, refused: str) -> None:
    """Every setting `settings(card)` gives matches eager, or its launch is refused (the
    message naming `refused`) and the context stays usable; at least one runs."""
    template, hw, knobs_list = settings(card)
    assert knobs_list, f"no setting for {card.summary()}"
    ran = 0
    for seed, knobs in enumerate(knobs_list):
        cand = template.build(card, knobs, hw)
        try:
            check_candidate(card, cand, seed)
            ran += 1
        except LaunchError as e:
            assert refused in str(e), f"{knobs}: {e}"
        torch.cuda.synchronize()  # a refused launch leaves the context usable
    assert ran, f"no setting could run on {card.summary()}"


@pytest.mark.parametrize("name", sorted(LONG_ROWS))
def test_split_coop_matches_eager_or_is_refused_cleanly(name):
    check_every_setting_or_refused(LONG_ROWS[name][0](), split_coop_settings, "COOPERATIVE_LAUNCH_TOO_LARGE")


def check_minus_inf_or_refused(settings, log: bool, refused: str) -> None:
    """Like split_regs' -inf test, over every setting `settings(card)` gives; a launch the
    driver refuses (its message naming `refused`) is skipped."""
    card = softmax(4, 262144, log=log)
    x = torch.randn(4, 262144, device="cuda").mul_(8)
    x[0, : 262144 // 2] = -float("inf")
    x[1, ::7] = -float("inf")
    x[2] = -float("inf")
    x[3] = -float("inf")
    x[3, -1] = 1.0
    want = (torch.log_softmax if log else torch.softmax)(x, -1)
    template, hw, knobs_list = settings(card)
    for knobs in knobs_list:
        try:
            (got,), _ = run(card, template.build(card, knobs, hw), [x])
        except LaunchError as e:
            assert refused in str(e)
            continue
        assert got[2].isnan().all()
        torch.testing.assert_close(got, want, equal_nan=True, **TOL[card.outputs[0].dtype], msg=lambda m: f"{knobs}: {m}")


@pytest.mark.parametrize("log", [False, True])
def test_split_coop_handles_minus_inf_like_torch(log):
    check_minus_inf_or_refused(split_coop_settings, log, "COOPERATIVE_LAUNCH_TOO_LARGE")


# group_norm coop: one cooperative launch, a wait per (sample, group), part of each chunk
# held in registers. Every setting of the small cards, a sample of the benchmark shapes';
# the geometry keeps every grid resident, so a refused launch is a failure here.
@pytest.mark.parametrize("name", sorted(GN_COOP))
def test_group_norm_coop_matches_eager(name):
    card = GN_COOP[name]()
    hw = current()
    template = template_for(card)
    (s,) = [s for s in template.spaces(card, hw) if s["algo"] == ("coop",)]
    configs = knob_space.configs(s)
    if card.inputs[0].numel > 2**22:
        configs = [configs[0], configs[-1]] + random.Random(card.id).sample(configs, 6)
    for seed, knobs in enumerate(configs):
        check_candidate(card, template.build(card, knobs, hw), seed)


def test_split_regs_pdl_records_into_a_cuda_graph_and_replays():
    """Kernel 2 launched by programmatic dependent launch is captured with its programmatic
    edge and, replayed on new data, still waits for kernel 1's partials."""
    card = softmax(8, 262144)
    hw = current()
    template = template_for(card)
    knobs = template.default(card, hw)
    if "pdl" not in knobs:
        pytest.skip(f"programmatic dependent launch needs sm_90+, this is {hw.arch}")
    cand = template.build(card, {**knobs, "pdl": True}, hw)
    x = torch.randn(8, 262144, device="cuda")
    y = torch.empty_like(x)
    plan = runtime.build_plan(cand, compiler.compile(cand.source, options=cand.plan.options).cubin, x.device.index or 0)
    ws = runtime.alloc_workspaces(cand.plan, x.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runtime.launch(plan, [x], [y], ws)  # warm-up off the default stream, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runtime.launch(plan, [x], [y], ws)
    for seed in range(3):
        x.copy_(torch.randn(8, 262144, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).mul_(4))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, torch.softmax(x, -1), **TOL["float32"])



# split_cluster: a row's chunks are one thread block cluster (barrier and partials in
# hardware). Every setting of every long-row card: a cluster the GPU cannot place (16 blocks
# on one GPC) is refused at launch, never run, so a setting must pass or fail cleanly.
split_cluster_settings = every_setting_of("split_cluster")


@pytest.mark.parametrize("name", sorted(LONG_ROWS))
def test_split_cluster_matches_eager_or_is_refused_cleanly(name):
    check_every_setting_or_refused(LONG_ROWS[name][0](), split_cluster_settings, "CUDA_ERROR_INVALID_CLUSTER_SIZE")


@pytest.mark.parametrize("log", [False, True])
def test_split_cluster_handles_minus_inf_like_torch(log):
    check_minus_inf_or_refused(split_cluster_settings, log, "CUDA_ERROR_INVALID_CLUSTER_SIZE")
