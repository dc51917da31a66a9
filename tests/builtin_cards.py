"""Cards for the built-in template tests, built from meta tensors (no memory, no GPU).

`make_card(op, *args, **kwargs)` runs the op on meta tensors to get the outputs' exact
shapes, strides and dtypes (torch's meta kernels follow the CUDA ones: fp32 statistics for
16-bit layer_norm), binds every schema argument like capture does (defaults included)
and marks the tensors as CUDA tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from kforge.callspec import bind, output_aliases
from kforge.cards import ArgSpec, Card, TensorMeta, encode_value, flatten_outputs, qualified_name

A = torch.ops.aten
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def meta(*shape: int, dtype: torch.dtype = F32, channels_last: bool = False) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="meta")
    return t.to(memory_format=torch.channels_last) if channels_last else t


def _cuda(t: torch.Tensor, align: int) -> TensorMeta:
    return dataclasses.replace(TensorMeta.of(t), device="cuda", align=align)


def make_card(op: torch._ops.OpOverload, *args, align: int = 16, **kwargs) -> Card:
    specs = []
    for a, v in bind(op, args, kwargs):
        written = a.alias_info is not None and a.alias_info.is_write
        if isinstance(v, torch.Tensor):
            specs.append(ArgSpec(a.name, "tensor", a.kwarg_only, tensor=_cuda(v, align), written=written))
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) or t is None for t in v):
            specs.append(ArgSpec(a.name, "tensors", a.kwarg_only, tensors=[None if t is None else _cuda(t, align)
                                                                           for t in v], written=written))
        else:
            specs.append(ArgSpec(a.name, "value", a.kwarg_only, value=encode_value(v)))
    result = op(*args, **kwargs)
    outs = flatten_outputs(result)
    aliases = output_aliases(op, specs, result)  # in-place and out= outputs, as capture records them
    name = qualified_name(op)
    return Card(op=name, schema=str(op._schema), args=specs, outputs=[_cuda(o, 16) for o in outs], arch="sm_90",
                aliases=aliases)


def gn(n: int, c: int, h: int, w: int, groups: int, dtype=F32, affine: bool = True, **kw) -> Card:
    x = meta(n, c, h, w, dtype=dtype, **kw)
    p = meta(c, dtype=dtype) if affine else None
    return make_card(A.native_group_norm.default, x, p, p, n, c, h * w, groups, 1e-5)


def ln(rows: int, cols: int, dtype=F32, affine: bool = True) -> Card:
    p = meta(cols, dtype=dtype) if affine else None
    return make_card(A.native_layer_norm.default, meta(rows, cols, dtype=dtype), [cols], p, p, 1e-5)


def rms(rows: int, cols: int, dtype=F32, affine: bool = True, eps: float | None = 1e-6) -> Card:
    p = meta(cols, dtype=dtype) if affine else None
    return make_card(A._fused_rms_norm.default, meta(rows, cols, dtype=dtype), [cols], p, eps)


def bn(x: torch.Tensor, affine: bool = True, stats_dtype=None, op=None) -> Card:
    """Inference batch norm of x (running statistics), its parameters in x's dtype or stats_dtype."""
    p = meta(x.shape[1], dtype=stats_dtype or x.dtype)
    w = p if affine else None
    if op is None or op == A.cudnn_batch_norm.default:
        return make_card(op or A.native_batch_norm.default, x, w, w, p, p, False, 0.1, 1e-5)
    return make_card(op, x, w, w, p, p, 0.1, 1e-5)


def variance_inputs(card: Card) -> list[int]:
    """Positions in card.inputs of running variances (fresh inputs must make them positive)."""
    tensors = [a for a in card.args if a.kind == "tensor" and a.tensor is not None]
    return [i for i, a in enumerate(tensors) if a.name == "running_var"]


def fresh_inputs(card: Card, seed: int, device: str = "cuda") -> list[torch.Tensor]:
    """card.random_inputs, with a batch norm's running variances made non-negative (of a
    region card: every 1-D input, its norms' parameters and statistics)."""
    inputs = card.random_inputs(seed, device)
    for i in variance_inputs(card) if card.region is None else [i for i, t in enumerate(inputs) if t.dim() == 1]:
        inputs[i].abs_()
    return inputs


def softmax(*shape: int, dtype=F32, log: bool = False, half_to_float: bool = False) -> Card:
    op = A._log_softmax.default if log else A._softmax.default
    return make_card(op, meta(*shape, dtype=dtype), -1, half_to_float)


def softmax_to(*shape: int, dtype=BF16, to=F32, log: bool = False) -> Card:
    """softmax(x, -1, dtype=to): the composite op capture records whole (kforge.composite)."""
    op = A.log_softmax.int if log else A.softmax.int
    return make_card(op, meta(*shape, dtype=dtype), -1, to)


def to_copy(x: torch.Tensor, dtype=None, **kw) -> Card:
    """x.to(dtype) as aten records it (memory_format etc. as keyword arguments)."""
    return make_card(A._to_copy.default, x, dtype=dtype, **kw)


# A spread of shapes every family must handle: odd sizes, 1-element rows, rows longer
# than a block, widths that are not a multiple of the vector, channels_last, broadcast,
# in-place, mixed dtypes, dtype casts (_to_copy, to a new memory format too), and the
# benchmark shapes.
SPREAD = {
    "relu_f32_4d": lambda: make_card(A.relu.default, meta(32, 256, 56, 56)),
    "relu_inplace_f16_odd": lambda: make_card(A.relu_.default, meta(1001, dtype=F16)),
    "gelu_tanh_bf16": lambda: make_card(A.gelu.default, meta(8192, 11008, dtype=BF16), approximate="tanh"),
    "gelu_none_odd": lambda: make_card(A.gelu.default, meta(37, 3)),
    "silu_bf16": lambda: make_card(A.silu.default, meta(8192, 11008, dtype=BF16)),
    "silu_inplace": lambda: make_card(A.silu_.default, meta(64, 33)),
    "sigmoid_f16": lambda: make_card(A.sigmoid.default, meta(5, 7, dtype=F16)),
    "tanh_transposed": lambda: make_card(A.tanh.default, meta(48, 64).t()),
    "mul_bf16": lambda: make_card(A.mul.Tensor, meta(8192, 11008, dtype=BF16), meta(8192, 11008, dtype=BF16)),
    "add_broadcast_alpha": lambda: make_card(A.add.Tensor, meta(7, 5, 3), meta(5, 1), alpha=2),
    "add_row_bias_bf16": lambda: make_card(A.add.Tensor, meta(64, 256, dtype=BF16), meta(256, dtype=BF16)),
    "sub_mixed_dtypes": lambda: make_card(A.sub.Tensor, meta(16, 8, dtype=BF16), meta(16, 8)),
    "mul_0dim": lambda: make_card(A.mul.Tensor, meta(6, 4, dtype=BF16), meta()),
    "add_inplace_bf16_fp32_other": lambda: make_card(A.add_.Tensor, meta(6, 40, dtype=BF16), meta(6, 40)),
    "div_channels_last": lambda: make_card(A.div.Tensor, meta(2, 8, 5, 5, channels_last=True),
                                           meta(2, 8, 5, 5, channels_last=True)),
    "add_inplace_bf16": lambda: make_card(A.add_.Tensor, meta(8192, 11008, dtype=BF16), meta(8192, 11008, dtype=BF16)),
    "mul_inplace_broadcast": lambda: make_card(A.mul_.Tensor, meta(4, 6, 10), meta(6, 1)),
    "add_scalar": lambda: make_card(A.add.Scalar, meta(999, dtype=F16), 0.5, 3),
    "div_scalar": lambda: make_card(A.div.Scalar, meta(64, 64), 3.0),
    "to_copy_bf16_to_f32": lambda: to_copy(meta(1, 8, 2048, 2048, dtype=BF16), F32),
    "to_copy_f32_to_bf16": lambda: to_copy(meta(1, 8, 2048, 2048), BF16),
    "to_copy_f16_to_f32_odd": lambda: to_copy(meta(1001, 3, dtype=F16), F32),
    "to_copy_f32_to_f16": lambda: to_copy(meta(64, 1000), F16),
    "to_copy_f16_to_bf16": lambda: to_copy(meta(37, 129, dtype=F16), BF16),
    "to_copy_same_dtype_bf16": lambda: to_copy(meta(999, dtype=BF16), BF16),
    "to_copy_0dim": lambda: to_copy(meta(dtype=BF16), F32),
    "to_copy_transposed": lambda: to_copy(meta(48, 64, dtype=BF16).t(), F32),
    "to_copy_transposed_to_contiguous": lambda: to_copy(meta(48, 64).t(), BF16, memory_format=torch.contiguous_format),
    "to_copy_sliced": lambda: to_copy(meta(64, 100, dtype=F16)[:, :50], F32),
    "to_copy_to_channels_last": lambda: to_copy(meta(2, 8, 5, 5, dtype=BF16), F32, memory_format=torch.channels_last),
    "softmax_long_rows": lambda: softmax(8, 262144),
    "softmax_bf16_2048": lambda: softmax(1, 8, 2048, 2048, dtype=BF16),
    "softmax_f32_1024": lambda: softmax(1, 8, 1024, 1024),
    "softmax_4096x256": lambda: softmax(4096, 256),
    "softmax_16384x128": lambda: softmax(16384, 128),
    "softmax_one_col": lambda: softmax(7, 1),
    "softmax_odd_cols": lambda: softmax(33, 3001),
    "softmax_half_to_float": lambda: softmax(10, 1000, dtype=F16, half_to_float=True),
    "log_softmax_bf16": lambda: softmax(100, 5000, dtype=BF16, log=True),
    "log_softmax_long": lambda: softmax(3, 70000, log=True),
    "softmax_to_f32_scores": lambda: softmax_to(1, 8, 2048, 2048),
    "softmax_to_f32_router": lambda: softmax_to(1024, 128),
    "softmax_to_f32_odd_f16": lambda: softmax_to(33, 3001, dtype=F16),
    "softmax_to_f32_long_rows": lambda: softmax_to(8, 262144),
    "log_softmax_to_f32": lambda: softmax_to(100, 5000, log=True),
    "layer_norm_bf16": lambda: ln(8192, 4096, BF16),
    "layer_norm_odd": lambda: ln(5, 231),
    "layer_norm_no_affine_f16": lambda: ln(17, 768, F16, affine=False),
    "layer_norm_long": lambda: ln(64, 50000),  # rows past registers (64: fewer long rows go to the generator)
    "layer_norm_many_rows": lambda: ln(1111, 1000),
    "rms_norm_bf16": lambda: rms(8192, 4096, BF16),
    "rms_norm_no_eps": lambda: rms(9, 100, eps=None),
    "rms_norm_many_rows_f16": lambda: rms(3000, 777, F16, affine=False),
    "rms_norm_long_f16": lambda: rms(64, 100000, F16, affine=False),
    "group_norm_bf16": lambda: gn(1, 512, 128, 128, 32, BF16),
    "group_norm_f32_big": lambda: gn(1, 128, 512, 512, 32),
    "group_norm_f16": lambda: gn(2, 512, 64, 64, 32, F16, affine=False),
    "group_norm_odd": lambda: gn(3, 6, 5, 7, 3),
    "pool_1x1_f32": lambda: make_card(A._adaptive_avg_pool2d.default, meta(32, 2048, 7, 7), [1, 1]),
    "pool_1x1_channels_last": lambda: make_card(A._adaptive_avg_pool2d.default,
                                                meta(32, 2048, 7, 7, channels_last=True), [1, 1]),
    "pool_1x1_bf16_128": lambda: make_card(A._adaptive_avg_pool2d.default, meta(128, 2048, 7, 7, dtype=BF16), [1, 1]),
    "pool_general": lambda: make_card(A._adaptive_avg_pool2d.default, meta(2, 3, 10, 9), [3, 4]),
    "mean_hw_keepdim": lambda: make_card(A.mean.dim, meta(4, 64, 9, 9, dtype=F16), [-1, -2], True),
    "mean_hw_channels_last": lambda: make_card(A.mean.dim, meta(4, 64, 9, 9, channels_last=True), [2, 3]),
    "mean_middle_dim": lambda: make_card(A.mean.dim, meta(4, 10, 33), [1]),
    "batch_norm_bf16_56x56": lambda: bn(meta(32, 256, 56, 56, dtype=BF16)),
    "batch_norm_bf16_7x7": lambda: bn(meta(32, 2048, 7, 7, dtype=BF16)),
    "batch_norm_channels_last": lambda: bn(meta(4, 64, 9, 9, channels_last=True)),
    "batch_norm_f16_vectors_cross_planes": lambda: bn(meta(4, 6, 5, 5, dtype=F16)),
    "batch_norm_2d_f16_no_affine": lambda: bn(meta(100, 48, dtype=F16), affine=False),
    "batch_norm_bf16_fp32_stats": lambda: bn(meta(8, 64, 14, 14, dtype=BF16), stats_dtype=F32),
    "batch_norm_legit_no_training_odd": lambda: bn(meta(3, 5, 7, 11), op=A._native_batch_norm_legit_no_training.default),
    "batch_norm_cudnn_f32": lambda: bn(meta(8, 64, 14, 14), op=A.cudnn_batch_norm.default),
    "batch_norm_cudnn_f32_7x7": lambda: bn(meta(4, 96, 7, 7), op=A.cudnn_batch_norm.default),
}


# group_norm coop: the benchmark shapes, no affine, a ragged last chunk, a tiny group.
GN_COOP = {
    "bf16_1x512x128x128": lambda: gn(1, 512, 128, 128, 32, BF16),
    "f32_1x128x512x512": lambda: gn(1, 128, 512, 512, 32),
    "f16_2x512x64x64_no_affine": lambda: gn(2, 512, 64, 64, 32, F16, affine=False),
    "ragged_2x40x33x31": lambda: gn(2, 40, 33, 31, 8),
    "tiny_3x6x5x7": lambda: gn(3, 6, 5, 7, 3),
}
