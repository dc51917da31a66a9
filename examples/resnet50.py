"""ResNet-50 from torchvision (random weights), batch 32 at 224x224, fp32 (DTYPE=bfloat16 for bf16).

    kforge capture examples/resnet50.py       or    python examples/resnet50.py

Without a GPU, or with SMALL=1, it runs batch 2 at 64x64 so that tests can import it cheaply.
"""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = os.environ.get("SMALL") == "1" or DEVICE == "cpu"
DTYPE = getattr(torch, os.environ.get("DTYPE", "float32"))


def get_model() -> torch.nn.Module:
    try:
        import torchvision  # imported here so the other examples work without it
    except ImportError as e:
        raise ImportError("examples/resnet50.py needs torchvision: pip install torchvision") from e
    torch.manual_seed(0)
    return torchvision.models.resnet50(weights=None).to(DEVICE, DTYPE).eval()


def get_inputs() -> torch.Tensor:
    batch, size = (2, 64) if SMALL else (32, 224)
    return torch.randn(batch, 3, size, size, device=DEVICE, dtype=DTYPE, generator=torch.Generator(DEVICE).manual_seed(0))


if __name__ == "__main__":
    from rich import print

    from kforge.capturing import capture
    from kforge.cardtable import cards_table

    print(cards_table(capture(get_model(), get_inputs()).cards, limit=30))
