"""Small modules with the normalization chains real models have (Gemma's masked softmax,
Llama's residual rms_norm, the SD-VAE's group_norm → silu, ResNet's batch norm → relu → add,
instance norm) and the other region chains the benches time (Gemma's gelu * up, ViT's class token
beside its patches), shared by the CPU and GPU code generator tests and bench/bench_norms.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MaskSoftmax(nn.Module):
    """Gemma's attention probabilities: a mask add, up to fp32, softmax, back to bf16."""

    def forward(self, scores, mask):
        return torch.softmax((scores + mask).float(), -1).to(torch.bfloat16)


class ScaleSoftmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x * 0.125, -1)


class TemperatureLogSoftmax(nn.Module):
    """log_softmax after a temperature: a region (one op alone is an op card, not a region)."""

    def forward(self, x):
        return torch.log_softmax(x / 0.7, -1)


class AddLayerNormGelu(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)

    def forward(self, x, y):
        return F.gelu(self.ln(x + y))


class AddRMSNorm(nn.Module):
    """The residual sum is the prologue and is read again after the reduction; `to` casts the result."""

    def __init__(self, d, to: torch.dtype | None = None):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.to_dtype = to

    def forward(self, x, y):
        out = self.norm(x + y)
        return out if self.to_dtype is None else out.to(self.to_dtype)


class HandRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class GroupNormSilu(nn.Module):
    def __init__(self, c, g):
        super().__init__()
        self.gn = nn.GroupNorm(g, c)

    def forward(self, x):
        return F.silu(self.gn(x))


class ScaleAddLayerNorm2d(nn.Module):
    """ConvNeXt's layer norm over channels of an NCHW map (timm's LayerNorm2d: permute to NHWC,
    layer_norm, permute back) after the block's scaled residual add; a 1x1 convolution after it
    keeps the permute back outside the region."""

    def __init__(self, c):
        super().__init__()
        self.gamma, self.ln, self.conv = nn.Parameter(torch.randn(c, 1, 1)), nn.LayerNorm(c), nn.Conv2d(c, c, 1)

    def forward(self, x, shortcut):
        y = shortcut + x * self.gamma
        return self.conv(self.ln(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


class WindowMaskSoftmax(nn.Module):
    """Swin's shifted-window attention probabilities: a relative position bias, then a mask per
    window through a 5-D view of the scores, then softmax over the 4-D scores again."""

    def forward(self, attn, bias, mask):
        nw, (b, h, n, _) = mask.shape[0], attn.shape
        attn = (attn + bias.unsqueeze(0)).view(b // nw, nw, h, n, n) + mask.unsqueeze(1).unsqueeze(0)
        return torch.softmax(attn.view(-1, h, n, n), -1)


class BatchNormReluAdd(nn.Module):
    """In eval mode: running statistics away from (0, 1), so they matter."""

    def __init__(self, c):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x, r):
        return torch.relu(self.bn(x)) + r


class InstanceNormRelu(nn.Module):
    """aot_autograd's form: a view to (1, N*C, ...), batch statistics, a view back, then relu."""

    def __init__(self, c, affine=False):
        super().__init__()
        self.norm = nn.InstanceNorm2d(c, affine=affine)

    def forward(self, x):
        return torch.relu(self.norm(x))


class BatchNormReluPool(nn.Module):
    """ResNet's stem after its convolution (eval mode): batch norm, relu and a 3x3 max pool of
    stride 2 and padding 1 (its indices unused); `avg`: an average pool instead."""

    def __init__(self, c, avg=False):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.pool = nn.AvgPool2d(3, 2, 1) if avg else nn.MaxPool2d(3, 2, 1)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.pool(torch.relu(self.bn(x)))


class FrobeniusNormalize(nn.Module):
    """KernelBench's FrobeniusNorm: a norm over every dim (a 0-dim result, broadcast as keepdim), then a divide."""

    def forward(self, x):
        return x / torch.norm(x, p="fro")


class GlobalCentre(nn.Module):
    def forward(self, x):
        return x - x.mean()


class BatchNormAddReluMean(nn.Module):
    """ResNet's last block and its global pool."""

    def __init__(self, c):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x, r):
        return torch.relu(self.bn(x) + r).mean((2, 3))


class SqueezeExcite(nn.Module):
    """EfficientNet's block around its squeeze-and-excite: batch norm, SiLU, the mean over the
    pixels, two 1x1 convolutions and the gate times the SiLU's output (used twice: written beside
    its mean)."""

    def __init__(self, c):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.reduce, self.expand = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x):
        y = torch.nn.functional.silu(self.bn(x))
        gate = torch.sigmoid(self.expand(torch.nn.functional.silu(self.reduce(y.mean((2, 3), keepdim=True)))))
        return y * gate


class GeluMul(nn.Module):
    """Gemma's MLP gate: gelu(tanh) of the gate projection times the up projection."""

    def forward(self, g, u):
        return F.gelu(g, approximate="tanh") * u


class ResidualStream(nn.Module):
    """Two pre-norm blocks: each residual sum feeds the next norm and the next residual add."""

    def __init__(self, d=16):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(d), nn.LayerNorm(d)])
        self.lins = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])

    def forward(self, x, y):
        h = x + y
        for norm, lin in zip(self.norms, self.lins):
            h = h + lin(norm(h))
        return h


class ClassTokenOfPatches(nn.Module):
    """ViT's tokens: the class token, then the patches (the convolution's NCHW output read as
    (batch, tokens, channels): transposed to the output), plus the position embedding."""

    def __init__(self, channels: int, tokens: int):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, channels))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, channels))

    def forward(self, patches):
        x = patches.flatten(2).transpose(1, 2)
        return torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos


class WindowReverseNorm(nn.Module):
    """Swin's window reverse (its windows permuted back and made contiguous, viewed whole), the
    residual add and the block's norm; the windows come out of a linear layer as in the block."""

    def __init__(self, c: int = 16, ws: int = 3, flat: bool = False):
        super().__init__()
        self.ws, self.proj, self.norm, self.flat = ws, nn.Linear(c, c), nn.LayerNorm(c), flat

    def forward(self, windows, shortcut):
        b, h, w, c = shortcut.shape
        x = self.proj(windows).view(-1, h // self.ws, w // self.ws, self.ws, self.ws, c)
        x = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, h, w, c)
        if self.flat:  # timm's block: the sum viewed as (B, H*W, C), normed and kept for the next residual
            x = (shortcut + x).view(b, h * w, c)
            return x + self.proj(self.norm(x))
        return self.norm(shortcut + x).relu()


class PatchMerging(nn.Module):
    """Swin's patch merging as timm writes it: each 2x2 neighbourhood's channels gathered by a
    reshape, a permute and a flatten, then normalized over all of them."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.lin, self.norm = nn.Linear(c, c), nn.LayerNorm(4 * c)

    def forward(self, x):
        x = self.lin(x)
        b, h, w, c = x.shape
        return self.norm(x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3))


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2's global response norm of an NCHW map: each channel's L2 norm over the pixels,
    divided by the mean of those norms over the channels, scales the map (timm's GlobalResponseNorm)."""

    def __init__(self, c: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(c) * 0.1), nn.Parameter(torch.randn(c) * 0.1)

    def forward(self, x):
        g = x.norm(p=2, dim=(2, 3), keepdim=True)
        n = g / (g.mean(dim=1, keepdim=True) + 1e-6)
        return x + torch.addcmul(self.bias.view(1, -1, 1, 1), self.weight.view(1, -1, 1, 1), x * n)
