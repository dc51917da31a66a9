"""A Qwen3-MoE-style sparse MLP block written out (as in Hugging Face's eager implementation): router
linear, softmax over 128 experts in fp32, top-8 with renormalised weights, then a loop over the
experts that got tokens, each a SiLU-gated MLP whose output is index_add_-ed back. Qwen3-30B-A3B sizes:
hidden 2048, expert MLP 768; 1024 tokens, bf16.

    kforge capture examples/qwen_moe.py       or    python examples/qwen_moe.py

Without a GPU, or with SMALL=1, it runs hidden 32, 8 experts, top-2, expert MLP 16, 16 tokens, fp32.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = os.environ.get("SMALL") == "1" or DEVICE == "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
if SMALL:
    HIDDEN, EXPERTS, TOP_K, EXPERT_MLP, TOKENS = 32, 8, 2, 16, 16
else:
    HIDDEN, EXPERTS, TOP_K, EXPERT_MLP, TOKENS = 2048, 128, 8, 768, 1024


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, EXPERT_MLP, bias=False)
        self.up_proj = nn.Linear(HIDDEN, EXPERT_MLP, bias=False)
        self.down_proj = nn.Linear(EXPERT_MLP, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden.shape
        x = hidden.view(-1, h)
        routing = F.softmax(self.gate(x), dim=1, dtype=torch.float32)
        weights, selected = torch.topk(routing, TOP_K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=EXPERTS).permute(2, 1, 0)  # expert, slot, token
        for e in (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist():
            slot, token = torch.where(mask[e])
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out.view(b, s, h)


def get_model() -> nn.Module:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return SparseMoeBlock().to(DTYPE).eval()


def get_inputs() -> torch.Tensor:
    g = torch.Generator(DEVICE).manual_seed(0)
    return torch.randn(1, TOKENS, HIDDEN, device=DEVICE, dtype=DTYPE, generator=g)


if __name__ == "__main__":
    from rich import print

    from kforge.capturing import capture
    from kforge.cardtable import cards_table

    print(cards_table(capture(get_model(), get_inputs()).cards, limit=30))
