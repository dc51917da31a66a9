"""The first stage of an SD3.5-style VAE decoder, written out: conv_in, the mid block (ResNet block,
single-head attention, ResNet block) and the first up block's three ResNet blocks, each ResNet block
GroupNorm(32) + SiLU + conv3x3 twice. 512 channels at 128x128 (a 1024 px image), batch 1, bf16 on CUDA.

    kforge capture examples/sd_vae_decoder.py       or    python examples/sd_vae_decoder.py

Without a GPU, or with SMALL=1, it runs 64 channels at 16x16 in fp32.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = os.environ.get("SMALL") == "1" or DEVICE == "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
LATENT_CHANNELS = 16
CHANNELS, SIZE = (64, 16) if SMALL else (512, 128)


class ResnetBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, ch, eps=1e-6)
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.norm2 = nn.GroupNorm(32, ch, eps=1e-6)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all pixels, as in the SD VAE mid block."""

    def __init__(self, ch: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(32, ch, eps=1e-6)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(ch, ch) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.group_norm(x).view(b, c, h * w).transpose(1, 2)
        q, k, v = (proj(t).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        return x + self.to_out(out).transpose(1, 2).reshape(b, c, h, w)


class DecoderStage(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv_in = nn.Conv2d(LATENT_CHANNELS, ch, 3, padding=1)
        self.mid = nn.Sequential(ResnetBlock(ch), AttnBlock(ch), ResnetBlock(ch))
        self.up = nn.Sequential(*(ResnetBlock(ch) for _ in range(3)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(self.mid(self.conv_in(z)))


def get_model() -> nn.Module:
    torch.manual_seed(0)
    return DecoderStage(CHANNELS).to(DEVICE, DTYPE).eval()


def get_inputs() -> torch.Tensor:
    g = torch.Generator(DEVICE).manual_seed(0)
    return torch.randn(1, LATENT_CHANNELS, SIZE, SIZE, device=DEVICE, dtype=DTYPE, generator=g)


if __name__ == "__main__":
    from rich import print

    from kforge.capturing import capture
    from kforge.cardtable import cards_table

    print(cards_table(capture(get_model(), get_inputs()).cards, limit=30))
