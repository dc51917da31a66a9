"""Mean over dims (aten::mean.dim) and adaptive average pooling (aten::_adaptive_avg_pool2d).

A mean is put in the input's memory order and seen as [P, R, Q]: P kept outer elements,
R reduced, Q kept inner ones (Q = 1 for NCHW spatial means, Q = C for channels_last).
  rows    (Q == 1) K lanes per row, shuffle-reduced; short rows (7x7 = 49) waste no lanes;
  cols    (Q > 1) threads across Q with 16-byte vectors, threadIdx.y splitting R,
          partial sums merged in shared memory;
  window  adaptive pooling to a general output size: one thread per output, any strides.
Sums are fp32; the mean multiplies by torch's factor (outputs / inputs, in fp32).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ...cards import Card, TensorMeta, decode_value
from ...hardware import Hardware
from .common import ceil_div, constants, ctype, f32, legal_vecs, unsupported_dtype
from .template import Knobs, KnobSpace, Template, candidate, launch, pick

OPS = frozenset({"aten::mean.dim", "aten::_adaptive_avg_pool2d.default"})


@dataclass
class _Reduce:
    P: int
    R: int
    Q: int


@dataclass
class _Window:
    out_hw: tuple[int, int]


def _reduce_layout(x: TensorMeta, out: TensorMeta, reduced: set[int], keepdim: bool) -> _Reduce | str:
    if any(s < 0 for s in x.stride) or x.span() != x.numel:
        return "the input is not dense (it overlaps, has gaps or negative strides)"
    dims = sorted((d for d in range(len(x.shape)) if x.shape[d] != 1), key=lambda d: -x.stride[d])
    pattern = "".join("r" if d in reduced else "k" for d in dims)
    if not re.fullmatch("k*r*k*", pattern):
        return "the reduced dims are not contiguous in memory (kept dims between them)"
    first_r = pattern.find("r")
    outer = dims[:first_r] if first_r >= 0 else dims
    inner = [d for d in dims[first_r:] if d not in reduced] if first_r >= 0 else []
    # The output must hold the kept elements densely in the same order: offset p * Q + q.
    out_dim = {d: (d if keepdim else d - sum(1 for r in reduced if r < d)) for d in outer + inner}
    expected = 1
    for d in reversed(outer + inner):
        if out.stride[out_dim[d]] != expected:
            return "the output's layout does not follow the input's kept dims"
        expected *= x.shape[d]
    red = _Reduce(math.prod(x.shape[d] for d in outer), math.prod(x.shape[d] for d in dims if d in reduced),
                  math.prod(x.shape[d] for d in inner))
    if red.Q > 1 and red.P > 65535:
        return "more than 65535 outer rows around an inner kept dim is not templated"
    return red


def _problem(card: Card):
    if card.op not in OPS:
        return f"{card.op} is not a templated mean/pooling op"
    x, out = card.args[0].tensor, card.outputs[0]
    why = unsupported_dtype([x, out])
    if why:
        return why
    if x.numel == 0 or not x.shape:
        return "empty or 0-dim input"
    a = {s.name: s for s in card.args}
    ndim = len(x.shape)
    if card.op == "aten::mean.dim":
        if "dtype" in a and decode_value(a["dtype"].value) is not None:
            return "mean with an explicit dtype is not templated"
        dims = decode_value(a["dim"].value) if "dim" in a else None
        reduced = set(range(ndim)) if not dims else {d % ndim for d in dims}
        keepdim = bool(decode_value(a["keepdim"].value)) if "keepdim" in a else False
        return _reduce_layout(x, out, reduced, keepdim)
    size = tuple(decode_value(a["output_size"].value))
    if ndim not in (3, 4):
        return "adaptive_avg_pool2d needs a 3-D or 4-D input"
    if size == (1, 1):
        return _reduce_layout(x, out, {ndim - 2, ndim - 1}, True)
    if any(s < 0 for s in x.stride + out.stride):
        return "negative strides are not templated"
    return _Window(size)


def check(card: Card) -> str | None:
    p = _problem(card)
    return p if isinstance(p, str) else None


def _cols_vecs(card: Card, p: _Reduce) -> tuple:
    return tuple(sorted(legal_vecs(p.Q, [card.args[0].tensor, card.outputs[0]])))


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    p = _problem(card)
    if isinstance(p, _Window):
        return [{"algo": ("window",), "threads": (64, 128, 256, 512)}]
    if p.Q == 1:
        vecs = tuple(sorted(legal_vecs(p.R, [card.args[0].tensor])))
        lanes = tuple(k for k in (1, 2, 4, 8, 16, 32) if k == 1 or k * vecs[0] <= 2 * p.R)
        return [{"algo": ("rows",), "lanes": lanes, "threads": (64, 128, 256, 512), "vec": vecs}]
    return [{"algo": ("cols",), "threads": (64, 128, 256, 512), "ty": (1, 2, 4, 8, 16), "vec": _cols_vecs(card, p)}]


def default(card: Card, hw: Hardware) -> Knobs:
    p = _problem(card)
    space = spaces(card, hw)[0]
    if isinstance(p, _Window):
        return {"algo": "window", "threads": 256}
    vec = space["vec"][-1]
    if p.Q == 1:
        return {"algo": "rows", "lanes": pick(space["lanes"], p.R / vec / 6), "threads": 256, "vec": vec}
    # Enough threads along R that P * Q / V columns times ty fill the GPU.
    columns = p.P * p.Q // vec
    ty = pick(space["ty"], 4 * hw.sm_count * 256 / max(columns, 1))
    return {"algo": "cols", "threads": 256, "ty": ty, "vec": vec}


_ROWS = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_mean_rows(const Tx* __restrict__ x, Ty* __restrict__ y) {
  const kf_i64 p = (kf_i64)blockIdx.x * (NT / K) + threadIdx.x / K;
  const int lane = threadIdx.x % K;
  float s = 0.f;
  if (p < P) {
#pragma unroll 4
    for (int r = lane * V; r < R; r += K * V) {
      float v[V];
      kf_load<Tx, V>(x + p * R + r, v);
#pragma unroll
      for (int j = 0; j < V; ++j) s += v[j];
    }
  }
#pragma unroll
  for (int o = K / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (p < P && lane == 0) y[p] = kf_cast<Ty>(s * FACTOR);
}
"""

_COLS = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_mean_cols(const Tx* __restrict__ x, Ty* __restrict__ y) {
  constexpr int TX = NT / TY;
  __shared__ float part[TY > 1 ? TY : 1][TX * V];
  const kf_i64 p = blockIdx.y;
  const int q = (blockIdx.x * TX + threadIdx.x) * V;
  float s[V];
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = 0.f;
  if (q < Q) {
#pragma unroll 4
    for (int r = threadIdx.y; r < R; r += TY) {
      float v[V];
      kf_load<Tx, V>(x + (p * R + r) * Q + q, v);
#pragma unroll
      for (int j = 0; j < V; ++j) s[j] += v[j];
    }
  }
  if (TY > 1) {
#pragma unroll
    for (int j = 0; j < V; ++j) part[threadIdx.y][threadIdx.x * V + j] = s[j];
    __syncthreads();
    if (threadIdx.y != 0) return;
    for (int t = 1; t < TY; ++t)
#pragma unroll
      for (int j = 0; j < V; ++j) s[j] += part[t][threadIdx.x * V + j];
  }
  if (q < Q) {
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] *= FACTOR;
    kf_store<Ty, V>(y + p * Q + q, s);
  }
}
"""

_WINDOW = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_adaptive_avg(const Tx* __restrict__ x, Ty* __restrict__ y) {
  const kf_i64 i = (kf_i64)blockIdx.x * NT + threadIdx.x;
  if (i >= NOUT) return;
  const int ow = i % OW, oh = (i / OW) % OH;
  const kf_i64 c = (i / (OW * OH)) % CC, n = i / ((kf_i64)OW * OH * CC);
  const int h0 = oh * H / OH, h1 = ((oh + 1) * H + OH - 1) / OH;
  const int w0 = ow * W / OW, w1 = ((ow + 1) * W + OW - 1) / OW;
  const Tx* p = x + n * XN + c * XC;
  float s = 0.f;
  for (int h = h0; h < h1; ++h)
    for (int w = w0; w < w1; ++w) s += kf_f32(p[h * XH + w * XW]);
  y[n * YN + c * YC + oh * YH + ow * YW] = kf_cast<Ty>(s / ((h1 - h0) * (w1 - w0)));
}
"""


def build(card: Card, knobs: Knobs, hw: Hardware):
    p = _problem(card)
    x, out = card.args[0].tensor, card.outputs[0]
    types = constants(Tx=ctype(x.dtype), Ty=ctype(out.dtype))
    io = [{"in": 0}, {"out": 0}]
    nt = knobs["threads"]
    if isinstance(p, _Window):
        xs = (0,) * (4 - len(x.shape)) + x.stride
        ys = (0,) * (4 - len(out.shape)) + out.stride
        shape = (1,) * (4 - len(x.shape)) + x.shape
        oh, ow = p.out_hw
        consts = constants(NT=nt, NOUT=out.numel, OH=oh, OW=ow, CC=shape[1], H=shape[2], W=shape[3],
                           XN=xs[0], XC=xs[1], XH=xs[2], XW=xs[3], YN=ys[0], YC=ys[1], YH=ys[2], YW=ys[3])
        body, kernel = _WINDOW, launch("kf_adaptive_avg", [ceil_div(out.numel, nt)], [nt], io)
    else:
        factor = f32(np.float32(p.P * p.Q) / np.float32(p.P * p.R * p.Q))
        common = dict(NT=nt, P=p.P, R=p.R, Q=p.Q, V=knobs["vec"])
        if knobs["algo"] == "rows":
            consts = constants(K=knobs["lanes"], **common)
            body = _ROWS
            kernel = launch("kf_mean_rows", [ceil_div(p.P, nt // knobs["lanes"])], [nt], io)
        else:
            ty = knobs["ty"]
            consts = constants(TY=ty, **common)
            body = _COLS
            kernel = launch("kf_mean_cols", [ceil_div(p.Q, nt // ty * knobs["vec"]), p.P], [nt // ty, ty], io)
        consts += f"\nconstexpr float FACTOR = {factor};"
    return candidate("pooling", card, knobs, {x.dtype, out.dtype}, "\n".join([types, consts, body]), [kernel])


TEMPLATE = Template("pooling", OPS, check, spaces, default, build)
