"""Elementwise unary and binary ops with broadcasting, type promotion and in-place forms,
and `_to_copy` (a dtype and/or layout change on the same device: the identity map).

The layout is reduced the way TensorIterator does it: dims of size 1 dropped, dims put
in the output's memory order, neighbours merged wherever every tensor is contiguous
across them. A fully contiguous op becomes one flat dim (16-byte vectors, scalar tail);
anything else (broadcast, transposed, strided inputs) keeps its coalesced dims as
compile-time sizes and strides, vectorized along the inner dim when it is legal.
Values are computed in fp32 (torch's opmath) and rounded once on store, so a copy is
exactly torch's cast: fp16/bf16 -> fp32 is exact and fp32 -> fp16/bf16 rounds to nearest
even (__float2half_rn, __float2bfloat16_rn: the intrinsics c10's Half and BFloat16 use on
sm_80+); fp16 <-> bf16 goes through fp32 like torch's copy kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...cards import Card, TensorMeta, decode_value, dtype_name
from ...hardware import Hardware
from .common import ceil_div, constants, ctype, f32, render, unsupported_dtype
from .template import Knobs, KnobSpace, Template, candidate, launch

_GELU = {
    "none": "0.5f * a * (1.f + erff(a * 0.70710678118654752f))",
    "tanh": "0.5f * a * (1.f + tanhf(0.79788456080286536f * (a + 0.044715f * a * a * a)))",
}
UNARY = {
    "relu": "(a < 0.f ? 0.f : a)",  # NaN stays NaN, like torch's clamp_min
    "silu": "a / (1.f + expf(-a))",
    "sigmoid": "1.f / (1.f + expf(-a))",
    "tanh": "tanhf(a)",
}
BINARY = {"add": "a + @ALPHA@ * b", "sub": "a - @ALPHA@ * b", "mul": "a * b", "div": "a / b"}

OPS = frozenset(
    [f"aten::{n}.default" for n in ("relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "tanh")]
    + [f"aten::{n}{ip}.{ov}" for n in BINARY for ip in ("", "_") for ov in ("Tensor", "Scalar")]
    + ["aten::_to_copy.default"]
)


@dataclass
class _Op:
    expr: str  # CUDA fp32 expression over a (self) and b (other)
    operands: list[TensorMeta | str]  # tensor, or a float literal for a scalar operand
    in_place: bool


def _copy_declined(card: Card, args: dict) -> str | None:
    """Why a _to_copy call is more than a copy on the input's device, or None.

    dtype and memory_format need nothing here: the card's output records the dtype and the
    strides torch chose, and the layout reduction writes any dense output order. non_blocking
    only matters for host<->device copies; on one device a kernel is stream-ordered anyway."""
    src = args["self"].tensor

    def value(name: str):
        return decode_value(args[name].value) if name in args else None

    device, layout, dtype = value("device"), value("layout"), value("dtype")
    if device is not None and device.type != src.device:
        return f"_to_copy to device {device.type} from {src.device}: only copies on the input's device are templated"
    if value("pin_memory"):
        return "_to_copy with pin_memory=True makes a pinned host tensor"
    if layout is not None and layout != torch.strided:
        return f"_to_copy to layout {layout} is not templated (only torch.strided is)"
    if dtype is not None and dtype_name(dtype) != card.outputs[0].dtype:
        return f"_to_copy dtype={dtype_name(dtype)} but the card's output is {card.outputs[0].dtype}"
    return None


def _parse(card: Card) -> _Op | str:
    name, _, overload = card.name.partition(".")
    in_place = name.endswith("_")
    base = name.rstrip("_")
    args = {a.name: a for a in card.args}
    if any(a.kind == "tensors" for a in card.args):
        return "tensor-list arguments are not elementwise"
    if base == "_to_copy":
        why = _copy_declined(card, args)
        return why or _Op("a", [args["self"].tensor], in_place=False)
    if base in UNARY or base == "gelu":
        approx = decode_value(args["approximate"].value) if "approximate" in args else "none"
        if base == "gelu" and approx not in _GELU:
            return f"gelu approximate={approx!r} is not templated"
        return _Op(_GELU[approx] if base == "gelu" else UNARY[base], [args["self"].tensor], in_place)
    alpha = decode_value(args["alpha"].value) if "alpha" in args else 1
    other = args["other"]
    if not isinstance(alpha, (int, float)) or (other.kind == "value" and not isinstance(decode_value(other.value), (int, float))):
        return "scalar operands must be real numbers"
    expr = render(BINARY[base], ALPHA=f32(alpha))
    if other.kind == "tensor":
        return _Op(expr, [args["self"].tensor, other.tensor], in_place)
    value = float(decode_value(other.value))
    if base == "div":  # torch multiplies by the fp32 reciprocal of a CPU scalar divisor
        return _Op("a * b", [args["self"].tensor, f32(np.float32(1.0) / np.float32(value))], in_place)
    if base in ("add", "sub"):  # opmath computes alpha * other in fp32 first
        return _Op("a + b" if base == "add" else "a - b", [args["self"].tensor, f32(np.float32(alpha) * np.float32(value))], in_place)
    return _Op(expr, [args["self"].tensor, f32(value)], in_place)


@dataclass
class _Layout:
    sizes: list[int]  # coalesced dims, outermost first, in the output's memory order
    strides: list[list[int]]  # per tensor (output first, then tensor operands), per dim


def _broadcast_strides(m: TensorMeta, shape: tuple[int, ...]) -> list[int] | None:
    lead = len(shape) - len(m.shape)
    out = []
    for d, size in enumerate(shape):
        k = d - lead
        if k < 0 or m.shape[k] == 1:
            out.append(0)
        elif m.shape[k] != size:
            return None
        else:
            out.append(m.stride[k])
    return out


def _layout(out: TensorMeta, tensors: list[TensorMeta]) -> _Layout | str:
    if out.numel == 0:
        return "empty output"
    if any(s < 0 for m in [out, *tensors] for s in m.stride):
        return "negative strides are not templated"
    if out.span() != out.numel:
        return "the output is not dense (it overlaps or has gaps)"
    all_strides = [list(out.stride)]
    for m in tensors:
        st = _broadcast_strides(m, out.shape)
        if st is None:
            return f"operand shape {m.shape} does not broadcast to {out.shape}"
        all_strides.append(st)
    dims = sorted((d for d, s in enumerate(out.shape) if s != 1), key=lambda d: -out.stride[d])
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in all_strides]
    for d in dims:
        if sizes and all(st[-1] == src[d] * out.shape[d] for st, src in zip(strides, all_strides)):
            sizes[-1] *= out.shape[d]
            for st, src in zip(strides, all_strides):
                st[-1] = src[d]
        else:
            sizes.append(out.shape[d])
            for st, src in zip(strides, all_strides):
                st.append(src[d])
    if not sizes:
        sizes, strides = [1], [[0] for _ in all_strides]
    return _Layout(sizes, strides)


def _prepare(card: Card):
    if card.op not in OPS:
        return f"{card.op} is not a templated pointwise op"
    if len(card.outputs) != 1:
        return "expected one output"
    op = _parse(card)
    if isinstance(op, str):
        return op
    metas = [m for m in op.operands if isinstance(m, TensorMeta)]
    why = unsupported_dtype(metas + card.outputs)
    if why:
        return why
    if op.in_place and card.aliases.get(0) != 0:
        return "in-place op whose card does not record output 0 aliasing input 0"
    if op.in_place and metas[0].key()[:3] != card.outputs[0].key()[:3]:
        return "in-place output does not match self's shape, strides and dtype"
    lay = _layout(card.outputs[0], metas)
    return lay if isinstance(lay, str) else (op, metas, lay)


def check(card: Card) -> str | None:
    r = _prepare(card)
    return r if isinstance(r, str) else None


def _vec_ok(v: int, lay: _Layout, metas: list[TensorMeta]) -> bool:
    flat = len(lay.sizes) == 1
    if not flat and lay.sizes[-1] % v:
        return False
    for m, st in zip(metas, lay.strides):
        if st[-1] == 1:
            if v * m.itemsize > 16 or m.align % (v * m.itemsize) or any(s % v for s in st[:-1]):
                return False
    return True


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    op, metas, lay = _prepare(card)
    tensors = [card.outputs[0], *metas]
    vecs = tuple(v for v in (1, 2, 4, 8, 16) if _vec_ok(v, lay, tensors))
    return [{"algo": ("flat",), "threads": (64, 128, 256, 512, 1024), "vec": vecs, "items": (1, 2, 4, 8),
             "grid": ("exact", "stride")}]


def default(card: Card, hw: Hardware) -> Knobs:
    space = spaces(card, hw)[0]
    vec = space["vec"][-1]
    nvec = card.outputs[0].numel // vec
    # One vector a thread, as the generator's flat kernels (generated.default says what it measured).
    return {"algo": "flat", "threads": 256 if nvec >= 256 * hw.sm_count else 128, "vec": vec, "items": 1,
            "grid": "exact"}


_KERNEL = r"""
@CONSTS@

__device__ __forceinline__ void kf_offsets(kf_idx e, kf_idx (&o)[NTENS]) {
@OFFSETS@
}

extern "C" __global__ void __launch_bounds__(NT) kf_pointwise(@PARAMS@) {
@HOIST@
  for (kf_idx base = (kf_idx)blockIdx.x * (NT * IT) + threadIdx.x; base < NV; base += (kf_idx)gridDim.x * (NT * IT)) {
    kf_idx off[IT][NTENS];
@DECLS@
#pragma unroll
    for (int k = 0; k < IT; ++k) {
      if (base + k * NT < NV) {
        kf_offsets((base + k * NT) * V, off[k]);
@LOADS@
      }
    }
#pragma unroll
    for (int k = 0; k < IT; ++k) {
      if (base + k * NT < NV) {
        float r[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
@VALUES@
          r[j] = @EXPR@;
        }
        kf_store<Tout, V>(out + off[k][0], r);
      }
    }
  }
  if (TAIL > 0 && blockIdx.x == 0 && threadIdx.x < TAIL) {
    kf_idx o[NTENS];
    kf_offsets(NV * V + threadIdx.x, o);
    const int j = 0, k = 0;
@TAIL_LOADS@
@VALUES@
    out[o[0]] = kf_cast<Tout>(@EXPR@);
  }
}
"""


def build(card: Card, knobs: Knobs, hw: Hardware):
    op, metas, lay = _prepare(card)
    out = card.outputs[0]
    nt, v, it = knobs["threads"], knobs["vec"], knobs["items"]
    numel = out.numel
    nv = numel // v
    tail = numel - nv * v
    span = max([numel] + [m.span() for m in metas]) + 2 * nt * it * v
    big = span >= 2**31 or nv + (numel + nt * it) >= 2**31
    n = len(lay.sizes)

    # Offsets of element e in each tensor (output first, then tensor operands).
    lines = ["  kf_idx c;"]
    for d in range(n - 1, -1, -1):
        lines.append(f"  c = e % {lay.sizes[d]};  e /= {lay.sizes[d]};" if d else "  c = e;")
        for t, st in enumerate(lay.strides):
            op_ = "=" if d == n - 1 else "+="
            lines.append(f"  o[{t}] {op_} c * {st[d]};" if st[d] else (f"  o[{t}] = 0;" if d == n - 1 else ""))
    offsets = "\n".join(x for x in lines if x)

    # In-place: self is read through `out` (no second pointer to the same memory).
    params = [f"Tout* {'' if op.in_place else '__restrict__ '}out"]
    hoist, decls, loads, tail_loads, values = [], [], [], [], []
    ti = 0
    for i, operand in enumerate(op.operands):
        var = "ab"[i]
        if isinstance(operand, str):
            values.append(f"          const float {var} = {operand};")
            continue
        ti += 1
        m = metas[ti - 1]
        ptr = "out" if (op.in_place and i == 0) else f"in{i}"
        if ptr != "out":
            params.append(f"const T{i}* __restrict__ {ptr}")
        # A 0-dim operand beside a dimensioned one takes no part in type promotion: torch
        # casts it to the result dtype before the math. Dimensioned operands of another
        # dtype (add_(bf16, fp32)) are computed in fp32 and only rounded on store, as is a
        # copy's one operand.
        mixed = (len(op.operands) > 1 and not m.shape and any(isinstance(o, TensorMeta) and o.shape for o in op.operands)
                 and m.dtype != out.dtype != "float32")
        conv = (lambda x: f"kf_f32(kf_cast<Tout>({x}))") if mixed else (lambda x: x)
        st = lay.strides[ti]
        if not any(st):  # one value for the whole op
            hoist.append(f"  const float s{i} = {conv(f'kf_f32({ptr}[0])')};")
            values.append(f"          const float {var} = s{i};")
            continue
        decls.append(f"    float x{i}[IT][V];")
        tail_loads.append(f"    float x{i}[1][1] = {{{{kf_f32({ptr}[o[{ti}]])}}}};")
        values.append(f"          const float {var} = {conv(f'x{i}[k][j]')};")
        if st[-1] == 1:
            loads.append(f"        kf_load<T{i}, V>({ptr} + off[k][{ti}], x{i}[k]);")
        else:  # broadcast or strided along the inner dim: element loads
            loads.append(f"        for (int j = 0; j < V; ++j) x{i}[k][j] = kf_f32({ptr}[off[k][{ti}] + j * {st[-1]}]);")
    types = {"Tout": ctype(out.dtype), "kf_idx": "kf_i64" if big else "int"}
    for i, operand in enumerate(op.operands):
        if isinstance(operand, TensorMeta):
            types[f"T{i}"] = ctype(operand.dtype)
    consts = "\n".join([constants(**types), constants(NT=nt, V=v, IT=it, NV=nv, TAIL=tail, NTENS=len(lay.strides))])
    src = render(_KERNEL, CONSTS=consts, OFFSETS=offsets, PARAMS=", ".join(params), HOIST="\n".join(hoist),
                 DECLS="\n".join(decls), LOADS="\n".join(loads), TAIL_LOADS="\n".join(tail_loads),
                 VALUES="\n".join(values), EXPR=op.expr)
    blocks = max(1, ceil_div(nv, nt * it))
    if knobs["grid"] == "stride":
        blocks = min(blocks, hw.sm_count * max(1, 2048 // nt))
    args = [{"out": 0}] + [{"in": i} for i, o in enumerate(op.operands)
                           if isinstance(o, TensorMeta) and not (op.in_place and i == 0)]
    dtypes = {out.dtype, *(m.dtype for m in metas)}
    return candidate("pointwise", card, knobs, dtypes, src, [launch("kf_pointwise", [blocks], [nt], args)])


TEMPLATE = Template("pointwise", OPS, check, spaces, default, build)
