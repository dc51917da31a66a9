"""Region cards through the code generator on the CPU: regions captured from small CPU models
are retargeted to CUDA metadata, lowered to one Program, compiled by NVRTC for sm_90 and
checked against their subgraph's replay through the reference interpreter and through the
generated C itself (g++, tests/cuda_on_cpu.py, which binds the launch plan's arguments as the
GPU would). Views of inputs are read in place, at their offsets; what the generator cannot do is declined with
its reason. Normalization regions (rms_norm, softmax, group norm, ...): test_codegen_norms.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cuda_on_cpu
from builtin_cards import make_card as builtin_card, meta as builtin_meta
from norm_models import BatchNormAddReluMean, ClassTokenOfPatches, GeluMul, GlobalResponseNorm
from kforge import compiler
from kforge.capturing import capture
from kforge.card_files import load_sample
from kforge.codegen import card_program, interp, lower
from kforge.hardware import H200
from kforge.proposers.base import ProposalContext
from kforge.proposers.builtin import BuiltinProposer, generated
from kforge.proposers.builtin import space as knob_space

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class SiluMul(nn.Module):
    def forward(self, a, b):
        return F.silu(a) * b


class AddMul(nn.Module):
    def forward(self, a, b, c):
        return (a + b) * c


class Rstd(nn.Module):
    """RMSNorm's statistics: a cast and a square before the mean (the prologue), eps and rsqrt after."""

    def forward(self, x):
        return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)


class ViewsOfInputs(nn.Module):
    def forward(self, a, b):
        return torch.sigmoid(a.view(4, 8, 6)) * b.unsqueeze(-1).expand(4, 8, 6)


class ViewOfIntermediate(nn.Module):
    def forward(self, a, b):
        return torch.sigmoid(a).view(4, 8, 6) * b


class RepeatKV(nn.Module):
    """A rotary-style product on the queries and keys, then repeat_kv of the keys (GQA): the
    unsqueeze and expand of a computed value, materialized by the clone; two outputs whose
    shapes differ in a leading size-1 dim."""

    def forward(self, emb, q, k):  # in the order the region first reads them (its inputs' order)
        cos, sin = emb.cos(), emb.sin()  # shared by both chains: one region, as in a Gemma layer
        q_out = q * cos + q * sin
        k_out = k * cos + k * sin
        return q_out, k_out[:, :, None].expand(1, 1, 4, 16, 8).contiguous()


class Rotary(nn.Module):
    """transformers' apply_rotary_pos_emb with GQA: q and k have different head counts, so the
    region's two outputs have different shapes (one kernel each); cos and sin are read outside
    the region too (here by a matmul; in a model, by the next layers)."""

    def forward(self, freqs, q, q_rot, k, k_rot, w):
        c, s = freqs.cos() * 1.0, freqs.sin() * 1.0
        cos, sin = c.unsqueeze(1), s.unsqueeze(1)
        return q * cos + q_rot * sin, k * cos + k_rot * sin, c.unsqueeze(1) @ w, s.unsqueeze(1) @ w


class RepeatKVHeads(nn.Module):
    """repeat_kv with two KV heads and a batch of 2: the size-1 dim goes in between."""

    def forward(self, a):
        return torch.sigmoid(a)[:, :, None].expand(2, 2, 4, 8).contiguous()


class SliceOfInput(nn.Module):
    def forward(self, a, b):
        return torch.sigmoid(a[:, 1:]) * b


class QKVSplit(nn.Module):
    """timm's attention after the qkv projection: a reshape and permute of its output, unbind into
    q, k and v (views at three offsets), q scaled, all three made contiguous for the attention."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).reshape(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        return (q * 0.35).contiguous(), k.contiguous(), v.contiguous()


class LinearGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(48, 32)

    def forward(self, x):
        return F.gelu(self.lin(x))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class FullRotary(nn.Module):
    """transformers' rotary embedding whole: the angles are cat(freqs, freqs), rotate_half is
    cat(-x2, x1), and the queries and keys have different head counts (GQA). The cats cut the
    last dim into two slabs, each a kernel per output shape: four kernels, one launch plan."""

    def forward(self, inv_freq, pos, q, k):
        freqs = (inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryKeysRepeatedFirst(nn.Module):
    """Llama's rotary with GQA as CUDA's trace orders it: the keys rotated and repeated (unsqueeze,
    expand, clone: the region moves to the repeat's 5-d domain) before the queries take their own
    unsqueeze of cos and sin (in the queries' dtype). One domain cannot hold both outputs: one
    kernel each, per slab. Any sizes: the keys' heads are repeated to the queries'."""

    def forward(self, freqs, q, k):
        f = freqs.transpose(1, 2)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        ke = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        b, heads, seq, dim = k.shape
        kr = ke[:, :, None].expand(b, heads, q.shape[1] // heads, seq, dim).reshape(q.shape)
        qe = q * cos[:, None] + rotate_half(q) * sin[:, None]
        return qe @ kr.transpose(-1, -2)


class CatOfActivations(nn.Module):
    """A cat of two pointwise values along a middle dim, then more pointwise work."""

    def forward(self, a, b):
        return torch.cat((torch.sigmoid(a), b * 2), dim=1).relu()


class AddTransposed(nn.Module):
    """A contiguous tensor plus three times one whose last two dims are swapped."""

    def forward(self, y, x):
        return y + x.transpose(1, 2) * 3


class CatOfTransposed(nn.Module):
    def forward(self, *xs):
        return torch.cat([x.transpose(1, 2) for x in xs], 1) * 2


class LogSumExpOfOne(nn.Module):
    """KernelBench level 2's Gemm_Subtract_GlobalAvgPool_LogSumExp_GELU_ResidualAdd after its mean:
    a logsumexp over a dim of size 1 folds one element (pointwise), then a residual broadcast over rows."""

    def forward(self, m, x):
        return F.gelu(torch.logsumexp(m, dim=1, keepdim=True)) + x


class LogSumExpOfOnePlus(nn.Module):
    def forward(self, m, x):  # no GELU: eager's CPU GELU of +inf is NaN, its CUDA one's (the table's) inf
        return torch.logsumexp(m, dim=1, keepdim=True) * 2 + x


class MaskedCumsum(nn.Module):
    """KernelBench level 1's masked cumsum: the product is the scan's prologue, one kernel."""

    def forward(self, x, mask):
        return torch.cumsum(x * mask, dim=1)


class NormalisedCDF(nn.Module):
    """A masked cumsum over its row's sum: the sum is a fold of its own, read by the scan's epilogue."""

    def forward(self, x, mask):
        return torch.cumsum(x * mask, -1) / x.sum(-1, keepdim=True)


class Pool1dThenGelu(nn.Module):
    """KernelBench level 2's Matmul_AvgPool_GELU_Scale_Max after its matmul: avg_pool1d is an
    unsqueeze, a 2-D pooling and a squeeze, and the GELU and scale follow the squeeze."""

    def forward(self, x):
        return F.gelu(F.avg_pool1d(x.unsqueeze(1), 4).squeeze(1)) * 2.0


class PoolThenTranspose(nn.Module):
    def forward(self, x):
        return torch.sigmoid(F.max_pool2d(x, 2).transpose(2, 3))


class Pool1dThenPerSampleBias(nn.Module):
    def forward(self, x, b):  # b (N, 1, 1) broadcasts over the squeezed (N, C, L) by sample
        return F.avg_pool1d(x, 4) + b


class SumThenMaxOfOne(nn.Module):
    def forward(self, x, z):  # z.amax(0) folds one element a column: pointwise, read after the sum
        return x.sum(1) + z.amax(0)


class SumTimesSquares(nn.Module):
    """Two reductions over the same elements, the second's prologue (the square) after the first:
    one fold of both (siblings)."""

    def forward(self, x):
        return x.sum(-1) * (x * x).sum(-1)


class WholeSumTimesSquares(nn.Module):
    def forward(self, x):
        return x.sum() * (x * x).sum()


class PoolThenActivation(nn.Module):
    """A pooling's epilogue (KernelBench level 2: max pool then hardtanh, average pool then sigmoid)."""

    def __init__(self, pool, act):
        super().__init__()
        self.pool, self.act = pool, act

    def forward(self, x):
        return self.act(self.pool(torch.sub(x, 0.5)) * 2.0)


class PoolThenInput(nn.Module):
    """A pooling's epilogue that reads an input at each output point (a residual, a per-channel bias)."""

    def forward(self, x, y):
        return F.max_pool2d(x, 2) + y


class PoolThenBias(nn.Module):
    def forward(self, x, b):
        return torch.sigmoid(F.avg_pool2d(x, 2) + b.view(1, -1, 1, 1))


class PoolThenEarlierValue(nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        return F.max_pool2d(y, 1) + y  # a 1x1 pool keeps the shape


class SoftmaxTimesSum(nn.Module):
    def forward(self, x):
        return F.softmax(x, -1) * x.sum(-1, keepdim=True)


class SumsOverOtherDims(nn.Module):
    def forward(self, x):
        return x.sum(0).sum() + x.sum(1).sum()


class MeanTimesCentred(nn.Module):
    def forward(self, x):
        return x.mean(-1, keepdim=True) * (x - x.sum(-1, keepdim=True))


def region_card(tmp_path, model, *inputs, ops=None):
    """The one region card of a CPU capture (with `ops`: the one of those ops), retargeted to an H200."""
    with torch.no_grad():
        r = capture(model, inputs, tmp_path, regions=True, time_cards=False)
    (card,) = [c for c in r.cards if c.region is not None and ops in (None, c.region.ops)]
    return card.retarget("cuda", "sm_90")


class ChannelsLastNormBack(nn.Module):
    """A layer norm over the channels of an NCHW sum, permuted back and made contiguous (MaxViT's)."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.norm, self.conv = nn.LayerNorm(c), nn.Conv2d(c, c, 1)

    def forward(self, x, y):
        return self.conv(self.norm((x + y).permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous())


class WindowPartitionAfterNorm(nn.Module):
    """A layer norm, then its windows: Swin's partition (a view, a permute, a copy) or MaxViT's (a
    view, a transpose, a reshape that copies)."""

    def __init__(self, transpose: bool = False, c: int = 16, ws: int = 3):
        super().__init__()
        self.norm, self.lin, self.transpose, self.ws = nn.LayerNorm(c), nn.Linear(c, c), transpose, ws

    def forward(self, x):
        b, h, w, c = x.shape
        x = self.norm(x).view(b, h // self.ws, self.ws, w // self.ws, self.ws, c)
        if self.transpose:
            return self.lin(x.transpose(2, 3).reshape(-1, self.ws, self.ws, c))
        return self.lin(x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, self.ws * self.ws, c))


class SwinWindows(nn.Module):
    """timm's Swin block up to its windows: norm1, the cyclic shift (a roll) where the block has one,
    F.pad to whole windows (of zeros where they fit), then the partition."""

    def __init__(self, shift: bool = False, pad: int = 0, c: int = 16):
        super().__init__()
        self.norm, self.lin, self.shift, self.pad = nn.LayerNorm(c), nn.Linear(c, c), shift, pad

    def forward(self, x):
        b, h, w, c = x.shape
        x = self.norm(x)
        if self.shift:
            x = torch.roll(x, (-1, -1), (1, 2))
        x = F.pad(x, (0, 0, 0, self.pad, 0, self.pad))
        h, w = h + self.pad, w + self.pad
        return self.lin(x.view(b, h // 3, 3, w // 3, 3, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 9, c))


class SwinResidualWindows(nn.Module):
    """timm's Swin between two blocks: the residual sum (viewed as the image) is a region output,
    the next block's norm1 of it is padded (by nothing) and split into windows; the attention's
    windows come back and are added to the sum."""

    def __init__(self, c: int = 16, h: int = 6, w: int = 9, ws: int = 3):
        super().__init__()
        self.norm, self.lin, self.hw, self.ws = nn.LayerNorm(c), nn.Linear(c, c), (h, w), ws

    def forward(self, x, y):
        (b, _, c), (h, w), ws = x.shape, self.hw, self.ws
        x = (x + y).view(b, h, w, c)
        win = F.pad(self.norm(x), (0, 0, 0, 0, 0, 0)).view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5)
        out = self.lin(win.contiguous().view(-1, ws * ws, c))
        return x + out.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


class AttentionOutPlusLocal(nn.Module):
    """EfficientFormerV2's attention output: (B, heads, N, d) transposed and reshaped to the (B,
    heads*d, H, W) map (the view splits N into H, W and merges heads with d), plus the local value
    scaled per channel (its batch norm's affine map), through a GELU."""

    def __init__(self, heads: int = 2, d: int = 4, h: int = 3, w: int = 5):
        super().__init__()
        self.scale, self.shape = nn.Parameter(torch.randn(heads * d)), (heads, d, h, w)

    def forward(self, a, v):
        heads, d, h, w = self.shape
        return F.gelu((a * 2).transpose(2, 3).reshape(a.shape[0], heads * d, h, w) + v * self.scale.view(1, -1, 1, 1))


class UpsampledSum(nn.Module):
    """A feature pyramid's top-down merge: the coarser map, scaled, upsampled by a whole factor
    (nearest), plus the finer one, through a sigmoid."""

    def __init__(self, **interpolate):
        super().__init__()
        self.interpolate = interpolate or dict(scale_factor=2, mode="nearest")

    def forward(self, x, y):
        return torch.sigmoid(F.interpolate(x * 2, **self.interpolate) + y)


class EcaGateAfterBias(nn.Module):
    """NFNet's block end: the bias the split convolution left (conv_bias), then ECA's gate (the
    sigmoid of a (B, 1, C) 1-D convolution, viewed to (B, C, 1, 1)) and the skip gains, plus the shortcut."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(c))

    def forward(self, x, g, shortcut):
        out = x + self.bias.view(1, -1, 1, 1)
        out = 2.0 * (out * torch.sigmoid(g).view(x.shape[0], -1, 1, 1))
        return out * 0.2 + shortcut


class WindowsOfAProduct(nn.Module):
    """A pointwise value split into 3x3 windows of a 6x9 map: the permute swaps two dims of size 3,
    so its shape is its operand's (a shape test alone took it for a view that keeps the order)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        x = self.lin(x) * 2.0
        b, h, w, c = x.shape
        return self.lin(x.view(b, h // 3, 3, w // 3, 3, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, 9, c))


class NormalizeLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(50, 50)

    def forward(self, x):
        return self.lin(F.normalize(self.lin(x), dim=-1))


CASES = {
    "silu_mul": (SiluMul, lambda: (torch.randn(64, 48), torch.randn(64, 48)), ["silu", "mul"]),
    "add_mul_broadcast": (AddMul, lambda: (torch.randn(16, 48), torch.randn(48), torch.randn(16, 1)), ["add", "mul"]),
    "rstd_of_float64": (Rstd, lambda: (torch.randn(16, 300, dtype=torch.float64),),
                        ["_to_copy", "pow", "mean", "add", "rsqrt"]),
    "views_of_inputs": (ViewsOfInputs, lambda: (torch.randn(32, 6), torch.randn(4, 8)), ["sigmoid", "mul"]),
    "repeat_kv_of_a_computed_value": (RepeatKV, lambda: (torch.randn(16, 8), torch.randn(1, 4, 16, 8),
                                                         torch.randn(1, 1, 16, 8)),
                                      ["cos", "sin", "mul", "mul", "add", "mul", "mul", "add", "clone"]),  # views unnamed
    # views of computed values: the region moves to the view's domain (its loads regrouped)
    "view_of_intermediate": (ViewOfIntermediate, lambda: (torch.randn(4, 48), torch.randn(4, 8, 6)), ["sigmoid", "mul"]),
    "unsqueeze_between_dims_of_a_computed_value": (RepeatKVHeads, lambda: (torch.randn(2, 2, 8),), ["sigmoid", "clone"]),
    "slice_at_an_offset": (SliceOfInput, lambda: (torch.randn(8, 33), torch.randn(8, 32)), ["sigmoid", "mul"]),
    "qkv_unbind_at_three_offsets": (QKVSplit, lambda: (torch.randn(2, 5, 16),), ["mul", "clone", "clone", "clone"]),
    "rotary_q_and_k_of_two_shapes": (Rotary, lambda: (torch.randn(1, 16, 8), torch.randn(2, 4, 16, 8),
                                                        torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8),
                                                        torch.randn(2, 2, 16, 8), torch.randn(8, 8)),
                                     ["mul", "mul", "add", "mul", "mul", "add"]),
    "rotary_whole_with_its_cats": (FullRotary, lambda: (torch.randn(4), torch.arange(16)[None], torch.randn(1, 4, 16, 8),
                                                        torch.randn(1, 2, 16, 8)),
                                   ["cat", "cos", "sin", "mul", "neg", "cat", "mul", "add", "mul", "neg", "cat", "mul", "add"]),
    "rotary_keys_repeated_before_the_queries": (RotaryKeysRepeatedFirst, lambda: (
        torch.randn(1, 4, 16), torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8)), None),
    "cat_along_a_middle_dim": (CatOfActivations, lambda: (torch.randn(4, 3, 8), torch.randn(4, 5, 8)),
                               ["sigmoid", "mul", "cat", "relu"]),
    # sibling reductions: one pass folds both (the loss's mean stays outside the region)
    "triplet_margin_loss_distances": (lambda: nn.TripletMarginLoss(margin=1.0),
                                      lambda: (torch.rand(16, 40), torch.rand(16, 40), torch.rand(16, 40)),
                                      ["sub", "add", "norm", "sub", "add", "norm", "add", "sub", "clamp_min"]),
    # a pooling's pointwise epilogue in its kernel
    "max_pool_then_hardtanh": (lambda: PoolThenActivation(nn.MaxPool2d(2), nn.Hardtanh()),
                               lambda: (torch.randn(2, 3, 9, 10),), ["sub", "max_pool2d_with_indices", "mul", "hardtanh"]),
    "avg_pool_then_mish": (lambda: PoolThenActivation(nn.AvgPool2d(3, 2, 1), nn.Mish()),
                           lambda: (torch.randn(2, 3, 9, 10),), ["sub", "avg_pool2d", "mul", "mish"]),
    "whole_sum_and_sum_of_squares": (WholeSumTimesSquares, lambda: (torch.rand(6, 20),), ["sum", "mul", "sum", "mul"]),
    "max_pool_then_an_input": (PoolThenInput, lambda: (torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4)),
                               ["max_pool2d_with_indices", "add"]),
    "avg_pool_then_a_channel_bias_channels_last": (PoolThenBias, lambda: (
        torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last), torch.randn(8)), ["avg_pool2d", "add", "sigmoid"]),
    # a reduction over size-1 dims folds one element: pointwise, so the row's residual broadcasts
    "logsumexp_over_a_size_1_dim": (LogSumExpOfOne, lambda: (torch.randn(16, 1), torch.randn(16, 48)),
                                    ["logsumexp", "gelu", "add"]),
    "avg_pool1d_squeezed_then_gelu": (Pool1dThenGelu, lambda: (torch.randn(6, 64),), ["avg_pool2d", "gelu", "mul"]),
    # a pooling alone whose indices are unused: only its values are written
    "max_pool1d_without_its_indices": (lambda: nn.MaxPool1d(8, 1, 4, 3), lambda: (torch.randn(2, 4, 300),),
                                       ["max_pool2d_with_indices"]),
    "masked_cumsum": (MaskedCumsum, lambda: (torch.rand(4, 300), torch.rand(4, 300) > 0.5), ["mul", "cumsum"]),
    "cumsum_over_a_sum_read_from_outside": (NormalisedCDF, lambda: (torch.rand(4, 64), torch.rand(4, 64) > 0.5),
                                            ["mul", "cumsum", "div"]),
    # inputs transposed to the outputs: 32 x 32 tiles through shared memory (edges of 4 and 18 or 8)
    "class_token_beside_nchw_patches": (lambda: ClassTokenOfPatches(100, 49), lambda: (torch.randn(2, 100, 7, 7),),
                                        ["cat", "add"]),
    "add_of_a_transposed_int64": (AddTransposed, lambda: (torch.randint(-9, 9, (3, 50, 40)), torch.randint(-9, 9, (3, 40, 50))),
                                  None),
    "sum_and_sum_of_squares": (SumTimesSquares, lambda: (torch.rand(12, 50),), ["sum", "mul", "sum", "mul"]),  # no cancellation
    # a permute after a norm made contiguous: the copy is written permuted, as the permute would be
    "norm_permuted_back_and_made_contiguous": (ChannelsLastNormBack, lambda: (torch.randn(2, 16, 5, 7), torch.randn(2, 16, 5, 7)),
                                               ["add", "native_layer_norm", "clone"]),
    # a norm's output split into windows and permuted: the domain is the split shape, the copy written permuted
    "window_partition_after_a_norm": (WindowPartitionAfterNorm, lambda: (torch.randn(2, 6, 9, 16),),
                                      ["native_layer_norm", "clone"]),
    "window_partition_after_a_norm_by_transpose": (lambda: WindowPartitionAfterNorm(True), lambda: (torch.randn(2, 6, 9, 16),),
                                                   ["native_layer_norm", "clone"]),
    "permute_of_equal_sizes_of_a_computed_value": (WindowsOfAProduct, lambda: (torch.randn(2, 6, 9, 16),), ["mul", "clone"]),
    # timm's Swin: a pad of zeros is a copy inside the region, after the norm or after the shift's roll
    "swin_norm_zero_pad_and_partition": (SwinWindows, lambda: (torch.randn(2, 6, 9, 16),),
                                         ["native_layer_norm", "constant_pad_nd", "clone"]),
    "swin_zero_pad_and_partition_after_the_roll": (lambda: SwinWindows(True), lambda: (torch.randn(2, 6, 9, 16),),
                                                   ["constant_pad_nd", "clone"]),
    # a keepdim mean of per-channel norms scales the whole map: each pixel folds the channels' norms
    # (ConvNeXt-V2's global response norm; the norms over the pixels are a card of their own)
    "global_response_norm": (lambda: GlobalResponseNorm(16), lambda: (torch.randn(2, 16, 5, 7),),
                             ["mean", "add", "div", "mul", "addcmul", "add"]),
    "global_response_norm_channels_last": (lambda: GlobalResponseNorm(16), lambda: (
        torch.randn(2, 16, 5, 7).to(memory_format=torch.channels_last),), ["mean", "add", "div", "mul", "addcmul", "add"]),
    # a view that splits one dim and merges two others: split first, then the finer-domain merge
    "a_view_that_splits_and_merges": (lambda: AttentionOutPlusLocal().eval(), lambda: (
        torch.randn(2, 2, 15, 4), torch.randn(2, 8, 3, 5)), ["mul", "clone", "mul", "add", "gelu"]),
    # the residual sum is written over the windows' split domain beside them (a region output from before the split)
    "swin_residual_sum_beside_its_windows": (SwinResidualWindows, lambda: (torch.randn(2, 54, 16), torch.randn(2, 54, 16)),
                                             ["add", "native_layer_norm", "constant_pad_nd", "clone"]),
    # nearest upsampling inside a region: the input viewed with a size-1 dim after each upsampled
    # one, expanded, copied and merged back (codegen/resample.py)
    "upsampled_sum": (UpsampledSum, lambda: (torch.randn(2, 3, 5, 7), torch.randn(2, 3, 10, 14)),
                      ["mul", "upsample_nearest2d", "add", "sigmoid"]),
    "upsampled_sum_channels_last": (UpsampledSum, lambda: (torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last),
                                                           torch.randn(2, 3, 10, 14).to(memory_format=torch.channels_last)),
                                    ["mul", "upsample_nearest2d", "add", "sigmoid"]),
    "upsampled_sum_by_three_and_two_exact": (lambda: UpsampledSum(size=(15, 14), mode="nearest-exact"), lambda: (
        torch.randn(2, 3, 5, 7), torch.randn(2, 3, 15, 14)), ["mul", "_upsample_nearest_exact2d", "add", "sigmoid"]),
    # ECA's gate viewed from (B, 1, C) to (B, C, 1, 1) after an unrelated value (the bias add): the
    # view and what it reads come first (card_program.views_early)
    "eca_gate_after_a_bias_add": (EcaGateAfterBias, lambda: (torch.randn(2, 16, 5, 7), torch.randn(2, 1, 16),
                                                             torch.randn(2, 16, 5, 7)), None),
    "eca_gate_after_a_bias_add_channels_last": (EcaGateAfterBias, lambda: tuple(
        t.to(memory_format=torch.channels_last) if t.dim() == 4 else t
        for t in (torch.randn(2, 16, 5, 7), torch.randn(2, 1, 16), torch.randn(2, 16, 5, 7))), None),
    # F.normalize: the norm, kept, expanded back over the rows it divides (EdgeNeXt's attention)
    "normalize_expands_its_norm_back": (lambda: NormalizeLinear(), lambda: (torch.randn(12, 50),),
                                        ["linalg_vector_norm", "clamp_min", "div"]),
}


def _knobs(card):
    """The default and settings whose threads do not cooperate (what cuda_on_cpu runs exactly)."""
    out = [generated.default(card, H200)]
    for s in generated.spaces(card, H200):
        if s["algo"] != ("gen_rows",):
            out += [k for k in knob_space.configs(s) if k.get("threads", k.get("th", 0) * k.get("tw", 0)) == 64][::7]
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_region_lowers_compiles_and_matches_its_replay(tmp_path, name):
    model, make_inputs, ops = CASES[name]
    made = make_inputs()
    card = region_card(tmp_path, model(), *made, ops=ops)
    same = [tuple(t.shape) for t in made] == [tuple(m.shape) for m in card.inputs]
    inputs = list(made) if same else card.random_inputs(0, "cpu")  # the region reads values the model computes
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert BuiltinProposer().supports(card) == (True, "")
    want = card.region.replay([t.clone() for t in inputs])
    for got, w in zip(interp.run(prog, inputs), want):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    for knobs in _knobs(card):
        cand = generated.build(card, knobs, H200)
        cand.plan.validate(len(card.inputs), len(card.outputs))
        assert compiler.compile(cand.source, arch="sm_90").cubin
        if knobs["algo"] not in ("gen_rows", "gen_norm_coop"):  # threads that cooperate across blocks: GPU only
            for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
                torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{knobs}: {m}")


def test_a_reduction_of_one_element_a_row_is_pointwise(tmp_path):
    """No fold level is spent on it: the program is a pointwise one over the residual's domain, and
    infinities and NaN come out as eager's (logsumexp of one element is that element)."""
    card = region_card(tmp_path, LogSumExpOfOne(), torch.randn(16, 1), torch.randn(16, 48))
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert prog.reduction is None and prog.domain == (16, 48)
    m = torch.tensor([[float("inf")], [-float("inf")], [float("nan")], [3.0]])
    x = torch.randn(4, 48)
    card4 = region_card(tmp_path / "4", LogSumExpOfOnePlus(), m, x)
    (got,) = interp.run(card_program.program_for_card(card4), [m, x])
    torch.testing.assert_close(got, card4.region.replay([m, x])[0], equal_nan=True)


def test_a_one_element_reduction_after_a_reduction_reads_its_input_after_it(tmp_path):
    """z.amax(0) over z of (1, 8) is pointwise, read after x.sum(1): its input is an epilogue read,
    so the region is generated right or declined, never with z read over the summed elements."""
    x, z = torch.randn(8, 8), torch.randn(1, 8)
    card = region_card(tmp_path, SumThenMaxOfOne(), x, z)
    prog = card_program.program_for_card(card)
    if not isinstance(prog, str):
        torch.testing.assert_close(interp.run(prog, [x, z])[0], card.region.replay([x, z])[0])


def test_a_row_of_odd_length_is_read_a_scalar_at_a_time(tmp_path):
    """Rows of 4095 of a (4, 4096) tensor: a split's chunks could be whole vectors while the row is
    not, and the last vector would fold the next row's first element."""
    from kforge.codegen import lower
    from codegen_cards import A, make_card

    rows = torch.empty(4, 4096, device="meta")[:, :4095]
    card = make_card(A.sum.dim_IntList, rows, [1])
    assert lower.reduction_vecs(generated.program(card), (2, 4)) == (1,)


def test_the_reduction_region_has_its_cast_and_square_as_prologue(tmp_path):
    card = region_card(tmp_path, Rstd(), torch.randn(16, 300, dtype=torch.float16))
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert prog.reduction is not None and prog.reduction.dims == (1,) and prog.domain == (16, 300)
    assert generated.default(card, H200)["algo"] == "gen_rows"
    x = torch.randn(16, 300, dtype=torch.float16)
    (got,) = interp.run(prog, [x])
    torch.testing.assert_close(got, card.region.replay([x])[0])
    for s in generated.spaces(card, H200):
        for knobs in knob_space.configs(s)[::40]:
            assert compiler.compile(generated.build(card, knobs, H200).source, arch="sm_90").cubin


class PartsOfTwoWidths(nn.Module):
    """Two outputs of different shapes (two parts): one reads fp32 only, the other int64 too."""

    def forward(self, a, c):
        t = torch.sigmoid(a)
        return t * 2, t + c


def test_parts_of_different_widths_keep_16_byte_accesses_unless_the_knob_asks_for_more(tmp_path):
    """The default width (4: the fp32 part's 16 bytes) reaches the int64 part as its own 16-byte
    width, 2, not as two pieces of 2; a width no part reaches in 16 bytes (8) is pieces in both."""
    import cuda_on_cpu

    a, c = torch.randn(6, 64), torch.randint(-5, 5, (2, 6, 64))
    card = region_card(tmp_path, PartsOfTwoWidths(), a, c)
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str) and len(prog.parts) == 1, prog
    default = generated.default(card, H200)
    assert default["vec"] == 4
    for knobs, pieces in ((default, False), ({**default, "vec": 8}, True)):
        cand = generated.build(card, knobs, H200)
        assert ("kf_vec<long long, 2>" in cand.source) == pieces, knobs
        want = card.region.replay([a.clone(), c.clone()])
        for got, w in zip(cuda_on_cpu.run(card, cand, [a, c]), want):
            torch.testing.assert_close(got, w)


def test_views_of_inputs_are_read_in_place_through_the_real_inputs(tmp_path):
    """view and unsqueeze+expand become program inputs of their own, launched with the card's
    input they view: the plan passes only in0 and in1."""
    card = region_card(tmp_path, ViewsOfInputs(), torch.randn(32, 6), torch.randn(4, 8))
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert len(card.inputs) == 2 and [prog.source(i) for i in sorted(prog.in_strides)] == [0, 1]
    assert prog.in_strides[min(prog.in_strides)] == (48, 6, 1)
    assert prog.in_strides[max(prog.in_strides)] == (8, 1, 0)
    cand = generated.build(card, generated.default(card, H200), H200)
    assert sorted(a["in"] for a in cand.plan.kernels[0].args if "in" in a) == [0, 1]


def test_the_builtin_proposer_proposes_for_a_region_card(tmp_path):
    card = region_card(tmp_path, SiluMul(), torch.randn(64, 48), torch.randn(64, 48))
    proposal = BuiltinProposer().propose(ProposalContext(card, H200))
    assert proposal.candidate.knobs["algo"] == "gen_flat" and proposal.candidate.note == "generated"


DECLINED = {
    "vendor_epilogue": (LinearGelu, lambda: (torch.randn(4, 48),),
                        "no builtin template or generated kernel for aten::addmm"),
    # sibling reductions fold together only over the same elements, and not beside a normalization
    "a_sum_beside_a_softmax": (SoftmaxTimesSum, lambda: (torch.randn(8, 16),), "beside a scan or a normalization"),
    "sums_over_other_dims": (SumsOverOtherDims, lambda: (torch.randn(8, 16),), "folds other elements than the first"),
    # square planes: the transpose keeps the shape, not the elements' order
    "a_transpose_after_a_pooling": (PoolThenTranspose, lambda: (torch.randn(2, 3, 8, 8),),
                                    "after a pooling: a window ends what is generated as one kernel"),
    "a_value_from_before_a_pooling_after_it": (PoolThenEarlierValue, lambda: (torch.randn(2, 3, 8, 8),),
                                               "a node after a pooling reads a value from before it"),
    "siblings_under_a_normalization": (MeanTimesCentred, lambda: (torch.randn(8, 16),),
                                       "sibling reductions under a normalization are not generated"),
}


DECLINED["an_input_broadcast_over_a_squeezed_pooling_by_sample"] = (
    Pool1dThenPerSampleBias, lambda: (torch.randn(4, 4, 32), torch.randn(4, 1, 1)),
    "broadcasts otherwise over a view of the pooling's output")


# twice the size, but eager's CUDA kernel picks floor(dst / 2.05): not dst // 2 everywhere
DECLINED["an_upsampling_to_twice_the_size_by_a_scale_of_2_05"] = (
    lambda: UpsampledSum(scale_factor=2.05, mode="nearest"), lambda: (torch.randn(2, 3, 10, 10), torch.randn(2, 3, 20, 20)),
    "other than a whole factor")
DECLINED["an_upsampling_by_a_factor_that_is_not_whole"] = (
    lambda: UpsampledSum(scale_factor=1.5, mode="nearest"), lambda: (torch.randn(2, 3, 6, 8), torch.randn(2, 3, 9, 12)),
    "other than a whole factor")


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_region_the_generator_cannot_do_is_declined_with_its_reason(tmp_path, name):
    model, make_inputs, reason = DECLINED[name]
    card = region_card(tmp_path, model(), *make_inputs())
    ok, why = BuiltinProposer().supports(card)
    assert not ok and reason in why, why


def test_a_region_with_outputs_of_two_shapes_is_one_kernel_per_shape(tmp_path):
    """q and k of a GQA rotary embedding: each part computes what its output needs (both read
    cos and sin) and writes only it, in a range of blocks of one launch; every output is written once."""
    made = CASES["rotary_q_and_k_of_two_shapes"][1]()
    card = region_card(tmp_path, Rotary(), *made, ops=["mul", "mul", "add", "mul", "mul", "add"])
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert len(prog.parts) == 1 and prog.out_index == [0] and prog.parts[0].out_index == [1]
    assert prog.domain == (2, 4, 16, 8) and prog.parts[0].domain == (2, 2, 16, 8)
    cand = generated.build(card, generated.default(card, H200), H200)
    (launch,) = cand.plan.kernels
    q_part, k_part = launch.args[:5], launch.args[5:]  # out, then the four inputs each part reads
    assert [a["out"] for a in q_part if "out" in a] == [0] and [a["out"] for a in k_part if "out" in a] == [1]
    assert sorted(a["in"] for a in k_part if "in" in a) == [0, 1, 4, 5]  # cos, sin, k, rotated k
    assert "kf_p0::kf_part(" in cand.source and "else if (blockIdx.x < " in cand.source


def test_views_at_offsets_read_the_one_input_at_their_offsets(tmp_path):
    """unbind's q, k and v start 0, 16 and 32 elements into the qkv projection's output: the
    plan passes that one tensor three times, each read from its own offset."""
    card = region_card(tmp_path, QKVSplit(), torch.randn(2, 5, 16), ops=["mul", "clone", "clone", "clone"])
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    assert len(card.inputs) == 1 and sorted(prog.offset(i) for i in prog.in_strides) == [0, 16, 32]
    cand = generated.build(card, generated.default(card, H200), H200)
    assert {a["in"] for a in cand.plan.kernels[0].args if "in" in a} == {0}
    assert "+ 16)" in cand.source and "+ 32)" in cand.source


def _cols_block_settings(card, inputs, extra):
    """The default (gen_cols_block, 4 channels a thread) and each of `extra` over it: every one
    compiles for sm_90 and computes, on the CPU, what the region does; yields (knobs, candidate)."""
    knobs = generated.default(card, H200)
    assert knobs["algo"] == "gen_cols_block" and knobs["vec"] == 4
    want = card.region.replay([t.clone() for t in inputs])
    for k in [knobs] + [{**knobs, **e} for e in extra]:
        cand = generated.build(card, k, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        got = cuda_on_cpu.run(card, cand, inputs)
        assert len(got) == len(want)
        for o, w in zip(got, want):
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
        yield k, cand


def test_a_channels_last_global_pool_reads_a_vector_of_channels_a_thread(tmp_path):
    """bn -> add -> relu -> mean over 7x7, channels-last (ResNet-50's last block at a batch that fills
    the GPU): by default each thread folds a slice of the pixels for 4 neighbouring channels (16-byte
    loads), the batch norm's per-channel parameters read once before its loop, and the slices
    merge in order through shared memory. Each setting runs on the CPU as the region computes."""
    cl = lambda t: t.to(memory_format=torch.channels_last)  # noqa: E731
    x, r = cl(torch.randn(9, 2048, 7, 7)), cl(torch.randn(9, 2048, 7, 7))
    model = BatchNormAddReluMean(2048).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    with torch.no_grad():
        got = capture(model, (x, r), tmp_path, regions=True, time_cards=False)
    (cpu_card,) = [c for c in got.cards if c.region is not None]
    inputs = load_sample(cpu_card, tmp_path, 0)[0]  # x, the parameters, r
    card = cpu_card.retarget("cuda", "sm_90")
    for k, cand in _cols_block_settings(card, inputs, ({"ty": 2, "items": 1, "vec": 1}, {"ty": 16, "items": 4, "vec": 2},
                                                        {"threads": 128, "ty": 4})):
        if k["vec"] > 1:  # the parameters: one vector load each, before the reduced loop
            assert cand.source.count("v) = *reinterpret_cast") == 4
    # NCHW: the pixels of a channel are contiguous; rows, not columns
    card = region_card(tmp_path / "nchw", model, x.contiguous(), r.contiguous())
    assert lower.cols_block_vecs(generated.program(card)) == ()


def test_a_channels_last_mean_writes_its_prologue_beside_it_a_vector_of_channels_a_thread(tmp_path):
    """EfficientNet's squeeze-and-excite, channels-last: batch norm -> SiLU written beside its mean
    over the pixels (a shared region). A block per (sample, channel) row read its pixels a channel
    apart and ran slower than eager on the H100; by default the columns-of-channels kernel folds
    the mean and stores the SiLU a vector of channels at a time, as it reads. Each setting runs on
    the CPU as the region computes."""
    from norm_models import SqueezeExcite

    model = SqueezeExcite(64).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(3, 64, 10, 9).to(memory_format=torch.channels_last)
    with torch.no_grad():
        got = capture(model, (x,), tmp_path, regions=True, time_cards=False)
    (cpu_card,) = [c for c in got.cards if c.region is not None and c.region.kind == "shared"]
    assert cpu_card.region.ops == ["_native_batch_norm_legit_no_training", "silu", "mean"]
    inputs = load_sample(cpu_card, tmp_path, 0)[0]
    card = cpu_card.retarget("cuda", "sm_90")
    prog = generated.program(card)
    assert prog.normalizes and len(lower.prologue_outputs(prog)) == 1  # the SiLU, over every pixel
    assert len(card.outputs) == 2
    list(_cols_block_settings(card, inputs, ({"ty": 2, "items": 1, "vec": 1}, {"ty": 4, "items": 4, "vec": 2},
                                             {"threads": 128, "ty": 8}, {"ty": 64, "items": 1})))


def test_an_inference_batch_norm_alone_is_one_kernel(tmp_path):
    """Eager's CUDA batch norm is two kernels; alone, it is a region the generator makes one
    pointwise kernel of, channels-last as the layout pass gives it."""
    bn = nn.BatchNorm2d(16).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        got = capture(bn, (torch.randn(2, 16, 5, 7).to(memory_format=torch.channels_last),), tmp_path, regions=True,
                      time_cards=False)
    (cpu_card,) = [c for c in got.cards if c.region is not None]
    assert cpu_card.region.ops == ["_native_batch_norm_legit_no_training"]
    inputs = load_sample(cpu_card, tmp_path, 0)[0]
    card = cpu_card.retarget("cuda", "sm_90")
    assert BuiltinProposer().supports(card) == (True, "")
    want = card.region.replay([t.clone() for t in inputs])
    for knobs in _knobs(card):
        cand = generated.build(card, knobs, H200)
        for o, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(o, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{knobs}: {m}")


@pytest.mark.parametrize("shared", [True, False])
def test_the_columns_kernel_split_into_runs_merges_them_in_order(tmp_path, shared):
    """gen_cols_block with `split`: the pixels cut into runs, a block each, their states merged in
    order by a second kernel, for the squeeze-and-excite region (the SiLU written beside its mean)
    and for a plain channels-last global pool; every setting runs on the CPU as the region does."""
    from norm_models import SqueezeExcite

    model = SqueezeExcite(64).eval() if shared else BatchNormAddReluMean(64).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = [torch.randn(2, 64, 16, 16).to(memory_format=torch.channels_last) for _ in range(1 if shared else 2)]
    with torch.no_grad():
        got = capture(model, tuple(x), tmp_path, regions=True, time_cards=False)
    (cpu_card,) = [c for c in got.cards if c.region is not None and c.region.kind == ("shared" if shared else "fused")]
    inputs = load_sample(cpu_card, tmp_path, 0)[0]
    card = cpu_card.retarget("cuda", "sm_90")
    (space,) = [s for s in generated.spaces(card, H200) if s["algo"] == ("gen_cols_block",)]
    assert space["split"] == (1, 2, 4)  # runs of 64 pixels at least
    want = card.region.replay([t.clone() for t in inputs])
    base = {"algo": "gen_cols_block", "threads": 256, "ty": 8, "items": 2, "vec": 4}
    for k in ({**base, "split": 2}, {**base, "split": 4, "ty": 2, "items": 1}, {**base, "split": 4, "vec": 1, "ty": 64}):
        cand = generated.build(card, k, H200)
        assert [kk.name for kk in cand.plan.kernels] == ["kf_gen", "kf_gen_finish"]
        assert compiler.compile(cand.source, arch="sm_90").cubin
        got = cuda_on_cpu.run(card, cand, inputs)
        for o, w in zip(got, want):
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_a_long_channels_last_mean_defaults_to_the_columns_kernel_within_its_space():
    """A global mean over 96x96 channels-last pixels (9216 a channel): its columns kernel takes at
    most 2 * CHAIN pixels a run, so its default has the fewest runs its space holds (4), not one,
    and the search's moves start from a setting it knows (review of round 31: split 1, outside)."""
    x = builtin_meta(64, 1024, 96, 96, dtype=torch.float32, channels_last=True)
    card = builtin_card(torch.ops.aten.mean.dim, x, [2, 3])
    knobs = generated.default(card, H200)
    space = knob_space.space_of(generated.spaces(card, H200), knobs)
    assert knobs["algo"] == "gen_cols_block" and knobs["split"] == 4 and 1 not in space["split"]
    assert all(knobs[name] in values for name, values in space.items() if name != "algo")


@pytest.mark.parametrize("name", ["window_reverse", "window_reverse_flat", "patch_merging"])
def test_a_view_that_merges_a_permuted_copys_dims_keeps_the_finer_domain(tmp_path, name):
    """Swin's window reverse (a permuted copy of the windows viewed as the image, a residual add, a
    norm) and its patch merging (a reshape, a permute, a flatten, a norm): the permuted input cannot
    be read through strides at the merged view's points, so the domain stays the finer shape and the
    nodes after the view read their inputs split to it. timm's block views the sum again, as
    (B, H*W, C), before its norm: the residual read between the two views is then read over the
    finer shape too. Every algorithm's default runs on the CPU as the region does."""
    from norm_models import PatchMerging, WindowReverseNorm

    if name.startswith("window_reverse"):
        flat = name.endswith("flat")
        card = region_card(tmp_path, WindowReverseNorm(flat=flat).eval(), torch.randn(2 * 2 * 3, 9, 16),
                           torch.randn(2, 6, 9, 16), ops=["clone", "add", "native_layer_norm"] + ([] if flat else ["relu"]))
        domain = (2, 2, 3, 3, 3, 16)
    else:
        card = region_card(tmp_path, PatchMerging().eval(), torch.randn(2, 6, 10, 8), ops=["clone", "native_layer_norm"])
        domain = (2, 3, 5, 2, 2, 8)
    prog = generated.program(card)
    assert prog.domain == domain and prog.reduction.dims == ((3, 4, 5) if name == "patch_merging" else (5,))
    inputs = card.random_inputs(0, "cpu")
    want = card.region.replay([t.clone() for t in inputs])
    for space in generated.spaces(card, H200):
        knobs = {k: v[0] for k, v in space.items()}
        cand = generated.build(card, knobs, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        if any(k.cooperative for k in cand.plan.kernels):
            continue
        for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{knobs}: {m}")


class SumOfTheCopyAfterItsView(nn.Module):
    def forward(self, x, y):
        a = x.exp()
        return (a.permute(0, 2, 1, 3).contiguous().view(2, 12, 5) + y) * a.sum()


def test_a_value_from_before_a_merging_view_used_after_it_is_declined(tmp_path):
    from kforge.codegen.views import merged_groups

    card = region_card(tmp_path, SumOfTheCopyAfterItsView(), torch.randn(2, 4, 3, 5), torch.randn(2, 12, 5))
    assert "a value from before a reshape that merges dims is used after it" in BuiltinProposer().supports(card)[1]
    assert merged_groups((1, 2, 7, 2, 7, 384), (1, 14, 14, 384)) == ((1,), (2, 7), (2, 7), (384,))
    assert merged_groups((2, 1, 7), (14,)) == ((2, 1, 7),) and merged_groups((14,), (2, 7)) is None
    assert merged_groups((2, 3), (2, 3)) is None


class SiluTimesBesideMean(nn.Module):
    def forward(self, x, z):
        y = F.silu(x)
        return y * z, y.mean((2, 3))


def test_a_value_written_beside_the_fold_that_reads_another_input_keeps_the_row_kernels(tmp_path):
    """silu(x) * z beside the mean of silu(x): the columns kernel loads only what the fold reads,
    so it is not offered; the default builds and computes the region (review of 4a36330: it
    raised a KeyError)."""
    x, z = (torch.randn(2, 64, 10, 9).to(memory_format=torch.channels_last) for _ in range(2))
    card = region_card(tmp_path, SiluTimesBesideMean(), x, z)
    prog = generated.program(card)
    assert lower.prologue_outputs(prog) is None and lower.cols_block_vecs(prog) == ()
    knobs = generated.default(card, H200)
    assert knobs["algo"] != "gen_cols_block"
    assert compiler.compile(generated.build(card, knobs, H200).source, arch="sm_90").cubin


def test_a_layer_norm_keeps_its_row_kernels(tmp_path):
    """A normalization's outputs read the reduction's state: the columns kernel, which writes
    only its prologue's values beside the fold, is not offered."""
    from norm_models import AddLayerNormGelu

    card = region_card(tmp_path, AddLayerNormGelu(48).eval(), torch.randn(4, 48), torch.randn(4, 48))
    prog = generated.program(card)
    assert prog.normalizes and lower.prologue_outputs(prog) is None and lower.cols_block_vecs(prog) == ()
    assert all(s["algo"] != ("gen_cols_block",) for s in generated.spaces(card, H200))


def test_a_pooling_of_nchw_planes_stages_its_prologue_once_per_input_point(tmp_path):
    """ResNet's stem, bn -> relu -> 3x3 stride-2 max pool over NCHW planes: by default a block
    evaluates the batch norm and relu once per input point of its tile's span into shared
    memory, then folds each output's window from there (one global read of x in the source, the
    folds read the tile). Tiles that overhang the plane's edges and the padding, each run on the
    CPU with the block's threads meeting at the barrier, give what the region computes."""
    model = nn.Sequential(nn.BatchNorm2d(5), nn.ReLU(), nn.MaxPool2d(3, 2, 1)).eval()
    with torch.no_grad():
        model[0].running_mean.uniform_(-1, 1)
        model[0].running_var.uniform_(0.5, 2)
    with torch.no_grad():
        got = capture(model, (torch.randn(2, 5, 37, 35),), tmp_path, regions=True, time_cards=False)
    (cpu_card,) = [c for c in got.cards if c.region is not None]
    inputs = load_sample(cpu_card, tmp_path, 0)[0]
    card = cpu_card.retarget("cuda", "sm_90")
    knobs = generated.default(card, H200)
    assert knobs == {"algo": "gen_window_tile", "th": 16, "tw": 16}  # 19x18 outputs a plane
    want = card.region.replay([t.clone() for t in inputs])
    for k in (knobs, {**knobs, "th": 2, "tw": 16}, {**knobs, "th": 4, "tw": 32}):
        cand = generated.build(card, k, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        assert cand.source.count("x0 + (kf_idx)i0") == 1 and "= kf_tile[" in cand.source
        for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    # channels-last with 5 channels: no vector of channels, so no tile
    cl = region_card(tmp_path / "cl", model, torch.randn(2, 5, 37, 35).to(memory_format=torch.channels_last))
    assert lower.window_tiles(generated.program(cl)) == {}
    assert generated.default(cl, H200)["algo"] == "gen_window"


def test_a_3d_pooling_stages_one_plane_per_step_of_its_depth_window():
    """3-D max pooling with indices (KernelBench's: 3x3x3, stride 2, padding 1, dilation 3): the
    tile form stages the input plane of each depth step of the window (a step in the padding is
    skipped by the whole block) and folds the plane's windows from shared memory; out-of-plane
    threads stage but write nothing. Every setting, run on the CPU, gives eager's values and
    indices (ties to the first, as eager's)."""
    from codegen_cards import A, make_card, meta

    card = make_card(A.max_pool3d_with_indices.default, meta(1, 2, 9, 11, 40), [3, 3, 3], [2, 2, 2], [1, 1, 1],
                     [3, 3, 3])
    prog = generated.program(card)
    assert lower.window_tiles(prog) == {"th": (2, 4), "tw": (16, 32, 64)}  # 4 x 20 outputs a plane
    assert generated.default(card, H200)["algo"] == "gen_window"  # searched, not the default: too little reuse
    x = torch.randn(1, 2, 9, 11, 40)
    x[0, 1, 4, 5, :10] = 3.0  # ties in a window: the first one's index
    want = card.call_eager([x.clone()], "cpu")
    for k in ({"th": 2, "tw": 16}, {"th": 4, "tw": 16}, {"th": 2, "tw": 32}):
        cand = generated.build(card, {"algo": "gen_window_tile", **k}, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        assert "for (int k0 = 0; k0 < 3; ++k0)" in cand.source and "= kf_tile[" in cand.source
        got = cuda_on_cpu.run(card, cand, [x])
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
        assert torch.equal(got[1], want[1]), k


def test_a_tile_is_no_taller_than_its_output_plane():
    """A 1-D pooling runs as a 2-D pooling of one-row planes (eager's max_pool1d; KernelBench's is
    8 wide, dilation 3, stride 1): a tile would idle all but one of its rows, so there is none and
    one thread an output is the default. Planes of 3 output rows take tiles of 2 rows only. The
    default runs on the CPU with eager's values and indices."""
    from codegen_cards import A, make_card, meta

    card = make_card(A.max_pool2d_with_indices.default, meta(2, 3, 1, 300), [1, 8], [1, 1], [0, 4], [1, 3])
    assert lower.window_tiles(generated.program(card)) == {}
    knobs = generated.default(card, H200)
    assert knobs["algo"] == "gen_window"
    x = torch.randn(2, 3, 1, 300)
    x[1, 2, 0, 40:60] = 2.0  # ties: the first one's index
    want = card.call_eager([x.clone()], "cpu")
    got = cuda_on_cpu.run(card, generated.build(card, knobs, H200), [x])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert torch.equal(got[1], want[1])
    three = make_card(A.max_pool2d_with_indices.default, meta(2, 3, 5, 300), [3, 8], [1, 1], [0, 4], [1, 3])
    assert generated.program(three).domain[-2] == 3
    assert lower.window_tiles(generated.program(three))["th"] == (2,)


def test_a_channels_last_pooling_stages_vectors_of_channels(tmp_path):
    """The stem as kforge.optimize runs it (channels-last): a staged point holds cg groups of vec
    channels, each loaded as one vector, the parameters one vector a thread; 12 channels in chunks
    of 8 leave the last chunk half empty. Each setting runs on the CPU as the region computes."""
    model = nn.Sequential(nn.BatchNorm2d(12), nn.ReLU(), nn.MaxPool2d(3, 2, 1)).eval()
    with torch.no_grad():
        model[0].running_mean.uniform_(-1, 1)
        model[0].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 12, 19, 17).to(memory_format=torch.channels_last)
    with torch.no_grad():
        got = capture(model, (x,), tmp_path, regions=True, time_cards=False)
    (cpu_card,) = [c for c in got.cards if c.region is not None]
    inputs = load_sample(cpu_card, tmp_path, 0)[0]
    card = cpu_card.retarget("cuda", "sm_90")
    assert lower.window_tiles(generated.program(card)) == {"th": (2, 4), "tw": (4, 8), "cg": (1, 2, 4, 8), "vec": (2, 4)}
    assert generated.default(card, H200) == {"algo": "gen_window_tile", "th": 4, "tw": 8, "cg": 2, "vec": 4}
    want = card.region.replay([t.clone() for t in inputs])
    for k in ({"th": 2, "tw": 4, "cg": 2, "vec": 4}, {"th": 4, "tw": 8, "cg": 1, "vec": 4},
              {"th": 2, "tw": 8, "cg": 4, "vec": 2}, {"th": 4, "tw": 4, "cg": 8, "vec": 4}):
        cand = generated.build(card, {"algo": "gen_window_tile", **k}, H200)
        assert compiler.compile(cand.source, arch="sm_90").cubin
        assert cand.source.count("x0 + (kf_idx)i0") == 1 and "= kf_tile[" in cand.source
        # past the 12th channel a thread reads no parameter (chunks of 8 and 16 channels)
        assert ("c1 >= 12 ? kf_vec" in cand.source) == (12 % (k["cg"] * k["vec"]) != 0)
        for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            assert got.stride() == w.stride()
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_gelu_tanh_rounded_to_16_bits_takes_one_exp_and_no_tanh(tmp_path, monkeypatch):
    """Gemma's gelu(tanh) * up in bf16: 1 + tanh(z) is computed as 2 / (1 + exp(-2z)) with the
    hardware's exp and division (no tanhf, no cancellation where tanh nears -1); in fp32 the
    table's tanhf stays. The rewritten form, run on the CPU in fp32, gives eager's GELU to a
    few ulps (and eager's 0, inf and NaN at the ends)."""
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    cards = [(region_card(tmp_path / str(dtype), GeluMul(), x.to(dtype), torch.ones_like(x, dtype=dtype)), fast)
             for dtype, fast in ((torch.bfloat16, True), (torch.float32, False))]
    cuda_on_cpu.check_fast_forms(cards, "tanhf(", "kf_fdiv(2.0f, 1.0f + __expf(-2.0f * ")
    card = cards[-1][0]
    cuda_on_cpu.fast_forms_in_fp32(monkeypatch)  # the fast form in fp32 on the CPU: as if the outputs were 16-bit
    cand = generated.build(card, {**generated.default(card, H200), "threads": 64}, H200)
    assert "tanhf(" not in cand.source
    got = cuda_on_cpu.run(card, cand, [x, torch.ones_like(x)])[0]
    want = F.gelu(x.double(), approximate="tanh")
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_shared_candidate_writes_the_residual_sum_and_its_norm_like_eager(tmp_path):
    """A residual sum read after the region too, and the layer norm it feeds: one kernel that
    writes both (the sum before the fold, the norm after), every form of gen_norm on the CPU."""
    from builtin_cards import fresh_inputs
    from norm_models import ResidualStream

    x, y = torch.randn(4, 37, 16), torch.randn(4, 37, 16)
    with torch.no_grad():
        r = capture(ResidualStream(), (x, y), tmp_path, regions=True, time_cards=False)
    cards = [c.retarget("cuda", "sm_90") for c in r.cards if c.region is not None and c.region.kind == "shared"]
    assert len(cards) == 2  # the first sum reads the inputs; the second, the addmm's output through a view
    for card in cards:
        assert card.region.ops == ["add", "native_layer_norm"] and len(card.outputs) == 2
        assert BuiltinProposer().supports(card) == (True, "")
        inputs = fresh_inputs(card, 0, "cpu")
        want = card.call_eager([t.clone() for t in inputs], "cpu")
        for knobs in (generated.default(card, H200),
                      {"algo": "gen_norm", "threads": 64, "lanes": 1, "vec": 4, "staging": "regs"},
                      {"algo": "gen_norm", "threads": 64, "lanes": 8, "vec": 1, "staging": "reload"}):
            got = cuda_on_cpu.run(card, generated.build(card, knobs, H200), [t.clone() for t in inputs])
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{knobs}: {m}")


def test_sin_and_cos_of_one_angle_share_one_sincos(tmp_path):
    """A rotary region takes the sine and the cosine of each angle: one sincosf per angle (the
    compiler does not merge sinf and cosf, which reduce the argument twice), in every part."""
    model, make_inputs, ops = CASES["rotary_whole_with_its_cats"]
    made = make_inputs()
    card = region_card(tmp_path, model(), *made, ops=ops)
    cand = generated.build(card, generated.default(card, H200), H200)
    assert cand.source.count("sincosf(") >= 2 and not re.search(r"\b(?:sin|cos)f\(", cand.source)
    inputs = card.random_inputs(0, "cpu")
    for got, want in zip(cuda_on_cpu.run(card, cand, inputs), card.region.replay([t.clone() for t in inputs])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["class_token_beside_nchw_patches", "add_of_a_transposed_int64"])
def test_an_input_transposed_to_the_outputs_is_tiled_through_shared_memory(tmp_path, name):
    """The default stages the transposed input's 32 x 32 tiles (read along its own contiguous dim)
    and writes along the outputs'; every other input is read as the flat kernel reads it."""
    model, make_inputs, ops = CASES[name]
    made = make_inputs()
    card = region_card(tmp_path, model(), *made, ops=ops)
    knobs = generated.default(card, H200)
    assert knobs["algo"] == "gen_tile" and {s["algo"] for s in generated.spaces(card, H200)} == {("gen_flat",), ("gen_tile",)}
    inputs = card.random_inputs(0, "cpu")
    want = card.region.replay([t.clone() for t in inputs])
    for threads in (128, 512):
        cand = generated.build(card, {**knobs, "threads": threads}, H200)
        assert cand.source.count("__shared__") == 1 and cand.source.count("__syncthreads()") == 2
        assert compiler.compile(cand.source, arch="sm_90").cubin
        for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)


def test_tiled_threads_read_and_write_vectors_where_both_dims_are_whole_vectors(tmp_path):
    """`tvec` 2 and 4: a thread reads 2 (4) consecutive elements of the transposed input and
    writes as many of the output, over tiles 64 (128) a side, partial at the edges (100 channels,
    64 tokens); fp32 tiles 128 a side take 66 KB, past the shared memory a kernel declares: 4
    runs as 2. bf16 defaults to pairs (4-byte accesses); 49 tokens take no vectors."""
    card = region_card(tmp_path, ClassTokenOfPatches(100, 64), torch.randn(2, 100, 8, 8))
    assert lower.tile_vecs(generated.program(card)) == (1, 2, 4) and generated.default(card, H200)["tvec"] == 1  # fp32
    inputs = card.random_inputs(0, "cpu")
    want = card.region.replay([t.clone() for t in inputs])
    for tvec in (2, 4):
        cand = generated.build(card, {**generated.default(card, H200), "tvec": tvec}, H200)
        assert "s4[64][65];" in cand.source and "kf_vec<float, 2>" in cand.source
        assert compiler.compile(cand.source, arch="sm_90").cubin
        for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    bf16 = region_card(tmp_path / "bf16", ClassTokenOfPatches(100, 64).to(torch.bfloat16),
                       torch.randn(2, 100, 8, 8, dtype=torch.bfloat16))
    assert generated.default(bf16, H200)["tvec"] == 2
    cand = generated.build(bf16, {**generated.default(bf16, H200), "tvec": 4}, H200)
    assert "s4[128][129];" in cand.source and compiler.compile(cand.source, arch="sm_90").cubin  # 33 KB: fits
    odd = region_card(tmp_path / "odd", ClassTokenOfPatches(100, 49), torch.randn(2, 100, 7, 7))
    assert lower.tile_vecs(generated.program(odd)) == (1,) and generated.default(odd, H200)["tvec"] == 1


def test_nothing_transposed_is_not_tiled(tmp_path):
    card = region_card(tmp_path, AddTransposed(), torch.randn(3, 50, 40), torch.randn(3, 50, 40).transpose(1, 2))  # x's view
    assert generated.default(card, H200)["algo"] == "gen_flat" and len(generated.spaces(card, H200)) == 1


def test_tiles_past_the_shared_memory_a_kernel_may_declare_are_read_flat(tmp_path):
    """One launch of twelve tiled parts: every block declares every part's tiles, 4224 bytes each
    in fp32, and a kernel may declare 48 KB: eleven parts are tiled, the twelfth reads flat."""
    xs = [torch.randn(1, 40, 20) for _ in range(12)]
    card = region_card(tmp_path, CatOfTransposed(), *xs)
    knobs = generated.default(card, H200)
    assert knobs["algo"] == "gen_tile"
    cand = generated.build(card, knobs, H200)
    assert cand.source.count("__shared__") == 11
    assert compiler.compile(cand.source, arch="sm_90").cubin
    for got, want in zip(cuda_on_cpu.run(card, cand, xs), card.region.replay([t.clone() for t in xs])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_angles_sines_are_taken_once_for_several_heads(tmp_path):
    """A rotary region that computes its angles' sine and cosine reads them at every head: with
    grid "heads" (the default there) a thread takes `items` heads of one position and evaluates
    the sines once (one sincosf per part, outside the heads' loop); items that do not divide a
    part's heads leave that part flat. Regions with no such work do not offer it."""
    model, make_inputs, _ = CASES["rotary_keys_repeated_before_the_queries"]
    made = make_inputs()
    card = region_card(tmp_path, model(), *made)
    knobs = generated.default(card, H200)
    assert (knobs["grid"], knobs["items"]) == ("heads", 2) and "heads" in generated.spaces(card, H200)[0]["grid"]
    inputs = card.random_inputs(0, "cpu")
    want = card.region.replay([t.clone() for t in inputs])
    for items in (2, 4):
        cand = generated.build(card, {**knobs, "items": items}, H200)
        src = cand.source
        if items == 2:
            assert src.count("sincosf(") == src.count("namespace kf_p") and src.count("hv1[j] = ") == src.count("namespace kf_p")
        assert compiler.compile(src, arch="sm_90").cubin
        for got, w in zip(cuda_on_cpu.run(card, cand, inputs), want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    plain = region_card(tmp_path / "silu", SiluMul(), torch.randn(64, 48), torch.randn(64, 48))
    assert "heads" not in generated.spaces(plain, H200)[0]["grid"] and generated.default(plain, H200)["grid"] == "exact"


def test_heads_read_gathered_rows_and_their_indices_at_every_head():
    """A gather's rows and its index are read at every item even where they are the same at every
    head, and a cast alone is not worth taking heads for."""
    from kforge.cards import TensorMeta
    from kforge.codegen.ir import Expr, Program, prim

    heads, seq, dim, rows = 4, 16, 8, 32
    angles = TensorMeta((seq, dim), (dim, 1), "float32", "cuda")
    index = TensorMeta((seq,), (1,), "int64", "cuda", lo=0, hi=rows - 1)
    out = TensorMeta((heads, seq, dim), (seq * dim, dim, 1), "float32", "cuda")
    for table, strides, stride in ((TensorMeta((rows, dim), (dim, 1), "float32", "cuda"), (0, 0, 1), dim),
                                   (TensorMeta((rows,), (1,), "float32", "cuda"), (0, 0, 0), 1)):
        prog = Program(domain=(heads, seq, dim), inputs=[angles, index, table], outputs=[out],
                       in_strides={0: (0, dim, 1), 1: (0, 1, 0), 2: strides}, out_strides=[out.stride],
                       results=[prim("sin", Expr.load(2, "float32")) * prim("sin", Expr.load(0, "float32"))],
                       gathers={2: (1, stride, rows)})
        assert lower.heads_items(prog) == 4
        src = lower.lower_pointwise(prog, {"algo": "gen_flat", "threads": 64, "vec": 4, "items": 2, "grid": "heads"}, 132).source
        assert "if (k == 0) for (int j = 0; j < V; ++j) x1" not in src  # the index, at every head
        assert compiler.compile(src, arch="sm_90").cubin
    cast = Program(domain=(heads, seq, dim), inputs=[angles], outputs=[out], in_strides={0: (0, dim, 1)},
                   out_strides=[out.stride], results=[Expr.load(0, "float32") * 2])
    assert lower.heads_items(cast) == 0


def test_a_pad_that_pads_ends_a_region_and_its_card_is_declined(tmp_path):
    """Only a pad of zeros is a copy the generator takes: a real one (Conv2dSame's, here after batch
    norm and SiLU) stays outside the region before it, which is generated, and its card is declined."""
    class BnSiluPadConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.conv = nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3)

        def forward(self, x):
            return self.conv(F.pad(F.silu(self.bn(x)), (1, 1, 1, 1)))

    with torch.no_grad():
        r = capture(BnSiluPadConv().eval(), (torch.randn(2, 8, 6, 6),), tmp_path, regions=True, time_cards=False)
    regions = [c.region.ops for c in r.cards if c.region is not None and c.region.kind == "fused"]
    assert regions == [["_native_batch_norm_legit_no_training", "silu"]]
    (pad,) = [c.retarget("cuda", "sm_90") for c in r.cards if c.op == "aten::constant_pad_nd.default"]
    assert "a pad that pads or crops" in BuiltinProposer().supports(pad)[1]


@pytest.mark.parametrize("mode,scale,shape", [("nearest", 2, (2, 3, 5, 7)), ("nearest", 3, (2, 3, 5, 7)),
                                              ("nearest-exact", 2, (2, 3, 9)), ("nearest", 2, (1, 2, 3, 4, 5))])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_nearest_upsampling_card_is_generated_over_the_finer_domain(tmp_path, mode, scale, shape, channels_last):
    """The op alone (1-, 2- and 3-D): one copy over the domain with a dim of the factor's size after
    each upsampled dim, the input read with stride 0 along it, the output written in its own layout."""
    x = torch.randn(*shape)
    if channels_last and len(shape) == 4:
        x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        r = capture(UpsampledSum(scale_factor=scale, mode=mode), (x, torch.zeros(())), tmp_path, time_cards=False)
        want = F.interpolate(x, scale_factor=scale, mode=mode)
    (card,) = [c for c in r.cards if "upsample" in c.op]
    card = card.retarget("cuda", "sm_90")
    prog = card_program.program_for_card(card)
    assert not isinstance(prog, str), prog
    fine = [n for d in shape[2:] for n in (d, scale)]
    assert prog.domain == tuple(shape[:2]) + tuple(fine)
    assert all(prog.in_strides[i][3::2] == (0,) * (len(shape) - 2) for i in prog.in_strides)
    (got,) = interp.run(prog, [x])
    assert torch.equal(got, want)
    assert BuiltinProposer().supports(card) == (True, "")
    cand = generated.build(card, generated.default(card, H200), H200)
    assert compiler.compile(cand.source, arch="sm_90").cubin
    (ran,) = cuda_on_cpu.run(card, cand, [x])
    assert torch.equal(ran, want) and ran.stride() == want.stride()
