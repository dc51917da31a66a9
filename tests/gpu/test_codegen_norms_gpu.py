"""Normalization regions and cards captured on the GPU get generated kernels (gen_norm: one
kernel per region) that the evaluator accepts: fresh input sets, poisoned outputs, tolerance
from eager's own error, against the subgraph's replay. Every staging (registers, shared
memory, reading the row again) and lane count (a thread, 8, a warp, the block per row) of
the cooperative kernel runs here, which the CPU tests can only compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from norm_models import (AddLayerNormGelu, AddRMSNorm, BatchNormAddReluMean, BatchNormReluAdd, BatchNormReluPool, FrobeniusNormalize, GroupNormSilu,
                         InstanceNormRelu, TemperatureLogSoftmax,
                         MaskSoftmax, ResidualStream, ScaleAddLayerNorm2d, ScaleSoftmax, WindowMaskSoftmax)

from kforge.capturing import capture
from kforge.codegen import lower
from kforge.evaluate import make_evaluator
from kforge.hardware import current
from kforge.proposers.base import ProposalContext
from kforge.proposers.builtin import BuiltinProposer, generated

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
FAST = dict(min_reps=5, min_ms=0.0, warmup_ms=0.0, fresh_sets=3)
BF16 = torch.bfloat16


def cuda(*shape, dtype=torch.float32, channels_last=False):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    return x.to(memory_format=torch.channels_last) if channels_last else x


def _half(m):
    return m.to(dtype=BF16)


CASES = {
    "mask softmax bf16 (gemma)": (MaskSoftmax, lambda: (cuda(2, 8, 128, 129, dtype=BF16), cuda(2, 1, 128, 129, dtype=BF16))),
    "scale softmax 1-element rows": (ScaleSoftmax, lambda: (cuda(300, 1),)),
    "scale softmax 3x70001 (longer than a block)": (ScaleSoftmax, lambda: (cuda(3, 70001),)),
    "temperature log_softmax 257x1000": (TemperatureLogSoftmax, lambda: (cuda(257, 1000),)),
    # a residual sum read after the region too, with the layer norm it feeds (a shared region)
    "residual add layer_norm bf16 (shared)": (lambda: _half(ResidualStream(768)),
                                              lambda: (cuda(4, 197, 768, dtype=BF16), cuda(4, 197, 768, dtype=BF16))),
    # rows of an odd length, each starting at another offset from a 16-byte boundary: peeled
    "scale softmax 300x4099 (odd rows)": (ScaleSoftmax, lambda: (cuda(300, 4099),)),
    "add layer_norm gelu 4099 bf16 (odd rows)": (lambda: _half(AddLayerNormGelu(4099)),
                                                 lambda: (cuda(2, 33, 4099, dtype=BF16), cuda(2, 33, 4099, dtype=BF16))),
    "add layer_norm gelu 4096 bf16": (lambda: _half(AddLayerNormGelu(4096)),
                                      lambda: (cuda(3, 77, 4096, dtype=BF16), cuda(3, 77, 4096, dtype=BF16))),
    "add layer_norm gelu 33": (lambda: AddLayerNormGelu(33), lambda: (cuda(129, 33), cuda(129, 33))),
    "add rms_norm 2304 bf16": (lambda: _half(AddRMSNorm(2304)), lambda: (cuda(2, 65, 2304, dtype=BF16),
                                                                          cuda(2, 65, 2304, dtype=BF16))),
    "group_norm silu sd-vae channels_last": (lambda: GroupNormSilu(128, 32),
                                             lambda: (cuda(1, 128, 32, 32, channels_last=True),)),
    "group_norm silu one image (few long rows: one cooperative launch)": (
        lambda: GroupNormSilu(128, 32), lambda: (cuda(1, 128, 64, 64),)),
    "group_norm silu sd-vae bf16 (few long rows)": (lambda: _half(GroupNormSilu(512, 32)),
                                                    lambda: (cuda(1, 512, 128, 128, dtype=BF16),)),
    "group_norm silu bf16 odd plane": (lambda: _half(GroupNormSilu(96, 32)), lambda: (cuda(2, 96, 13, 7, dtype=BF16),)),
    "batch_norm relu max_pool resnet stem bf16 channels_last": (
        lambda: _half(BatchNormReluPool(64)).eval(), lambda: (cuda(2, 64, 56, 57, dtype=BF16, channels_last=True),)),
    "batch_norm relu avg_pool odd": (lambda: BatchNormReluPool(6, avg=True).eval(), lambda: (cuda(3, 6, 9, 13),)),
    "batch_norm relu add odd channels_last": (lambda: BatchNormReluAdd(24).eval(),
                                              lambda: (cuda(3, 24, 7, 9, channels_last=True),
                                                       cuda(3, 24, 7, 9, channels_last=True))),
    "batch_norm relu add resnet bf16 channels_last": (
        lambda: _half(BatchNormReluAdd(64)).eval(),
        lambda: (cuda(4, 64, 28, 28, dtype=BF16, channels_last=True), cuda(4, 64, 28, 28, dtype=BF16, channels_last=True))),
    # a column of channels a thread, slices of the pixels merged in shared memory (gen_cols_block)
    "batch_norm add relu mean resnet head bf16 channels_last": (
        lambda: _half(BatchNormAddReluMean(2048)).eval(),
        lambda: (cuda(32, 2048, 7, 7, dtype=BF16, channels_last=True), cuda(32, 2048, 7, 7, dtype=BF16, channels_last=True))),
    "instance_norm relu": (lambda: InstanceNormRelu(16, affine=True), lambda: (cuda(2, 16, 9, 11),)),
    "window mask softmax (swin, one image)": (WindowMaskSoftmax, lambda: (cuda(64, 3, 49, 49), cuda(3, 49, 49),
                                                                           cuda(64, 49, 49))),
    "scale add layer_norm over channels (convnext) bf16": (lambda: _half(ScaleAddLayerNorm2d(96)),
                                                           lambda: (cuda(4, 96, 28, 28, dtype=BF16), cuda(4, 96, 28, 28, dtype=BF16))),
    # a norm over every dim (KernelBench's FrobeniusNorm): one row of all 16384 elements (a thread per
    # row folds them in sequence, as it does SD-VAE's 16384-long softmax rows)
    "frobenius normalize": (FrobeniusNormalize, lambda: (cuda(4, 16, 16, 16),)),
}


def _variants(card, hw):
    """The proposer's first candidate, then each staging and lane count of the one-kernel form,
    the two-pass split form and, where it is offered, the one cooperative launch."""
    base = generated.default(card, hw)
    if base["algo"] == "gen_flat":  # a channels-last norm's parameters read along the inner dim
        return [base, {**base, "vec": 1, "items": 4}, {**base, "threads": 64, "items": 8, "grid": "stride"}]
    if base["algo"] == "gen_cols_block":  # one output a thread and two slices; more slices, fewer threads
        return [base, {**base, "ty": 2, "items": 1, "vec": 1}, {**base, "threads": 128, "ty": 16, "items": 4}]
    if not base["algo"].startswith("gen_norm"):
        return [base]
    out = [base]
    coop = [s for s in generated.spaces(card, hw) if s["algo"] == ("gen_norm_coop",)]
    if coop:  # the cooperative form at its narrowest
        out.append({"algo": "gen_norm_coop", "threads": coop[0]["threads"][0], "items": 1, "vec": 1})
    if base["algo"] in ("gen_norm_split", "gen_norm_coop"):  # few long rows' forms, then the one-kernel form
        base = {"algo": "gen_norm", "threads": 1024, "lanes": "block", "vec": base["vec"], "staging": "reload"}
        out.append(base)
    for name, values in (("staging", ("regs", "smem", "reload")), ("lanes", (1, 8, 32, "block"))):
        out += [{**base, name: v} for v in values if v != base[name]]
    split = [v for v in generated.spaces(card, hw)[1]["split"] if v <= 8][-1]
    out.append({"algo": "gen_norm_split", "threads": 256, "items": 4, "split": split, "vec": base["vec"]})
    # rows of an odd length: peeled to aligned vectors, a warp and a block a row
    peeled = [{**base, "lanes": lanes, "vec": v, "staging": "reload"} for v in lower.peel_vecs(generated.program(card))
              for lanes in (32, "block")]
    return out + [{**base, "vec": 1}] + peeled


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_norm_region_passes_the_evaluator(tmp_path, name):
    model, make_inputs = CASES[name]
    with torch.no_grad():
        r = capture(model().cuda(), make_inputs(), tmp_path, regions=True)
    cards = [c for c in r.cards if c.region is not None and c.region.kind in ("fused", "shared")]  # not a conv's epilogue
    assert cards, f"no region captured: {[c.op for c in r.cards]} {r.notes}"
    hw = current()
    with make_evaluator(tmp_path, devices=[0], timeout_s=30.0, **FAST) as ev:
        for card in cards:
            assert BuiltinProposer().supports(card) == (True, ""), card.region.ops
            first = BuiltinProposer().propose(ProposalContext(card, hw)).candidate
            assert first.note == "generated", card.region.ops
            if "batch_norm" not in name:
                assert first.knobs["algo"].startswith("gen_norm"), (card.region.ops, first.knobs)
            for cand in [first] + [generated.build(card, k, hw) for k in _variants(card, hw)[1:]]:
                res = ev.evaluate(card, cand)
                assert not res.verdict.failed, f"{card.summary()} {cand.knobs}: {res.verdict.value}: {res.message}"


SINGLE = {
    "softmax bf16": (lambda x: torch.softmax(x, -1), lambda: (cuda(64, 4099, dtype=BF16),)),
    "softmax to fp32": (lambda x: torch.softmax(x, -1, dtype=torch.float32), lambda: (cuda(64, 1024, dtype=BF16),)),
    "layer_norm": (lambda x: F.layer_norm(x, (768,)), lambda: (cuda(511, 768),)),
    "group_norm 2-D": (lambda x: F.group_norm(x, 4), lambda: (cuda(37, 64),)),
}


class Fn(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *xs):
        return self.f(*xs)


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_generated_norm_card_passes_the_evaluator_beside_the_template(tmp_path, name):
    """A single-op norm card: the template's default stays first; the generator's gen_norm is
    among the proposer's algorithms and passes the same checks."""
    f, make_inputs = SINGLE[name]
    with torch.no_grad():
        r = capture(Fn(f), make_inputs(), tmp_path)
    hw = current()
    cards = [c for c in r.cards if generated.check(c) is None and generated.program(c).normalizes]
    assert cards, [c.op for c in r.cards]
    with make_evaluator(tmp_path, devices=[0], timeout_s=30.0, **FAST) as ev:
        for card in cards:
            for k in _variants(card, hw):
                cand = generated.build(card, k, hw)
                res = ev.evaluate(card, cand)
                assert not res.verdict.failed, f"{card.summary()} {cand.knobs}: {res.verdict.value}: {res.message}"
