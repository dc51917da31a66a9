"""One Gemma-style decoder layer written out in plain torch: RMSNorm (1 + weight), rotary embeddings,
eager attention (matmul, softmax in fp32, matmul) with one shared KV head, and a gated MLP with
tanh-GELU. Gemma-2B sizes: hidden 2048, 8 heads of 256, MLP 16384; sequence 2048, batch 1, bf16.

    kforge capture examples/gemma_decoder.py       or    python examples/gemma_decoder.py

Without a GPU, or with SMALL=1, it runs hidden 64, 4 heads of 16, MLP 128, sequence 16, fp32.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = os.environ.get("SMALL") == "1" or DEVICE == "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
if SMALL:
    HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, SEQ = 64, 4, 1, 16, 128, 16
else:
    HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, SEQ = 2048, 8, 1, 256, 16384, 2048


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(q.shape[-2], device=q.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.rotary = Rotary(HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = self.rotary(q, k)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * HEAD_DIM ** -0.5
        causal = torch.full((s, s), float("-inf"), device=x.device, dtype=scores.dtype).triu(1)
        probs = F.softmax(scores + causal, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.up_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = GatedMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def get_model() -> nn.Module:
    torch.manual_seed(0)
    return DecoderLayer().to(DEVICE, DTYPE).eval()


def get_inputs() -> torch.Tensor:
    g = torch.Generator(DEVICE).manual_seed(0)
    return torch.randn(1, SEQ, HIDDEN, device=DEVICE, dtype=DTYPE, generator=g)


if __name__ == "__main__":
    from rich import print

    from kforge.capturing import capture
    from kforge.cardtable import cards_table

    print(cards_table(capture(get_model(), get_inputs()).cards, limit=30))
