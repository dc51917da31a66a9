"""aten::native_group_norm: (out, mean, rstd) for NCHW-contiguous input.

Eager runs one block per (sample, group), which leaves most of an H200 idle at batch 1.
Here each group is split into S chunks so N*G*S blocks fill every SM:
  kf_gn_stats   Welford (count, mean, M2) of one chunk, 16-byte loads -> workspace;
  kf_gn_apply   every block merges its group's S partials (Chan's formula, no
                sum/sum-of-squares cancellation), writes mean/rstd once per group, folds
                rstd, weight and bias into a per-channel scale and shift in shared memory,
                and normalizes its chunk: y = x * scale[c] + shift[c] (as torch does).
The second read of x mostly hits L2 when the tensor fits in it.
"""

from __future__ import annotations

from ...cards import Card, decode_value
from ...hardware import Hardware
from .common import constants, ctype, legal_vecs, render, unsupported_dtype
from .family import Family, Knobs, KnobSpace, candidate, launch, pick

OPS = frozenset({"aten::native_group_norm.default"})


def _problem(card: Card):
    if card.op not in OPS:
        return f"{card.op} is not native_group_norm"
    a = {s.name: s for s in card.args}
    x = a["input"].tensor
    weight = a["weight"].tensor if a["weight"].kind == "tensor" else None
    bias = a["bias"].tensor if a["bias"].kind == "tensor" else None
    n, c, hw_, g = (int(decode_value(a[k].value)) for k in ("N", "C", "HxW", "group"))
    why = unsupported_dtype([x, *card.outputs] + [m for m in (weight, bias) if m])
    if why:
        return why
    if n * c * hw_ == 0 or x.numel != n * c * hw_ or g <= 0 or c % g:
        return "empty input or channels not divisible by groups"
    if n * g > 65535 or c // g > 4096:
        return "more than 65535 (sample, group) pairs or 4096 channels per group is not templated"
    if not x.is_contiguous() or card.outputs[0].stride != x.stride:
        return "only NCHW-contiguous input (and output) is templated; channels_last is declined"
    if any(m.numel != c or not m.is_contiguous() for m in (weight, bias) if m):
        return "weight and bias must be contiguous with C elements"
    if any(m.numel != n * g or not m.is_contiguous() for m in card.outputs[1:]):
        return "mean/rstd outputs must be contiguous (N, group)"
    eps = float(decode_value(a["eps"].value))
    return dict(x=x, weight=weight, bias=bias, N=n, C=c, HW=hw_, G=g, eps=eps,
                wi=1 if weight else None, bi=(2 if weight else 1) if bias else None)


def check(card: Card) -> str | None:
    p = _problem(card)
    return p if isinstance(p, str) else None


def _vecs(card: Card, p) -> tuple:
    # A vector never crosses a channel (HW % V == 0), so it has one scale and shift.
    return tuple(sorted(legal_vecs(p["HW"], [p["x"], card.outputs[0]])))


def _splits(p, vmax: int) -> tuple:
    group = p["C"] // p["G"] * p["HW"]
    return tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if group % (s * vmax) == 0 and group // s >= 256)


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    p = _problem(card)
    vecs = _vecs(card, p)
    return [{"algo": ("split",), "split": _splits(p, vecs[-1]) or (1,), "threads": (128, 256, 512), "vec": vecs}]


def default(card: Card, hw: Hardware) -> Knobs:
    p = _problem(card)
    space = spaces(card, hw)[0]
    want = 4 * hw.sm_count / (p["N"] * p["G"])  # ~4 blocks per SM
    return {"algo": "split", "split": pick(space["split"], want), "threads": 256, "vec": space["vec"][-1]}


_KERNELS = r"""
constexpr int CG = C / G;
constexpr kf_i64 GROUP = (kf_i64)CG * HW;  // elements of one (n, g)
constexpr kf_i64 CH = GROUP / S;            // elements of one chunk

extern "C" __global__ void __launch_bounds__(NT) kf_gn_stats(const Tx* __restrict__ x, float* __restrict__ ws) {
  const kf_i64 ng = blockIdx.y;
  const Tx* p = x + ng * GROUP + blockIdx.x * CH;
  kf_welford w = {0.f, 0.f, 0.f};
#pragma unroll 4
  for (kf_i64 i = threadIdx.x * V; i < CH; i += NT * V) {
    float v[V];
    kf_load<Tx, V>(p + i, v);
    w = kf_welford_merge(w, kf_welford_of<V>(v));
  }
  w = kf_block_welford<NT>(w);
  if (threadIdx.x == 0) {
    ws[(ng * S + blockIdx.x) * 2] = w.mean;
    ws[(ng * S + blockIdx.x) * 2 + 1] = w.m2;
  }
}

extern "C" __global__ void __launch_bounds__(NT) kf_gn_apply(@PARAMS@) {
  __shared__ float scale[CG], shift[CG];
  const kf_i64 ng = blockIdx.y;
  kf_welford w = {0.f, 0.f, 0.f};
  for (int j = threadIdx.x; j < S; j += NT)
    w = kf_welford_merge(w, kf_welford{float(CH), ws[(ng * S + j) * 2], ws[(ng * S + j) * 2 + 1]});
  w = kf_block_welford<NT>(w);
  const float mean = w.mean, rstd = rsqrtf(fmaxf(w.m2 / GROUP, 0.f) + EPS);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    mean_out[ng] = kf_cast<Tm>(mean);
    rstd_out[ng] = kf_cast<Tr>(rstd);
  }
  const int c0 = (ng % G) * CG;
  for (int c = threadIdx.x; c < CG; c += NT) {
    const float a = HAS_W ? rstd * kf_f32(weight[c0 + c]) : rstd;
    scale[c] = a;
    shift[c] = (HAS_B ? kf_f32(bias[c0 + c]) : 0.f) - a * mean;
  }
  __syncthreads();
  const kf_i64 base = ng * GROUP + blockIdx.x * CH;
#pragma unroll 4
  for (kf_i64 i = threadIdx.x * V; i < CH; i += NT * V) {
    float v[V];
    kf_load<Tx, V>(x + base + i, v);
    const int c = (int)((blockIdx.x * CH + i) / HW);
    const float a = scale[c], b = shift[c];
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = v[j] * a + b;
    kf_store<Ty, V>(y + base + i, v);
  }
}
"""


def build(card: Card, knobs: Knobs, hw: Hardware):
    p = _problem(card)
    x, y = p["x"], card.outputs[0]
    names = [("x", "Tx", {"in": 0})]
    if p["weight"]:
        names.append(("weight", "Tw", {"in": p["wi"]}))
    if p["bias"]:
        names.append(("bias", "Tb", {"in": p["bi"]}))
    names += [("ws", "float", {"ws": 0}), ("y", "Ty", {"out": 0}), ("mean_out", "Tm", {"out": 1}),
              ("rstd_out", "Tr", {"out": 2})]
    params = ", ".join(f"{'const ' if n in ('x', 'weight', 'bias', 'ws') else ''}{t}* __restrict__ {n}" for n, t, _ in names)
    types = {"Tx": ctype(x.dtype), "Ty": ctype(y.dtype), "Tm": ctype(card.outputs[1].dtype),
             "Tr": ctype(card.outputs[2].dtype), "Tw": ctype(p["weight"].dtype if p["weight"] else "float32"),
             "Tb": ctype(p["bias"].dtype if p["bias"] else "float32")}
    absent = "".join(f"constexpr const {t}* {n} = nullptr;\n" for n, t, m in (("weight", "Tw", p["weight"]),
                                                                             ("bias", "Tb", p["bias"])) if m is None)
    nt, s = knobs["threads"], knobs["split"]
    consts = constants(C=p["C"], HW=p["HW"], G=p["G"], S=s, NT=nt, V=knobs["vec"], EPS=p["eps"],
                       HAS_W=p["weight"] is not None, HAS_B=p["bias"] is not None)
    body = "\n".join([constants(**types), consts, absent, render(_KERNELS, PARAMS=params)])
    grid = [s, p["N"] * p["G"]]
    kernels = [launch("kf_gn_stats", grid, [nt], [{"in": 0}, {"ws": 0}]),
               launch("kf_gn_apply", grid, [nt], [a for _, _, a in names])]
    dtypes = {x.dtype, *(m.dtype for m in card.outputs)} | {m.dtype for m in (p["weight"], p["bias"]) if m}
    return candidate("group_norm", card, knobs, dtypes, body, kernels, [p["N"] * p["G"] * s * 2 * 4])


FAMILY = Family("group_norm", OPS, check, spaces, default, build)
