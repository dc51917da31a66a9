"""Row normalization shared by layer_norm and rms_norm: statistics over the trailing
`normalized_shape` elements of each row, then an affine map, all in fp32.

Algorithms:
  warp        a warp per row, row in registers, two-pass statistics (mean, then squared
              deviations from it: exact where sum/sum-of-squares would cancel);
  block_regs  a block per row, row in registers, two-pass;
  block_online  a block per row for rows too long for registers: Welford (or sum of
              squares for RMS) in one read, a second read (mostly from L2) to write.
rstd = rsqrt(var + eps) with the biased variance, as torch computes it on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cards import Card, TensorMeta
from ...hardware import Hardware
from .common import ceil_div, constants, ctype, legal_vecs, render, unsupported_dtype
from .template import Knobs, KnobSpace, candidate, launch, pick

MAX_REGS = 64


@dataclass
class RowNorm:
    rms: bool
    x: TensorMeta
    weight: TensorMeta | None
    bias: TensorMeta | None
    eps: float
    rows: int
    cols: int
    weight_index: int | None  # in card.inputs
    bias_index: int | None


# Fewer rows than about half the SMs of a data-center GPU, each long enough to split: these
# templates run a block per row, which on KernelBench's LayerNorm (8 rows of 4M) was 10x slower
# than torch.compile; the generated split form takes such cards instead.
FEW_ROWS, LONG_ROW = 64, 16384


def checked(card: Card, rn: RowNorm) -> RowNorm | str:
    """The problem if the tensors fit the templates, else why not."""
    params = [m for m in (rn.weight, rn.bias) if m is not None]
    why = unsupported_dtype([rn.x, *params, *card.outputs])
    if why:
        return why
    if rn.rows * rn.cols == 0:
        return "empty input"
    if rn.rows < FEW_ROWS and rn.cols >= LONG_ROW:
        return (f"{rn.rows} rows of {rn.cols}: a block per row leaves most SMs idle "
                "(the code generator's split form spreads each row over several blocks)")
    if not rn.x.is_contiguous() or not card.outputs[0].is_contiguous() or card.outputs[0].shape != rn.x.shape:
        return "input and output must be contiguous with the same shape"
    if any(m.numel != rn.cols or not m.is_contiguous() for m in params):
        return "weight and bias must be contiguous with normalized_shape's elements"
    if any(m.numel != rn.rows or not m.is_contiguous() for m in card.outputs[1:]):
        return "mean/rstd outputs must be contiguous with one value per row"
    return rn


def _vecs(card: Card, rn: RowNorm) -> tuple:
    metas = [rn.x, card.outputs[0]] + [m for m in (rn.weight, rn.bias) if m is not None]
    return tuple(sorted(legal_vecs(rn.cols, metas)))


def _regs(cols: int, lanes: int, v: int) -> int:
    return ceil_div(cols, lanes * v) * v


def spaces(card: Card, rn: RowNorm) -> list[KnobSpace]:
    vecs = _vecs(card, rn)
    out: list[KnobSpace] = []
    if max(_regs(rn.cols, 32, v) for v in vecs) <= MAX_REGS:
        out.append({"algo": ("warp",), "warps": (1, 2, 4, 8), "vec": vecs})
    useful = tuple(t for t in (64, 128, 256, 512, 1024) if t <= max(64, rn.cols))
    regs_threads = tuple(t for t in useful if all(_regs(rn.cols, t, v) <= MAX_REGS for v in vecs))
    if regs_threads:
        # layer_norm: mean then squared deviations (two block reductions), or each thread's
        # exact (count, mean, M2) merged in one Welford block reduction (one barrier round).
        stats = {} if rn.rms else {"stats": ("two_pass", "welford")}
        out.append({"algo": ("block_regs",), "threads": regs_threads, "vec": vecs, **stats})
    out.append({"algo": ("block_online",), "threads": useful, "vec": vecs})
    return out


def default(card: Card, rn: RowNorm, hw: Hardware) -> Knobs:
    by_algo = {s["algo"][0]: s for s in spaces(card, rn)}
    vec = _vecs(card, rn)[-1]
    if "warp" in by_algo and rn.cols <= 1024:
        return {"algo": "warp", "warps": 4, "vec": vec}
    if "block_regs" in by_algo:
        # ~16 values per thread: enough bytes in flight per SM without spilling.
        stats = {} if rn.rms else {"stats": "two_pass"}
        return {"algo": "block_regs", "threads": pick(by_algo["block_regs"]["threads"], rn.cols // 16), "vec": vec, **stats}
    return {"algo": "block_online", "threads": pick(by_algo["block_online"]["threads"], 512), "vec": vec}


# Apply the affine map to V values at column c and store them (shared by every algorithm).
_STORE = r"""
__device__ __forceinline__ void kf_emit(@PARAMS@, kf_i64 row, int c, float (&v)[V], float mean, float rstd) {
  float w[V], b[V];
  if (HAS_W) kf_load<Tw, V>(weight + c, w);
  if (HAS_B) kf_load<Tb, V>(bias + c, b);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    float o = (v[j] - mean) * rstd;
    if (HAS_W) o *= w[j];
    if (HAS_B) o += b[j];
    v[j] = o;
  }
  kf_store<Ty, V>(y + row * C + c, v);
}

__device__ __forceinline__ void kf_stats(@PARAMS@, kf_i64 row, float mean, float rstd) {
  if (!RMS) mean_out[row] = kf_cast<Tm>(mean);
  rstd_out[row] = kf_cast<Tr>(rstd);
}
"""

# One row held in registers by LANES threads: two-pass statistics, then the normalized
# store (shared by warp and block_regs). Every lane takes part in the sums.
_ROW = r"""
constexpr int IT = (C + LANES * V - 1) / (LANES * V);

__device__ __forceinline__ void kf_row_load(const Tx* __restrict__ x, kf_i64 row, int lane, float (&v)[IT][V]) {
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int c = (it * LANES + lane) * V;
    if (row < R && c < C) {
      kf_load<Tx, V>(x + row * C + c, v[it]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) v[it][j] = 0.f;
    }
  }
}

__device__ __forceinline__ void kf_row(@PARAMS@, kf_i64 row, int lane, float (&v)[IT][V]) {
  // Two-pass: the row's mean, then squared deviations from it. WELFORD: this thread's own
  // mean and squared deviations (exact for its values), merged across the row in one go.
  float mean = 0.f, s = 0.f;
  int n = 0;
  if (!RMS) {
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      if (!WELFORD || (it * LANES + lane) * V < C) {  // two-pass sums the zero padding too
        n += V;
#pragma unroll
        for (int j = 0; j < V; ++j) s += v[it][j];
      }
    }
    mean = WELFORD ? (n ? s / n : 0.f) : @SUM@(s) / C;
  }
  float q = 0.f;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    if ((it * LANES + lane) * V < C) {
#pragma unroll
      for (int j = 0; j < V; ++j) q += (v[it][j] - mean) * (v[it][j] - mean);
    }
  }
  float rstd;
  if (WELFORD) {
    const kf_welford w = @WELFORD_FN@(kf_welford{float(n), mean, q});
    mean = w.mean;
    rstd = rsqrtf(w.m2 / C + EPS);
  } else {
    rstd = rsqrtf(@SUM@(q) / C + EPS);
  }
  if (row >= R) return;
  if (lane == 0) kf_stats(@ARGS@, row, mean, rstd);
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int c = (it * LANES + lane) * V;
    if (c < C) kf_emit(@ARGS@, row, c, v[it], mean, rstd);
  }
}
"""

_REGS = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_rownorm(@PARAMS@) {
  const int lane = threadIdx.x % LANES;
  const kf_i64 row = (kf_i64)blockIdx.x * (NT / LANES) + threadIdx.x / LANES;
  float v[IT][V];
  kf_row_load(x, row, lane, v);
  kf_row(@ARGS@, row, lane, v);
}
"""

_ONLINE = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_rownorm(@PARAMS@) {
  const kf_i64 row = blockIdx.x;
  kf_welford w = {0.f, 0.f, 0.f};
  float q = 0.f;
#pragma unroll 4
  for (int c = threadIdx.x * V; c < C; c += NT * V) {
    float v[V];
    kf_load<Tx, V>(x + row * C + c, v);
    if (RMS) {
#pragma unroll
      for (int j = 0; j < V; ++j) q += v[j] * v[j];
    } else {
      w = kf_welford_merge(w, kf_welford_of<V>(v));
    }
  }
  float mean = 0.f, var;
  if (RMS) {
    var = kf_block_sum<NT>(q) / C;
  } else {
    w = kf_block_welford<NT>(w);
    mean = w.mean;
    var = w.m2 / C;
  }
  const float rstd = rsqrtf(var + EPS);
  if (threadIdx.x == 0) kf_stats(@ARGS@, row, mean, rstd);
#pragma unroll 4
  for (int c = threadIdx.x * V; c < C; c += NT * V) {
    float v[V];
    kf_load<Tx, V>(x + row * C + c, v);
    kf_emit(@ARGS@, row, c, v, mean, rstd);
  }
}
"""


def build(template: str, card: Card, rn: RowNorm, knobs: Knobs):
    algo, v = knobs["algo"], knobs["vec"]
    y = card.outputs[0]
    names = [("x", "Tx", {"in": 0})]
    if rn.weight is not None:
        names.append(("weight", "Tw", {"in": rn.weight_index}))
    if rn.bias is not None:
        names.append(("bias", "Tb", {"in": rn.bias_index}))
    names.append(("y", "Ty", {"out": 0}))
    if not rn.rms:
        names.append(("mean_out", "Tm", {"out": 1}))
    names.append(("rstd_out", "Tr", {"out": len(card.outputs) - 1}))
    params = ", ".join(f"{'const ' if t in ('Tx', 'Tw', 'Tb') else ''}{t}* __restrict__ {n}" for n, t, _ in names)
    args = ", ".join(n for n, _, _ in names)
    dtypes = {rn.x.dtype, *(m.dtype for m in card.outputs)} | {m.dtype for m in (rn.weight, rn.bias) if m is not None}
    # Unused type names still need a definition for the (dead) branches that mention them.
    types = {"Tx": rn.x.dtype, "Ty": y.dtype, "Tr": card.outputs[-1].dtype, "Tm": card.outputs[1].dtype,
             "Tw": rn.weight.dtype if rn.weight else "float32", "Tb": rn.bias.dtype if rn.bias else "float32"}
    decls = constants(**{k: ctype(d) for k, d in types.items()})
    # Absent pointers are declared so the dead branches compile; they are never read.
    absent = "".join(f"constexpr const {t}* {n} = nullptr;\n" for n, t in (("weight", "Tw"), ("bias", "Tb"))
                     if n not in args.split(", "))
    if rn.rms:
        absent += "constexpr Tm* mean_out = nullptr;\n"
    common = dict(R=rn.rows, C=rn.cols, V=v, EPS=float(rn.eps), RMS=rn.rms, HAS_W=rn.weight is not None,
                  HAS_B=rn.bias is not None)
    if algo in ("warp", "block_regs"):
        warp = algo == "warp"
        nt = 32 * knobs["warps"] if warp else knobs["threads"]
        grid = ceil_div(rn.rows, nt // (32 if warp else nt))
        welford = knobs.get("stats") == "welford"
        consts = constants(NT=nt, LANES=32 if warp else nt, WELFORD=welford, **common)
        sum_fn = "kf_warp_sum" if warp else f"kf_block_sum<{nt}>"
        welford_fn = "kf_warp_welford" if warp else f"kf_block_welford<{nt}>"
        kernel = render(_ROW + _REGS, PARAMS=params, ARGS=args, SUM=sum_fn, WELFORD_FN=welford_fn)
    else:
        nt = knobs["threads"]
        consts = constants(NT=nt, **common)
        kernel = render(_ONLINE, PARAMS=params, ARGS=args)
        grid = rn.rows
    body = "\n".join([decls, consts, absent, render(_STORE, PARAMS=params), kernel])
    plan_args = [a for _, _, a in names]
    return candidate(template, card, knobs, dtypes, body, [launch("kf_rownorm", [grid], [nt], plan_args)])


def template(name: str, ops: frozenset[str], problem):
    """The Template of a row norm whose arguments `problem(card)` reads (RowNorm, or why not)."""
    from .template import Template

    def check(card: Card) -> str | None:
        p = problem(card)
        return p if isinstance(p, str) else None

    return Template(name, ops, check,
                  lambda card, hw: spaces(card, problem(card)),
                  lambda card, hw: default(card, problem(card), hw),
                  lambda card, knobs, hw: build(name, card, problem(card), knobs))
