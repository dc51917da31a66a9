"""aten::native_group_norm: (out, mean, rstd) for NCHW-contiguous input.

Eager runs one block per (sample, group), which leaves most of an H200 idle at batch 1.
Here each group is split into S chunks so N*G*S blocks fill every SM:
  kf_gn_stats   Welford (count, mean, M2) of one chunk, 16-byte loads -> workspace;
  kf_gn_apply   every block merges its group's S partials (Chan's formula, no
                sum/sum-of-squares cancellation), writes mean/rstd once per group, folds
                rstd, weight and bias into a per-channel scale and shift in shared memory,
                and normalizes its chunk: y = x * scale[c] + shift[c] (as torch does).
The second read of x mostly hits L2 when the tensor fits in it.

  coop          both in one cooperative launch (every block resident): a block keeps the
                first HOLD floats per thread of its chunk in registers, publishes its
                chunk's (mean, M2), counts itself in on its group's counter (zeroed before
                the launch) and waits for the group's other chunks, then normalizes the
                streamed part last-read-first (those lines are the likeliest still in L2)
                and the held part from registers. x is read from HBM once plus whatever of
                it neither registers nor L2 kept, and there is one launch.
"""

from __future__ import annotations

from ...cards import Card, decode_value
from ...hardware import Hardware
from .common import GROUP_WAIT, ceil_div, constants, ctype, group_wait_workspace, legal_vecs, render, unsupported_dtype
from .template import Knobs, KnobSpace, Template, candidate, launch, pick

OPS = frozenset({"aten::native_group_norm.default"})
HOLDS = (0, 8, 16, 32)  # coop: fp32 values a thread keeps in registers between its two passes
STASHES = (0, 16, 32, 48)  # coop: fp32 values a thread keeps in shared memory between them
COOP_THREADS = (256, 512, 1024)
STREAM = 16  # coop: values of streamed loads a thread keeps in flight beside HOLD (half at 32 registers)


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


def _resident(hold: int, hw: Hardware) -> int:
    """coop: threads per SM the register budget allows (65536 registers) with `hold` values
    held per thread on top of ~30 for the rest of the kernel, at most what the SM holds."""
    return min(2048 if hold == 0 else 1024, hw.max_threads_per_sm)


def _block_smem(p, nt: int, stash: int) -> int:
    """coop: shared memory of a block: its stash, scale/shift, reduction scratch, and the
    1 KB the driver reserves per block."""
    return stash * nt * 4 + 8 * (p["C"] // p["G"]) + 512 + 1024


def _blocks_per_sm(p, hw: Hardware, nt: int, hold: int, stash: int) -> int:
    """coop: blocks of nt threads an SM holds at once, by registers and by shared memory."""
    return min(_resident(hold, hw) // nt, (hw.smem_per_block + 1024) // _block_smem(p, nt, stash))


def _coop_geometry(p, hw: Hardware, nt: int, hold: int, v: int, stash: int = 0) -> tuple[int, int, int, int]:
    """(S, CH, ITER, MINB): chunks per group so that every block is resident at once, the
    chunk length (whole vector loads of the block), the vector loads per thread, and the
    blocks per SM that __launch_bounds__ must leave room for."""
    bps = _blocks_per_sm(p, hw, nt, hold, stash)
    group = p["C"] // p["G"] * p["HW"]
    most = max(1, bps * hw.sm_count // (p["N"] * p["G"]))
    # Whole chunks (no bounds checks) if a split of at least half the most allows them.
    s = next((s for s in range(most, (most - 1) // 2, -1) if group % (s * nt * v) == 0), most)
    ch = ceil_div(ceil_div(group, s), nt * v) * nt * v
    s = ceil_div(group, ch)
    return s, ch, ch // (nt * v), ceil_div(s * p["N"] * p["G"], hw.sm_count)


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    p = _problem(card)
    vecs = _vecs(card, p)
    out = [{"algo": ("split",), "split": _splits(p, vecs[-1]) or (1,), "threads": (128, 256, 512), "vec": vecs}]
    # Every (threads, hold) pair must leave the whole grid resident: at least one block per
    # SM for each (sample, group) at the smallest residency (1024 threads per SM).
    # A stash must leave each of those blocks room in shared memory too.
    coop_threads = tuple(t for t in COOP_THREADS if (_resident(32, hw) // t) * hw.sm_count >= p["N"] * p["G"])
    stashes = tuple(st for st in STASHES if all(_blocks_per_sm(p, hw, t, h, st) * hw.sm_count >= p["N"] * p["G"]
                                                 for t in coop_threads for h in HOLDS))
    if coop_threads and stashes:
        out.append({"algo": ("coop",), "threads": coop_threads, "hold": HOLDS, "stash": stashes, "vec": vecs})
    return out


def default(card: Card, hw: Hardware) -> Knobs:
    p = _problem(card)
    by_algo = {s["algo"][0]: s for s in spaces(card, hw)}
    if "coop" in by_algo and p["N"] * p["G"] <= hw.sm_count:
        # Measured on the H200 (2026-11-30): ahead of split at all three benchmark shapes,
        # which have a few chunks per (sample, group); with more groups than SMs a group
        # gets one block and the wait buys nothing.
        s = by_algo["coop"]
        return {"algo": "coop", "threads": pick(s["threads"], 512), "hold": 32, "stash": 0, "vec": s["vec"][-1]}
    space = by_algo["split"]
    want = 4 * hw.sm_count / (p["N"] * p["G"])  # ~4 blocks per SM
    return {"algo": "split", "split": pick(space["split"], want), "threads": 256, "vec": space["vec"][-1]}


_HEAD = r"""
constexpr int CG = C / G;
constexpr kf_i64 GROUP = (kf_i64)CG * HW;  // elements of one (n, g)

// Writes mean/rstd once per (n, g) and folds rstd, weight and bias into the per-channel
// scale and shift of y = x * scale[c] + shift[c] (as torch does), then a barrier.
__device__ __forceinline__ void kf_gn_fold(const Tw* weight, const Tb* bias, Tm* mean_out, Tr* rstd_out, kf_i64 ng,
                                           float mean, float rstd, float* scale, float* shift) {
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
}

// y = x * scale[c] + shift[c] for V values at element `at` of x and y, `in_group` into the
// group (which fixes the channel: a vector never crosses one).
__device__ __forceinline__ void kf_gn_store(Ty* __restrict__ y, kf_i64 at, kf_i64 in_group, float (&v)[V],
                                            const float* scale, const float* shift) {
  const int c = (int)(in_group / HW);
  const float a = scale[c], b = shift[c];
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = v[j] * a + b;
  kf_store<Ty, V>(y + at, v);
}
"""

_KERNELS = r"""
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
  kf_gn_fold(weight, bias, mean_out, rstd_out, ng, mean, rstd, scale, shift);
  const kf_i64 base = ng * GROUP + blockIdx.x * CH;
#pragma unroll 4
  for (kf_i64 i = threadIdx.x * V; i < CH; i += NT * V) {
    float v[V];
    kf_load<Tx, V>(x + base + i, v);
    kf_gn_store(y, base + i, blockIdx.x * CH + i, v, scale, shift);
  }
}
"""


_COOP = r"""
constexpr bool EXACT = GROUP % CH == 0;   // every chunk full: no bounds checks
constexpr int KEEP = HOLD / V < ITER ? HOLD / V : ITER;  // vector loads held in registers
constexpr int KS = STASH / V < ITER - KEEP ? STASH / V : ITER - KEEP;  // then in shared memory
constexpr int UNROLL = STREAM / V;  // streamed loads in flight per thread: STREAM values
constexpr int UNROLL_STASH = (UNROLL + 1) / 2;  // half as many where each also goes to shared memory

extern "C" __global__ void __launch_bounds__(NT, MINB) kf_gn_coop(@PARAMS@) {
  __shared__ float scale[CG], shift[CG];
  extern __shared__ float4 kf_stash_[];  // KS vectors per thread, [k][thread][V]
  float* stash = reinterpret_cast<float*>(kf_stash_);
  const kf_i64 ng = blockIdx.y;
  const kf_i64 lo = (kf_i64)blockIdx.x * CH;                           // chunk start in the group
  const kf_i64 base = ng * GROUP + lo;
  const kf_i64 len = EXACT ? CH : (GROUP - lo < CH ? GROUP - lo : CH);
  float r[KEEP > 0 ? KEEP : 1][V];
#pragma unroll
  for (int k = 0; k < KEEP; ++k) {  // every held load issued before any arithmetic
    const kf_i64 i = ((kf_i64)k * NT + threadIdx.x) * V;
    if (EXACT || i < len) kf_load<Tx, V>(x + base + i, r[k]);
  }
  kf_welford w = {0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < KEEP; ++k) {
    const kf_i64 i = ((kf_i64)k * NT + threadIdx.x) * V;
    if (EXACT || i < len) w = kf_welford_merge(w, kf_welford_of<V>(r[k]));
  }
#pragma unroll UNROLL_STASH
  for (int k = KEEP; k < KEEP + KS; ++k) {  // to shared memory
    const kf_i64 i = ((kf_i64)k * NT + threadIdx.x) * V;
    if (EXACT || i < len) {
      float v[V];
      kf_load<Tx, V>(x + base + i, v);
      w = kf_welford_merge(w, kf_welford_of<V>(v));
      kf_store<float, V>(stash + ((k - KEEP) * NT + threadIdx.x) * V, v);
    }
  }
#pragma unroll UNROLL
  for (int k = KEEP + KS; k < ITER; ++k) {  // streamed
    const kf_i64 i = ((kf_i64)k * NT + threadIdx.x) * V;
    if (EXACT || i < len) {
      float v[V];
      kf_load<Tx, V>(x + base + i, v);
      w = kf_welford_merge(w, kf_welford_of<V>(v));
    }
  }
  w = kf_block_welford<NT>(w);
  kf_publish_and_wait(ws, ng, make_float2(w.mean, w.m2));
  // Every block of the group has published: merge its S partials. The last chunk may be
  // short; its count is what it covered.
  const float2* part = kf_partials(ws) + ng * S;
  kf_welford t = {0.f, 0.f, 0.f};
  for (int j = threadIdx.x; j < S; j += NT) {
    const float2 q = __ldcg(&part[j]);
    const float n = float(EXACT || (kf_i64)(j + 1) * CH <= GROUP ? CH : GROUP - (kf_i64)j * CH);
    t = kf_welford_merge(t, kf_welford{n, q.x, q.y});
  }
  t = kf_block_welford<NT>(t);
  const float mean = t.mean, rstd = rsqrtf(fmaxf(t.m2 / GROUP, 0.f) + EPS);
  kf_gn_fold(weight, bias, mean_out, rstd_out, ng, mean, rstd, scale, shift);
#pragma unroll UNROLL
  for (int k = ITER - 1; k >= KEEP + KS; --k) {  // last read first
    const kf_i64 i = ((kf_i64)k * NT + threadIdx.x) * V;
    if (EXACT || i < len) {
      float v[V];
      kf_load<Tx, V>(x + base + i, v);
      kf_gn_store(y, base + i, lo + i, v, scale, shift);
    }
  }
#pragma unroll UNROLL
  for (int k = KEEP; k < KEEP + KS; ++k) {  // from shared memory (each thread its own)
    const kf_i64 i = ((kf_i64)k * NT + threadIdx.x) * V;
    if (EXACT || i < len) {
      float v[V];
      kf_load<float, V>(stash + ((k - KEEP) * NT + threadIdx.x) * V, v);
      kf_gn_store(y, base + i, lo + i, v, scale, shift);
    }
  }
#pragma unroll
  for (int k = 0; k < KEEP; ++k) {
    const kf_i64 i = ((kf_i64)k * NT + threadIdx.x) * V;
    if (EXACT || i < len) kf_gn_store(y, base + i, lo + i, r[k], scale, shift);
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
    coop = knobs["algo"] == "coop"  # its workspace is counters it writes, then partials
    names += [("ws", "unsigned" if coop else "float", {"ws": 0}), ("y", "Ty", {"out": 0}),
              ("mean_out", "Tm", {"out": 1}), ("rstd_out", "Tr", {"out": 2})]
    read_only = ("x", "weight", "bias") if coop else ("x", "weight", "bias", "ws")
    params = ", ".join(f"{'const ' if n in read_only else ''}{t}* __restrict__ {n}" for n, t, _ in names)
    types = {"Tx": ctype(x.dtype), "Ty": ctype(y.dtype), "Tm": ctype(card.outputs[1].dtype),
             "Tr": ctype(card.outputs[2].dtype), "Tw": ctype(p["weight"].dtype if p["weight"] else "float32"),
             "Tb": ctype(p["bias"].dtype if p["bias"] else "float32")}
    absent = "".join(f"constexpr const {t}* {n} = nullptr;\n" for n, t, m in (("weight", "Tw", p["weight"]),
                                                                             ("bias", "Tb", p["bias"])) if m is None)
    nt, v = knobs["threads"], knobs["vec"]
    common = dict(C=p["C"], HW=p["HW"], G=p["G"], NT=nt, V=v, EPS=p["eps"],
                  HAS_W=p["weight"] is not None, HAS_B=p["bias"] is not None)
    args = [a for _, _, a in names]
    if coop:
        stash = knobs.get("stash", 0)
        s, ch, it, minb = _coop_geometry(p, hw, nt, knobs["hold"], v, stash)
        ng = p["N"] * p["G"]
        wait, wait_ws = group_wait_workspace(ng, s)
        consts = constants(S=s, CH=ch, ITER=it, HOLD=knobs["hold"], STASH=stash, MINB=minb, **wait,
                           STREAM=max(STREAM // 2 if knobs["hold"] == 0 else STREAM, v), **common)
        body = "\n".join([constants(**types), consts, absent, GROUP_WAIT, render(_HEAD + _COOP, PARAMS=params)])
        kernels = [launch("kf_gn_coop", [s, ng], [nt], args, smem=stash * nt * 4, cooperative=True)]
        ws = [wait_ws]
    else:
        s = knobs["split"]
        consts = constants(S=s, **common)
        body = "\n".join([constants(**types), consts, absent, render(_HEAD + _KERNELS, PARAMS=params)])
        grid = [s, p["N"] * p["G"]]
        kernels = [launch("kf_gn_stats", grid, [nt], [{"in": 0}, {"ws": 0}]), launch("kf_gn_apply", grid, [nt], args)]
        ws = [p["N"] * p["G"] * s * 2 * 4]
    dtypes = {x.dtype, *(m.dtype for m in card.outputs)} | {m.dtype for m in (p["weight"], p["bias"]) if m}
    return candidate("group_norm", card, knobs, dtypes, body, kernels, ws)


TEMPLATE = Template("group_norm", OPS, check, spaces, default, build)
