"""Generated kernels (kforge.codegen, the built-in proposer's `generated` template alone) vs
eager and torch.compile, over a spread of pointwise and reduction cards, the large ones
over 64 MB (target: >= 80 % of the HBM floor). Same harness as bench_builtin.py: a knob
sweep checked against eager, then eager, torch.compile and the best kernel timed together
(L2 flushed before every rep, interleaved, one event pair per rep).

    python bench/bench_codegen.py [--out bench/results/codegen_h200.json] [--budget 16] [--no-compile] [--only NAME]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests"), str(ROOT / "bench")]

import bench_builtin  # noqa: E402
from builtin_cards import A, BF16, F16, make_card, meta  # noqa: E402
from kforge.capturing import capture  # noqa: E402
from kforge.proposers.builtin import generated  # noqa: E402
from norm_models import BatchNormReluAdd, BatchNormReluPool, MaskSoftmax  # noqa: E402

FLOOR = ("floor", 0.8)


def region(model, shape, dtype, channels_last: bool, n_inputs: int = 2):
    """The one region card of `model` run on `n_inputs` CUDA inputs of `shape`."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device="cuda", dtype=dtype).eval()
    ins = [torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt) for _ in range(n_inputs)]
    with torch.no_grad():
        r = capture(model, tuple(ins), Path(tempfile.mkdtemp(prefix="kforge-bench-")), regions=True, time_cards=False)
    (card,) = [c for c in r.cards if c.region is not None]
    return card


class SoftmaxToBf16(torch.nn.Module):
    """The probabilities of kforge.attention's rewrite: fp32 scores, softmax, cast to bf16."""

    def forward(self, x):
        return torch.softmax(x, -1).to(torch.bfloat16)


BIG = (8192, 8192)  # 256 MB of fp32, 128 MB of bf16
CASES = {
    # >= 64 MB: the HBM target
    "relu 8192x8192 fp32": (lambda: make_card(A.relu.default, meta(*BIG)), FLOOR),
    "gelu tanh 8192x11008 bf16": (lambda: make_card(A.gelu.default, meta(8192, 11008, dtype=BF16), approximate="tanh"), FLOOR),
    "leaky_relu 8192x8192 fp32": (lambda: make_card(A.leaky_relu.default, meta(*BIG), 0.01), FLOOR),
    "softplus 8192x8192 bf16": (lambda: make_card(A.softplus.default, meta(*BIG, dtype=BF16)), FLOOR),
    "add bias 8192x8192 bf16": (lambda: make_card(A.add.Tensor, meta(*BIG, dtype=BF16), meta(8192, dtype=BF16)), FLOOR),
    "mul 8192x8192 int32": (lambda: make_card(A.mul.Tensor, meta(*BIG, dtype=torch.int32), meta(*BIG, dtype=torch.int32)), FLOOR),
    "hardtanh_ 8192x8192 fp32 (in place)": (lambda: make_card(A.hardtanh_.default, meta(*BIG)), FLOOR),
    "sum rows 8192x8192 fp32": (lambda: make_card(A.sum.dim_IntList, meta(*BIG), [-1]), FLOOR),
    "sum cols 8192x8192 fp32": (lambda: make_card(A.sum.dim_IntList, meta(*BIG), [0]), FLOOR),
    "sum all 8192x8192 fp32": (lambda: make_card(A.sum.default, meta(*BIG)), FLOOR),
    "mean rows 16384x4096 bf16": (lambda: make_card(A.mean.dim, meta(16384, 4096, dtype=BF16), [-1]), FLOOR),
    "amax rows 8192x8192 f16": (lambda: make_card(A.amax.default, meta(*BIG, dtype=F16), [-1]), FLOOR),
    "argmax rows 8192x8192 fp32": (lambda: make_card(A.argmax.default, meta(*BIG), 1), FLOOR),
    "var rows 8192x8192 fp32": (lambda: make_card(A.var.correction, meta(*BIG), [-1]), FLOOR),
    "norm2 rows 8192x8192 bf16": (lambda: make_card(A.linalg_vector_norm.default, meta(*BIG, dtype=BF16), 2.0, [-1]), FLOOR),
    "logsumexp 1024x65536 fp32": (lambda: make_card(A.logsumexp.default, meta(1024, 65536), [1]), FLOOR),
    "mean hw 64x256x56x56 channels_last fp32": (lambda: make_card(A.mean.dim, meta(64, 256, 56, 56, channels_last=True),
                                                                  [2, 3]), FLOOR),
    # ResNet-50's batch norm -> relu -> add at its largest, in both layouts
    "bn relu add region 32x256x56x56 channels_last bf16": (
        lambda: region(BatchNormReluAdd(256), (32, 256, 56, 56), BF16, True), FLOOR),
    "bn relu add region 32x256x56x56 bf16": (lambda: region(BatchNormReluAdd(256), (32, 256, 56, 56), BF16, False),
                                             FLOOR),
    "bn relu max_pool region 32x64x112x112 channels_last bf16 (ResNet's stem)": (
        lambda: region(BatchNormReluPool(64), (32, 64, 112, 112), BF16, True, n_inputs=1), FLOOR),
    # softmax regions: attention scores of the SD-VAE (16384-long rows) and Gemma's mask softmax
    "softmax to bf16 region 16384x16384 fp32 (SD-VAE attention)": (
        lambda: region(SoftmaxToBf16(), (16384, 16384), torch.float32, False, n_inputs=1), FLOOR),
    "mask softmax region 8x2048x2048 bf16 (Gemma)": (lambda: region(MaskSoftmax(), (8, 2048, 2048), BF16, False), FLOOR),
    "add 32x256x56x56 channels_last bf16": (lambda: make_card(A.add.Tensor, meta(32, 256, 56, 56, dtype=BF16,
                                                                                  channels_last=True),
                                                              meta(32, 256, 56, 56, dtype=BF16, channels_last=True)),
                                            FLOOR),
    # smaller, KernelBench-like shapes
    "sum dim1 16x256x256 fp32": (lambda: make_card(A.sum.dim_IntList, meta(16, 256, 256), [1], True), None),
    "max dim 16x256x256 fp32": (lambda: make_card(A.max.dim, meta(16, 256, 256), 1), None),
    "argmin dim 16x256x256 fp32": (lambda: make_card(A.argmin.default, meta(16, 256, 256), 1), None),
    "elu 16x16384 fp32": (lambda: make_card(A.elu.default, meta(16, 16384)), None),
    "hardsigmoid 16x16384 fp32": (lambda: make_card(A.hardsigmoid.default, meta(16, 16384)), None),
}


if __name__ == "__main__":
    raise SystemExit(bench_builtin.main(cases=CASES, templates=(generated.TEMPLATE,), out_name="codegen_h200.json",
                                        budget=16, title="generated kernels vs eager and torch.compile (GPU time, median)",
                                        doc=__doc__))
