"""Batch norm in inference (running statistics): aten::native_batch_norm.default with
training=False and aten::_native_batch_norm_legit_no_training.default -> (out, save_mean,
save_invstd), as CUDA eager returns them (the statistics as fp32 [C]: the running mean,
and rsqrt(running_var + eps)); and aten::cudnn_batch_norm.default with training=False,
which PyTorch sends fp32 (and fp16) batch norm to, -> (out, and three empty tensors).

Eager runs three kernels: a copy of the running mean, the inverse standard deviations,
and an elementwise kernel over broadcast per-channel operands. Here one launch streams x
with 16-byte vectors and computes each channel's statistics where it needs them (global
thread c also writes save_mean[c] and save_invstd[c]).
The arithmetic is eager's, in fp32: y = (x - mean) * weight * invstd + bias.
  NCHW      one channel per vector where H*W % V == 0; where it is not (7x7 planes), a
            vector may cross planes and each element finds its own channel;
  NHWC / 2D (channels_last, or [N, C]) a vector covers V consecutive channels.
"""

from __future__ import annotations

import math

from ...cards import Card, decode_value
from ...hardware import Hardware
from .common import ceil_div, constants, ctype, legal_vecs, render, unsupported_dtype
from .template import Knobs, KnobSpace, Template, candidate, launch, pick

OPS = frozenset({"aten::native_batch_norm.default", "aten::_native_batch_norm_legit_no_training.default",
                 "aten::cudnn_batch_norm.default"})
ITEMS = (1, 2, 4, 8)


def _channels_last_strides(shape: tuple) -> tuple:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _problem(card: Card):
    if card.op not in OPS:
        return f"{card.op} is not an inference batch norm"
    a = {s.name: s for s in card.args}
    if "training" in a and bool(decode_value(a["training"].value)):
        return "training-mode batch norm (batch statistics) is not templated; inference (running statistics) is"
    x = a["input"].tensor
    opt = {k: (a[k].tensor if a[k].kind == "tensor" else None) for k in ("weight", "bias", "running_mean", "running_var")}
    if opt["running_mean"] is None or opt["running_var"] is None:
        return "batch norm without running statistics is not templated"
    out, stats = card.outputs[0], card.outputs[1:]
    why = unsupported_dtype([x, out] + [m for m in opt.values() if m is not None])
    if why:
        return why
    if len(x.shape) < 2 or x.numel == 0:
        return "batch norm needs a non-empty input of at least 2 dims"
    c = x.shape[1]
    if any(m.numel != c or not m.is_contiguous() for m in opt.values() if m is not None):
        return "weight, bias and running statistics must be contiguous with C elements"
    # native_batch_norm returns fp32 [C] statistics; cudnn_batch_norm in inference returns
    # empty save_mean, save_var and reserve.
    write_stats = card.op != "aten::cudnn_batch_norm.default"
    if write_stats and any(m.numel != c or m.dtype != "float32" or not m.is_contiguous() for m in stats):
        return "save_mean/save_invstd must be fp32 [C] (as CUDA returns them)"
    if not write_stats and any(m.numel != 0 for m in stats):
        return "cudnn_batch_norm's statistics outputs are not empty (training mode?)"
    if out.stride != x.stride:
        return "the output's strides differ from the input's"
    if x.numel >= 2**31 - 2**22:
        return "2**31 or more elements is not templated (32-bit indexing)"
    if c > 2**20:
        # The grid also covers C threads for the statistics; with 8 items of 16 elements
        # each, its 32-bit element index would wrap past about 16M channels.
        return "more than 2**20 channels is not templated (32-bit indexing)"
    if x.is_contiguous() and len(x.shape) > 2:
        layout, extent = "nchw", math.prod(x.shape[2:])
    elif len(x.shape) == 2 and x.is_contiguous() or len(x.shape) == 4 and x.stride == _channels_last_strides(x.shape):
        layout, extent = "nhwc", c
    else:
        return "only contiguous (NCHW) and channels_last inputs are templated"
    inputs = [k for k in ("weight", "bias", "running_mean", "running_var") if opt[k] is not None]
    eps = float(decode_value(a["eps" if "eps" in a else "epsilon"].value))  # cudnn_batch_norm: epsilon
    return dict(x=x, opt=opt, C=c, layout=layout, extent=extent, eps=eps, write_stats=write_stats,
                index={k: 1 + inputs.index(k) for k in inputs})


def check(card: Card) -> str | None:
    p = _problem(card)
    return p if isinstance(p, str) else None


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    p = _problem(card)
    # NCHW: any width that divides the whole tensor (a vector that crosses planes looks up
    # each element's channel); NHWC: widths that divide C.
    extent = p["x"].numel if p["layout"] == "nchw" else p["extent"]
    vecs = tuple(sorted(legal_vecs(extent, [p["x"], card.outputs[0]])))
    return [{"algo": ("eval",), "threads": (128, 256, 512), "items": ITEMS, "vec": vecs}]


def default(card: Card, hw: Hardware) -> Knobs:
    p = _problem(card)
    vec = spaces(card, hw)[0]["vec"][-1]
    # Enough blocks for several waves; then more vectors per thread to keep loads in flight.
    items = pick(ITEMS, p["x"].numel / (vec * 256 * hw.sm_count * 8))
    return {"algo": "eval", "threads": 256, "items": items, "vec": vec}


_BODY = r"""
// Channel c's statistics and affine parameters, in fp32 as eager has them.
__device__ __forceinline__ void kf_bn_params(const Tm* rm, const Tv* rv, const Tw* w, const Tb* b, int c,
                                             float& mean, float& invstd, float& weight, float& bias) {
  mean = kf_f32(rm[c]);
  invstd = rsqrtf(kf_f32(rv[c]) + EPS);
  weight = HAS_W ? kf_f32(w[c]) : 1.f;
  bias = HAS_B ? kf_f32(b[c]) : 0.f;
}

extern "C" __global__ void __launch_bounds__(NT) kf_bn_eval(const Tx* __restrict__ x, const Tw* __restrict__ w,
    const Tb* __restrict__ b, const Tm* __restrict__ rm, const Tv* __restrict__ rv, Ty* __restrict__ y,
    float* __restrict__ save_mean, float* __restrict__ save_invstd@RESERVE@) {
  const int t = blockIdx.x * NT + threadIdx.x;
  if (WRITE_STATS && t < C) {
    float mean, invstd, weight, bias;
    kf_bn_params(rm, rv, w, b, t, mean, invstd, weight, bias);
    save_mean[t] = mean;
    save_invstd[t] = invstd;
  }
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int i = (blockIdx.x * ITEMS + k) * (NT * V) + threadIdx.x * V;
    if (i >= NUMEL) break;
    float v[V];
    kf_load<Tx, V>(x + i, v);
    if (NHWC || HW % V != 0) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float mean, invstd, weight, bias;
        kf_bn_params(rm, rv, w, b, NHWC ? (i + j) % C : ((i + j) / HW) % C, mean, invstd, weight, bias);
        v[j] = (v[j] - mean) * weight * invstd + bias;
      }
    } else {
      float mean, invstd, weight, bias;
      kf_bn_params(rm, rv, w, b, (i / HW) % C, mean, invstd, weight, bias);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = (v[j] - mean) * weight * invstd + bias;
    }
    kf_store<Ty, V>(y + i, v);
  }
}
"""


def build(card: Card, knobs: Knobs, hw: Hardware):
    p = _problem(card)
    x, out = p["x"], card.outputs[0]
    opt, idx = p["opt"], p["index"]
    # A missing weight or bias is passed as the running mean's pointer and never read.
    types = constants(Tx=ctype(x.dtype), Ty=ctype(out.dtype), Tm=ctype(opt["running_mean"].dtype),
                      Tv=ctype(opt["running_var"].dtype),
                      Tw=ctype((opt["weight"] or opt["running_mean"]).dtype),
                      Tb=ctype((opt["bias"] or opt["running_mean"]).dtype))
    nt, v, items = knobs["threads"], knobs["vec"], knobs["items"]
    consts = constants(NT=nt, V=v, ITEMS=items, NUMEL=x.numel, C=p["C"], HW=p["extent"] if p["layout"] == "nchw" else 1,
                       NHWC=p["layout"] == "nhwc", HAS_W=opt["weight"] is not None, HAS_B=opt["bias"] is not None,
                       WRITE_STATS=p["write_stats"], EPS=p["eps"])
    rm = idx["running_mean"]
    args = [{"in": 0}, {"in": idx.get("weight", rm)}, {"in": idx.get("bias", rm)}, {"in": rm},
            {"in": idx["running_var"]}, {"out": 0}, {"out": 1}, {"out": 2}]
    # cudnn_batch_norm's fourth output (its empty reserve) is passed and never written.
    reserve = len(card.outputs) == 4
    if reserve:
        args.append({"out": 3})
    body = render(_BODY, RESERVE=", unsigned char* __restrict__ reserve" if reserve else "")
    grid = max(ceil_div(x.numel, nt * v * items), ceil_div(p["C"], nt) if p["write_stats"] else 1)
    dtypes = {m.dtype for m in [x, out] + [m for m in opt.values() if m is not None]}
    return candidate("batch_norm", card, knobs, dtypes, "\n".join([types, consts, body]),
                     [launch("kf_bn_eval", [grid], [nt], args)])


TEMPLATE = Template("batch_norm", OPS, check, spaces, default, build)
