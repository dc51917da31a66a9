"""Cards and scripted replies shared by the LLM proposer tests.

The CUDA sources are real kernels in tests/data/llm_replies/ (checked to compile for sm_90):
softmax over 4096 x 1024 float32 rows and native_group_norm on 1 x 128 x 64 x 64 bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kforge.cards import ArgSpec, Card, TensorMeta

REPLIES = Path(__file__).parent / "data" / "llm_replies"


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> TensorMeta:
    stride = torch.empty(shape, dtype=dtype, device="meta").stride()
    return TensorMeta(tuple(shape), tuple(stride), str(dtype).removeprefix("torch."), "cuda")


def softmax_card(rows: int = 4096, cols: int = 1024, eager_us: float = 12.0) -> Card:
    x = _meta((rows, cols), torch.float32)
    return Card(op="aten::_softmax.default", schema=str(torch.ops.aten._softmax.default._schema),
                args=[ArgSpec("self", "tensor", tensor=x), ArgSpec("dim", "value", value=-1),
                      ArgSpec("half_to_float", "value", value=False)],
                outputs=[x], arch="sm_90", device_name="NVIDIA H200", family="normalization", calls=1, eager_us=eager_us)


def group_norm_card() -> Card:
    x, wb = _meta((1, 128, 64, 64), torch.bfloat16), _meta((128,), torch.bfloat16)
    stats = _meta((1, 32), torch.bfloat16)
    values = [("N", 1), ("C", 128), ("HxW", 4096), ("group", 32), ("eps", 1e-05)]
    return Card(op="aten::native_group_norm.default", schema=str(torch.ops.aten.native_group_norm.default._schema),
                args=[ArgSpec("input", "tensor", tensor=x), ArgSpec("weight", "tensor", tensor=wb),
                      ArgSpec("bias", "tensor", tensor=wb)] + [ArgSpec(n, "value", value=v) for n, v in values],
                outputs=[x, stats, stats], arch="sm_90", device_name="NVIDIA H200", family="normalization", calls=1, eager_us=15.0)


def inplace_relu_card() -> Card:
    x = _meta((1 << 20,), torch.float16)
    return Card(op="aten::relu_.default", schema=str(torch.ops.aten.relu_.default._schema),
                args=[ArgSpec("self", "tensor", tensor=x, written=True)], outputs=[x], aliases={0: 0},
                arch="sm_90", device_name="NVIDIA H200", family="pointwise", calls=1)


def source(name: str) -> str:
    return (REPLIES / f"{name}.cu").read_text()


def plan(name: str) -> dict:
    return json.loads((REPLIES / f"{name}.json").read_text())


def answer(name: str, *, kind: str = "custom", prose: str = "Here is the kernel.") -> str:
    """A well-formed model reply carrying tests/data/llm_replies/<name>.cu and .json."""
    return f"{prose}\n\n```cuda\n{source(name)}```\n\n```json\n{json.dumps(plan(name))}\n```\nkind: {kind}\n"
