"""Region cards captured on the GPU get generated kernels that the evaluator accepts (fresh
input sets, poisoned outputs, tolerance from eager's own error, against the subgraph's replay):
a pointwise chain, views of inputs read in place, a rotary chain with repeat_kv's broadcast of a
computed value, a GQA rotary chain whose outputs have two shapes (one kernel each), the whole
rotary embedding with its cats (one kernel per slab and shape), a cat of three odd-width pieces,
q/k/v unbound at three offsets of one tensor, a reduction with a prologue, a pooling with its
epilogue, and two reductions over the same elements folded in one pass; a 1-D pooling (squeezed
before its epilogue) and a reduction over a size-1 dim (pointwise); inputs transposed to the outputs
(tiled through shared memory)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from norm_models import (BatchNormReluPool, ClassTokenOfPatches, GeluMul, GlobalResponseNorm, PatchMerging, SqueezeExcite,
                         WindowReverseNorm)
from test_codegen_regions import (AddTransposed, AttentionOutPlusLocal, ChannelsLastNormBack, EcaGateAfterBias,
                                  NormalizeLinear, RotaryKeysRepeatedFirst, SwinResidualWindows, SwinWindows,
                                  UpsampledSum, WindowPartitionAfterNorm, rotate_half)
from test_codegen_concat import DenseLayerInput, GhostModuleTail

from kforge.capturing import capture
from kforge.cards import decode_value
from kforge.evaluate import make_evaluator
from kforge.hardware import current
from kforge.proposers.base import ProposalContext
from kforge.proposers.builtin import BuiltinProposer, generated
from kforge.proposers.builtin import space as knob_space

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
FAST = dict(min_reps=5, min_ms=0.0, warmup_ms=0.0, fresh_sets=3)


class PoolThenBias(nn.Module):
    def forward(self, x, b):
        return torch.sigmoid(F.avg_pool2d(x, 2) + b.view(1, -1, 1, 1))


class Pool1dThenGelu(nn.Module):  # avg_pool1d: unsqueeze, a 2-D pooling, then a squeeze before the epilogue
    def forward(self, x):
        return F.gelu(F.avg_pool1d(x.unsqueeze(1), 4).squeeze(1)) * 2.0


class LogSumExpOfOne(nn.Module):  # a reduction over a size-1 dim: pointwise, so the residual broadcasts
    def forward(self, m, x):
        return F.gelu(torch.logsumexp(m, dim=1, keepdim=True)) + x


class SiluMul(nn.Module):
    def forward(self, a, b):
        return F.silu(a) * b


class ViewsOfInputs(nn.Module):
    def forward(self, a, b):
        return torch.sigmoid(a.view(64, 32, 128)) * b.unsqueeze(-1)


class Rstd(nn.Module):
    def forward(self, x):
        return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)


class RotaryRepeatKV(nn.Module):
    """The Gemma layer's rotary chain in bf16 (batch 1, one KV head, as the example layer has):
    cos/sin of the positions' angles, the rotation of the (transposed) queries and keys, and
    repeat_kv's unsqueeze + expand + clone of the keys."""

    def forward(self, emb, q, k, q_rot, k_rot):
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q_out = q * cos + q_rot * sin
        k_out = k * cos + k_rot * sin
        return q_out, k_out[:, :, None].expand(1, 1, 8, 128, 64).contiguous()


class RotaryGQA(nn.Module):
    """transformers' apply_rotary_pos_emb with 8 query and 2 key heads in bf16: the region's q and
    k outputs have different shapes, one generated kernel each; cos and sin feed a matmul too."""

    def forward(self, freqs, q, q_rot, k, k_rot, w):
        c, s = freqs.cos().to(q.dtype), freqs.sin().to(q.dtype)
        cos, sin = c.unsqueeze(1), s.unsqueeze(1)
        return q * cos + q_rot * sin, k * cos + k_rot * sin, c.unsqueeze(1) @ w, s.unsqueeze(1) @ w


class QKVSplit(nn.Module):
    """timm's attention after the qkv projection, bf16: q, k and v unbound from one tensor (views
    at three offsets), q scaled, all three made contiguous."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(384, 3 * 384, dtype=torch.bfloat16, device="cuda")

    def forward(self, x):
        q, k, v = self.qkv(x).reshape(8, 197, 3, 6, 64).permute(2, 0, 3, 1, 4).unbind(0)
        return (q * 0.125).contiguous(), k.contiguous(), v.contiguous()


class RotaryWhole(nn.Module):
    """transformers' rotary embedding from the positions on, bf16, GQA: the angles' outer product,
    cat(freqs, freqs), cos and sin cast down, rotate_half's cat(-x2, x1) of q and k: two slabs of
    the last dim, each a kernel per head count."""

    def forward(self, inv_freq, pos, q, k):
        freqs = (inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class ClassTokenCat(nn.Module):
    """ViT's class token expanded over the batch (stride 0) and cat before the patches."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 768, device="cuda", dtype=torch.bfloat16))

    def forward(self, x):
        return torch.cat((self.token.expand(x.shape[0], -1, -1), x), dim=1)


class CatOfThree(nn.Module):
    """A cat alone (a card of its own, and with the sigmoid before it a region), pieces of odd
    widths along a middle dim."""

    def forward(self, a, b, c):
        return torch.cat((torch.sigmoid(a), b, c), dim=1)


def _gqa_inputs():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k = torch.randn(2, 8, 128, 64, **bf16), torch.randn(2, 2, 128, 64, **bf16)
    return (torch.randn(1, 128, 64, device="cuda"), q, torch.randn_like(q), k, torch.randn_like(k),
            torch.randn(64, 64, **bf16))


def _rotary_inputs():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 128, 8, 64, **bf16).transpose(1, 2)  # (B, H, S, D) viewed from (B, S, H, D)
    k = torch.randn(1, 128, 1, 64, **bf16).transpose(1, 2)
    return (torch.randn(128, 64, device="cuda"), q, k, torch.randn_like(q), torch.randn_like(k))


def _dense_features(memory_format):
    return tuple(torch.randn(32, c, 28, 28, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=memory_format)
                 for c in [64] + [32] * 12)


CASES = {
    "rotary_repeat_kv_bf16": (RotaryRepeatKV, _rotary_inputs),
    "rotary_gqa_two_shapes_bf16": (RotaryGQA, _gqa_inputs),
    "qkv_unbind_at_offsets_bf16": (QKVSplit, lambda: (torch.randn(8, 197, 384, device="cuda", dtype=torch.bfloat16),)),
    "silu_mul": (SiluMul, lambda: (torch.randn(64, 4096, device="cuda"), torch.randn(64, 4096, device="cuda"))),
    "views_of_inputs": (ViewsOfInputs, lambda: (torch.randn(2048, 128, device="cuda"),
                                                torch.randn(64, 32, device="cuda"))),
    "rotary_whole_with_cats_bf16": (RotaryWhole, lambda: (
        1.0 / 10000 ** (torch.arange(0, 64, 2, device="cuda") / 64), torch.arange(128, device="cuda")[None],
        torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16))),
    "cat_of_three_odd_widths": (CatOfThree, lambda: (torch.randn(16, 3, 1000, device="cuda"),
                                                     torch.randn(16, 7, 1000, device="cuda").transpose(1, 2).contiguous().transpose(1, 2),
                                                     torch.randn(16, 5, 1000, device="cuda"))),
    "rotary_keys_repeated_before_the_queries_bf16": (RotaryKeysRepeatedFirst, lambda: (
        torch.randn(1, 32, 128, device="cuda"), torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16))),
    # inputs transposed to the outputs, tiled through shared memory: ViT-B/16's patches at batch 8
    # (edge tiles of 4 tokens), an odd channels-last permute in fp32, and int64
    "class_token_beside_nchw_patches_bf16": (lambda: ClassTokenOfPatches(768, 196).to("cuda", torch.bfloat16), lambda: (
        torch.randn(8, 768, 14, 14, device="cuda", dtype=torch.bfloat16),)),
    "add_of_a_channels_last_transpose": (AddTransposed, lambda: (torch.randn(4, 1000, 99, device="cuda"),
                                                                 torch.randn(4, 99, 1000, device="cuda"))),
    "add_of_a_transposed_int64": (AddTransposed, lambda: (torch.randint(-9, 9, (3, 333, 65), device="cuda"),
                                                          torch.randint(-9, 9, (3, 65, 333), device="cuda"))),
    "rstd_bf16": (Rstd, lambda: (torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16),)),
    # a pooling's epilogue (KernelBench level 2's max pool then hardtanh) in the pooling's kernel
    "max_pool_then_hardtanh": (lambda: nn.Sequential(nn.MaxPool2d(2), nn.Hardtanh()),
                               lambda: (torch.randn(8, 64, 128, 128, device="cuda"),)),
    "avg_pool_then_a_channel_bias_channels_last": (PoolThenBias, lambda: (
        torch.randn(8, 64, 56, 56, device="cuda").to(memory_format=torch.channels_last), torch.randn(64, device="cuda"))),
    "avg_pool1d_squeezed_then_gelu": (Pool1dThenGelu, lambda: (torch.randn(256, 4096, device="cuda"),)),
    # ResNet's stem at an odd size: batch norm and relu staged once per input point in a tile
    "bn_relu_max_pool_tiled_bf16": (lambda: BatchNormReluPool(64).eval().to(device="cuda", dtype=torch.bfloat16), lambda: (torch.randn(4, 64, 113, 111, device="cuda", dtype=torch.bfloat16),)),
    # GELU's tanh form through the fast exp and division (bf16 outputs)
    "gelu_tanh_mul_bf16": (GeluMul, lambda: (torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16) * 4,
                                             torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16))),
    "logsumexp_over_a_size_1_dim": (LogSumExpOfOne, lambda: (torch.randn(512, 1, device="cuda"),
                                                             torch.randn(512, 4096, device="cuda"))),
    # Swin-T's first stage at batch 4: the window reverse's merging views (the second to (B, H*W, C))
    # with the residual add and the norm, and the patch merging, on the finer domain
    "window_reverse_flat_norm_bf16": (lambda: WindowReverseNorm(96, 7, flat=True).eval().to("cuda", torch.bfloat16), lambda: (
        torch.randn(4 * 64, 49, 96, device="cuda", dtype=torch.bfloat16),
        torch.randn(4, 56, 56, 96, device="cuda", dtype=torch.bfloat16))),
    "patch_merging_bf16": (lambda: PatchMerging(96).eval().to("cuda", torch.bfloat16), lambda: (
        torch.randn(4, 56, 56, 96, device="cuda", dtype=torch.bfloat16),)),
    # SDPA's masked softmax (its math path): rows masked whole come out 0
    "safe_softmax_of_a_masked_sum": (lambda: MaskedSafeSoftmax(), lambda: (
        torch.randn(64, 4, 49, 49, device="cuda", dtype=torch.bfloat16),
        torch.where(torch.rand(4, 49, 49, device="cuda") > 0.9, -math.inf, 0.0).to(torch.bfloat16))),
    # a layer norm over an NCHW sum's channels, permuted back and made contiguous (MaxViT's)
    "norm_permuted_back_and_made_contiguous_bf16": (lambda: ChannelsLastNormBack(64).to("cuda", torch.bfloat16), lambda: (
        torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.bfloat16),
        torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.bfloat16))),
    # Swin-T's and MaxViT's window partitions after a layer norm (batch 4, 56x56x96, 7x7 windows)
    "window_partition_after_a_norm_bf16": (lambda: WindowPartitionAfterNorm(False, 96, 7).to("cuda", torch.bfloat16), lambda: (
        torch.randn(4, 56, 56, 96, device="cuda", dtype=torch.bfloat16),)),
    "window_partition_by_transpose_bf16": (lambda: WindowPartitionAfterNorm(True, 96, 7).to("cuda", torch.bfloat16), lambda: (
        torch.randn(4, 56, 56, 96, device="cuda", dtype=torch.bfloat16),)),
    # timm's Swin-T block up to its windows (norm1, F.pad of zeros, the partition), 3x3 windows here
    "swin_norm_zero_pad_and_partition_bf16": (lambda: SwinWindows(c=96).to("cuda", torch.bfloat16), lambda: (
        torch.randn(32, 57, 57, 96, device="cuda", dtype=torch.bfloat16),)),
    # DenseNet's layer input: the cat of 13 feature maps into batch norm and ReLU, bf16, NCHW and channels-last
    "densenet_cat_batch_norm_relu_bf16": (lambda: DenseLayerInput(64 + 12 * 32).to("cuda", torch.bfloat16),
                                          lambda: _dense_features(torch.contiguous_format)),
    "densenet_cat_batch_norm_relu_channels_last_bf16": (lambda: DenseLayerInput(64 + 12 * 32).to("cuda", torch.bfloat16),
                                                        lambda: _dense_features(torch.channels_last)),
    # GhostNet's module end: the cheap features' batch norm, their cat with the primary ones, sliced whole, plus the shortcut
    "ghost_module_tail_bf16": (lambda: GhostModuleTail(40).to("cuda", torch.bfloat16), lambda: tuple(
        torch.randn(32, c, 28, 28, device="cuda", dtype=torch.bfloat16) for c in (40, 40, 80))),
    # ConvNeXt-V2-T's first global response norm (channels-last, as the 1x1 conv before it writes it):
    # the mean of the channels' norms, folded again at each pixel, scales the map
    "convnextv2_global_response_norm_bf16": (lambda: GlobalResponseNorm(384).to("cuda", torch.bfloat16), lambda: (
        torch.randn(32, 384, 56, 56, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last),)),
    # Swin-T's third stage between blocks (batch 32, 14x14 tokens of 384, bf16): the residual sum written
    # beside its norm's windows
    "swin_residual_sum_beside_its_windows_bf16": (
        lambda: SwinResidualWindows(384, 14, 14, ws=7).to("cuda", torch.bfloat16),
        lambda: tuple(torch.randn(32, 196, 384, device="cuda", dtype=torch.bfloat16) for _ in range(2))),
    # EfficientFormerV2-S0's last-stage attention output at batch 32: 8 heads x 128 dims over 7x7, split and
    # merged into the map, plus the local value scaled per channel
    "efficientformerv2_attention_out_bf16": (lambda: AttentionOutPlusLocal(8, 128, 7, 7).to("cuda", torch.bfloat16),
                                             lambda: (torch.randn(32, 8, 49, 128, device="cuda", dtype=torch.bfloat16),
                                                      torch.randn(32, 1024, 7, 7, device="cuda", dtype=torch.bfloat16))),
    # a feature pyramid's top-down merge: the coarser map upsampled x2 (nearest) plus the finer, channels-last
    "fpn_upsampled_sum_bf16": (lambda: UpsampledSum(), lambda: tuple(
        torch.randn(32, 256, s, s, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        for s in (28, 56))),
    # ECA-NFNet-L0's second-stage block end (batch 32, 512 x 28 x 28, channels-last bf16): the bias add,
    # ECA's gate viewed from (B, 1, C) to (B, C, 1, 1), the gains and the shortcut
    "nfnet_eca_gate_after_the_bias_bf16": (lambda: EcaGateAfterBias(512).to("cuda", torch.bfloat16), lambda: tuple(
        t.to(memory_format=torch.channels_last) if t.dim() == 4 else t for t in (
            torch.randn(32, 512, 28, 28, device="cuda", dtype=torch.bfloat16),
            torch.randn(32, 1, 512, device="cuda", dtype=torch.bfloat16),
            torch.randn(32, 512, 28, 28, device="cuda", dtype=torch.bfloat16)))),
    # F.normalize: the row's norm expanded back over the row it divides
    "normalize_rows": (lambda: NormalizeLinear().cuda(), lambda: (torch.randn(4096, 50, device="cuda"),)),
    # sibling reductions: the two distances of a triplet loss folded in one pass
    "triplet_margin_loss_distances": (lambda: nn.TripletMarginLoss(margin=1.0),
                                      lambda: tuple(torch.rand(1024, 1000, device="cuda") for _ in range(3))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_region_kernel_passes_the_evaluator(tmp_path, name):
    model, make_inputs = CASES[name]
    with torch.no_grad():
        r = capture(model(), make_inputs(), tmp_path, regions=True)
    regions = [c for c in r.cards if c.region is not None and c.region.kind == "fused"]
    card = max(regions, key=lambda c: len(c.region.ops))  # the GQA case's q and k chain, not its cos or sin
    hw = current()
    assert BuiltinProposer().supports(card) == (True, "")
    first = BuiltinProposer().propose(ProposalContext(card, hw)).candidate
    # and each generated algorithm's most aggressive setting
    others = [generated.build(card, knob_space.configs(s)[-1], hw) for s in generated.spaces(card, hw)]
    with make_evaluator(tmp_path, devices=[0], timeout_s=20.0, **FAST) as ev:
        for cand in [first] + others:
            res = ev.evaluate(card, cand)
            assert not res.verdict.failed, f"{card.summary()} {cand.knobs}: {res.verdict.value}: {res.message}"


def test_a_cat_of_a_broadcast_class_token_passes_the_evaluator(tmp_path):
    """The evaluator's fresh inputs for the expanded token are drawn over its storage (it failed
    every candidate on the H100 writing through the expanded view)."""
    with torch.no_grad():
        r = capture(ClassTokenCat(), (torch.randn(32, 196, 768, device="cuda", dtype=torch.bfloat16),), tmp_path)
    (card,) = [c for c in r.cards if c.op == "aten::cat.default"]
    assert card.inputs[0].stride[0] == 0
    hw = current()
    with make_evaluator(tmp_path, devices=[0], timeout_s=20.0, **FAST) as ev:
        res = ev.evaluate(card, generated.build(card, generated.default(card, hw), hw))
        assert not res.verdict.failed, f"{res.verdict.value}: {res.message}"


def test_a_generated_cat_card_passes_the_evaluator_at_every_vector_width(tmp_path):
    """The cat call alone: three copies into slabs at element offsets 0, 3000 and 10000 of each
    row (the second piece strided), each kernel at the widest vector its slab allows."""
    model, make_inputs = CASES["cat_of_three_odd_widths"]
    with torch.no_grad():
        r = capture(model(), make_inputs(), tmp_path)
    (card,) = [c for c in r.cards if c.op == "aten::cat.default"]
    hw = current()
    assert BuiltinProposer().supports(card) == (True, "")
    (space,) = generated.spaces(card, hw)
    with make_evaluator(tmp_path, devices=[0], timeout_s=20.0, **FAST) as ev:
        for vec in space["vec"]:
            cand = generated.build(card, {**generated.default(card, hw), "vec": vec}, hw)
            res = ev.evaluate(card, cand)
            assert not res.verdict.failed, f"vec {vec}: {res.verdict.value}: {res.message}"


class MaskedSafeSoftmax(nn.Module):
    def forward(self, x, mask):
        return torch.ops.aten._safe_softmax(x + mask, -1)


class ShiftedWindows(nn.Module):
    def forward(self, x):
        return torch.roll(x, shifts=(-3, -3), dims=(1, 2))


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_generated_roll_card_passes_the_evaluator_at_every_vector_width(tmp_path, channels_last):
    """Swin-T's shifted windows at batch 4 (bf16, 56x56x96): the roll along two dims as four block
    copies in one launch; and the same roll of an NCHW-shaped channels-last tensor."""
    x = torch.randn(4, 56, 56, 96, device="cuda", dtype=torch.bfloat16)
    if channels_last:
        x = x.permute(0, 3, 1, 2)  # (4, 96, 56, 56), channels-last in memory; rolled along dims 1, 2
    with torch.no_grad():
        r = capture(ShiftedWindows(), (x,), tmp_path)
    # eager's roll along two dims calls itself once per dim: the outer call is the card
    (card,) = [c for c in r.cards if c.op == "aten::roll.default" and len(next(decode_value(a.value) for a in c.args if a.name == "dims")) == 2]
    hw = current()
    assert BuiltinProposer().supports(card) == (True, "")
    with make_evaluator(tmp_path, devices=[0], timeout_s=20.0, **FAST) as ev:
        for space in generated.spaces(card, hw):
            for vec in space["vec"]:
                knobs = {**{k: v[0] for k, v in space.items()}, "vec": vec}
                res = ev.evaluate(card, generated.build(card, knobs, hw))
                assert not res.verdict.failed, f"{knobs}: {res.verdict.value}: {res.message}"


def test_a_squeeze_excite_mean_with_its_silu_written_beside_it_passes_the_evaluator(tmp_path):
    """EfficientNet-B0's third stage at batch 8, channels-last bf16: batch norm -> SiLU written
    beside its mean over the pixels (a shared region), by default one column kernel that stores
    the SiLU a vector of channels at a time; every gen_cols_block setting's widest, too."""
    model = SqueezeExcite(144).eval().to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 144, 56, 56, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        r = capture(model, (x,), tmp_path, regions=True)
    (card,) = [c for c in r.cards if c.region is not None and c.region.kind == "shared"]
    hw = current()
    knobs = generated.default(card, hw)
    assert knobs["algo"] == "gen_cols_block"
    (block,) = [s for s in generated.spaces(card, hw) if s["algo"] == ("gen_cols_block",)]
    with make_evaluator(tmp_path, devices=[0], timeout_s=20.0, **FAST) as ev:
        for k in (knobs, knob_space.configs(block)[-1]):
            res = ev.evaluate(card, generated.build(card, k, hw))
            assert not res.verdict.failed, f"{k}: {res.verdict.value}: {res.message}"
