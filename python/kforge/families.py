"""Which family an aten op belongs to. The family decides whether kforge writes kernels for it.

  pointwise      elementwise maps, incl. in-place and copies (tagged `pointwise` by torch, plus copies)
  reduction      sums, means, extrema, variances over some dims (tagged `reduction`, plus top-k and friends)
  normalization  layer/group/batch/RMS norm and softmax: a reduction and a pointwise map over rows
  pooling        max/avg/adaptive pooling windows
  vendor         matmuls, convolutions and fused attention: cuBLAS/cuDNN/oneDNN already do these well
  view           views, allocations and metadata queries: they launch no kernel worth writing
  other          everything else (indexing, scatter, sort, cat, upsampling, ...)
"""

from __future__ import annotations

import torch

VENDOR = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear",
    "_addmm_activation", "_scaled_mm", "_int_mm", "_weight_int4pack_mm", "_weight_int8pack_mm",
    "convolution", "_convolution", "convolution_overrideable", "conv1d", "conv2d", "conv3d",
    "thnn_conv2d", "_slow_conv2d_forward", "slow_conv3d_forward", "slow_conv_dilated2d", "slow_conv_dilated3d",
    "_conv_depthwise2d", "conv_depthwise3d", "slow_conv_transpose2d", "slow_conv_transpose3d",
    "_nnpack_spatial_convolution",
})
VENDOR_PREFIXES = ("cudnn_", "_cudnn", "miopen_", "mkldnn_", "_mkldnn", "_scaled_dot_product", "_flash_attention",
                   "_efficient_attention", "_cslt", "_cufft", "_fft")

NORMALIZATION = frozenset({
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "_batch_norm_no_update",
    "_fused_rms_norm", "rms_norm", "_softmax", "_log_softmax", "_safe_softmax", "_weight_norm_interface",
    "softmax", "log_softmax",  # with dtype=, captured whole (kforge.composite)
    "renorm",
    # Vendor-backed by name, but a memory-bound map over rows like the others, not a matmul.
    "cudnn_batch_norm", "miopen_batch_norm",
})

POOLING = frozenset({
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d", "fractional_max_pool2d",
    "lp_pool2d",
})

REDUCTION = frozenset({"topk", "kthvalue", "median", "nanmedian", "mode", "aminmax", "logsumexp", "norm"})

# Copies are elementwise maps with a stride change; torch does not tag them pointwise.
POINTWISE = frozenset({"copy_", "_to_copy", "clone", "fill_", "zero_", "masked_fill_", "masked_fill", "lerp_",
                       "where", "_conj", "_neg_view"})

# Views the schema does not mark as read-only aliases (in-place views, _unsafe_view), allocations and
# metadata queries.
VIEW = frozenset({
    "_unsafe_view", "_reshape_alias", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_", "detach_",
    "swapdims_", "swapaxes_", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "_empty_affine_quantized", "resize_", "set_", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_nnpack_available", "_has_compatible_shallow_copy_type",
    "is_nonzero", "_assert_async", "_assert_tensor_metadata",
})


def packet_name(op: str | torch._ops.OpOverload) -> str:
    """'aten::_softmax.default' or torch.ops.aten._softmax.default -> '_softmax'."""
    name = op._name if isinstance(op, torch._ops.OpOverload) else op
    return name.split("::", 1)[-1].split(".", 1)[0]


def _returns_view(op: torch._ops.OpOverload) -> bool:
    """The schema says an output aliases an input without writing it: a view (view, t, slice, select, ...)."""
    rets = op._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def family_of(op: str | torch._ops.OpOverload) -> str:
    """The family of an op overload (object or 'aten::name.overload' string); one of cards.FAMILIES."""
    overload = _resolve(op) if isinstance(op, str) else op
    name = packet_name(op)
    if name in VIEW or (overload is not None and _returns_view(overload)):
        return "view"
    if name in NORMALIZATION:
        return "normalization"
    if name in VENDOR or name.startswith(VENDOR_PREFIXES):
        return "vendor"
    if name in POOLING:
        return "pooling"
    tags = set(overload.tags) if overload is not None else set()
    if torch.Tag.reduction in tags or name in REDUCTION:
        return "reduction"
    if torch.Tag.pointwise in tags or name in POINTWISE or overload is not None and _from_table(name, overload):
        return "pointwise"
    return "other"


def functional_of(overload: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The functional overload an out= overload writes the result of (`x.out` of `x.default`,
    `x.Y_out` of `x.Y`), or None."""
    name = overload._overloadname
    functional = "default" if name == "out" else name[:-4] if name.endswith("_out") else None
    return None if functional is None else getattr(overload.overloadpacket, functional, None)


def out_form_of_pointwise(overload: torch._ops.OpOverload) -> bool:
    """The out= form (out arguments in its schema) of its packet's pointwise-tagged functional overload (`x.out` of
    `x.default`, `x.Y_out` of `x.Y`), taking the same arguments and `out`: torch tags
    hardtanh.default, elu.default, relu.default and a dozen others pointwise, and not their .out forms, which models reach too (F.hardtanh runs
    hardtanh.out where eager has an output to write)."""
    schema = overload._schema.arguments
    if not any(a.is_out for a in schema):  # the schema, not torch.Tag.out: torch 2.11 has no such tag
        return False
    base = functional_of(overload)
    if base is None or torch.Tag.pointwise not in base.tags:
        return False
    args = [(a.name, str(a.type)) for a in schema if not a.is_out]
    return args == [(a.name, str(a.type)) for a in base._schema.arguments]


def tagged_nowhere(overload: torch._ops.OpOverload) -> bool:
    """No overload of this one's packet carries torch's pointwise tag. The tag tells a packet's
    overloads apart (max.other from max.dim, where.self from where.default); a packet tagged
    nowhere is for the code generator's op table to judge: in-place forms torch leaves untagged
    (gelu_, relu6_, threshold_) and, on torch 2.11, leaky_relu, hardtanh_, elu_, selu_, celu_ and
    hardsigmoid_, which later versions tag (2.13 does; pytorch/pytorch PR 173869 added the tags)."""
    packet = overload.overloadpacket
    return not any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _from_table(name: str, overload: torch._ops.OpOverload) -> bool:
    from .codegen.ops import POINTWISE as TABLE  # here, not at import: the table imports torch internals

    base = name[:-1] if name.endswith("_") and not name.startswith("__") else name
    return base in TABLE and tagged_nowhere(overload)


def _resolve(qualname: str) -> torch._ops.OpOverload | None:
    ns, _, rest = qualname.partition("::")
    name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
    except AttributeError:  # an op this torch does not have: classify by name alone
        return None

