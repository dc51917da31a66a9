"""softmax / log_softmax over the last dim of a contiguous tensor.

The algorithms, chosen by row length and row count:
  warp        a warp per row, the row in registers (short rows, many of them);
  block_regs  a block per row, the row in registers;
  block_smem  a block per row, the row cached in shared memory (three passes, one read);
  block_online  a block per row, online max/sum in one read, a second read to write;
  split       very long rows over many blocks: kernel 1 writes each chunk's (max, sum of
              exp) to a workspace, kernel 2 combines a row's chunks and writes its chunk;
  split_coop  split_regs in one cooperative launch: each block waits for its row's other
              chunks on a counter, so x is read once and there is one launch;
  split_cluster  split_regs' chunks of a row as one thread block cluster (sm_90+, at most
              16 blocks): each block leaves its chunk's (max, sum of exp) in shared memory,
              the cluster barriers in hardware and every block reads the row's partials
              over distributed shared memory; one plain launch, no workspace, x read once;
  split_regs  split with each chunk in registers: every thread issues all its loads back to
              back before any arithmetic (many bytes in flight), kernel 1 takes the chunk's
              exact max then its sum of exp, kernel 2 loads its chunk (an L2 hit) before it
              reads the row's partials, which each warp combines without a barrier.
Every algorithm computes in fp32 and, like torch, divides exp(x - max) by the sum.

softmax.int / log_softmax.int are the composite ops with dtype= (kforge.composite): eager
casts x, then runs the softmax; with a float32 dtype (the usual `dtype=torch.float32` on
half or bf16 scores) the cast is exact, so the same kernel reading x as it is computes the
same thing in one pass.
"""

from __future__ import annotations

from ...cards import Card, decode_value
from ...hardware import Hardware
from .common import GROUP_WAIT, ceil_div, constants, ctype, group_wait_workspace, legal_vecs, render, unsupported_dtype
from .template import Knobs, KnobSpace, Template, candidate, launch, pick

OPS = frozenset({"aten::_softmax.default", "aten::_log_softmax.default", "aten::softmax.int", "aten::log_softmax.int"})
LOG_OPS = frozenset({"aten::_log_softmax.default", "aten::log_softmax.int"})
MAX_REGS = 64  # fp32 values a thread may hold for its rows
SPLIT_REGS = 32  # fp32 values a split_regs thread holds for its chunk (with 128 threads, the fewest)
SPLIT_THREADS = (128, 256, 512)
SPLITS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
COOP_THREADS = (512, 1024)
CLUSTERS = (8, 16)  # 8 is the portable cluster size; 16 needs Hopper's non-portable opt-in
CLUSTER_THREADS = (256, 512, 1024)
COOP_BLOCKS_PER_SM = 2
SMEM_LIMIT = 48 * 1024  # dynamic shared memory without the opt-in attribute


def _shape(card: Card) -> tuple[int, int] | str:
    if card.op not in OPS:
        return f"{card.op} is not softmax/log_softmax"
    x, out = card.args[0].tensor, card.outputs[0]
    why = unsupported_dtype([x, out])
    if why:
        return why
    ndim = max(len(x.shape), 1)
    dim = decode_value(card.args[1].value)
    if dim % ndim != ndim - 1:
        return "softmax over a dim other than the last is not templated"
    if not (x.is_contiguous() and out.is_contiguous()) or x.shape != out.shape:
        return "input and output must be contiguous with the same shape"
    if x.numel == 0:
        return "empty input"
    if card.op.endswith(".int") and out.dtype != "float32":
        # A cast to anything but fp32 rounds x before eager's softmax: not what this kernel reads.
        return f"softmax with dtype={out.dtype} is not templated (only dtype=torch.float32)"
    cols = x.shape[-1] if x.shape else 1
    return x.numel // cols, cols


def check(card: Card) -> str | None:
    r = _shape(card)
    return r if isinstance(r, str) else None


def _vecs(card: Card, cols: int) -> tuple:
    return tuple(sorted(legal_vecs(cols, [card.args[0].tensor, card.outputs[0]])))


def _regs(cols: int, lanes: int, v: int) -> int:
    return ceil_div(cols, lanes * v) * v


def spaces(card: Card, hw: Hardware) -> list[KnobSpace]:
    rows, cols = _shape(card)
    vecs = _vecs(card, cols)
    out: list[KnobSpace] = []
    worst = max(_regs(cols, 32, v) for v in vecs)
    if worst <= MAX_REGS:
        out.append({"algo": ("warp",), "warps": (1, 2, 4, 8), "rows": tuple(r for r in (1, 2, 4) if r * worst <= MAX_REGS),
                    "vec": vecs})
    useful = tuple(t for t in (64, 128, 256, 512, 1024) if t <= max(64, cols))
    regs_threads = tuple(t for t in useful if all(_regs(cols, t, v) <= MAX_REGS for v in vecs))
    if regs_threads:
        out.append({"algo": ("block_regs",), "threads": regs_threads, "vec": vecs})
    if cols * card.args[0].tensor.itemsize <= SMEM_LIMIT:
        out.append({"algo": ("block_smem",), "threads": useful, "vec": vecs})
    out.append({"algo": ("block_online",), "threads": useful, "vec": vecs})
    splits = tuple(s for s in (4, 8, 16, 32, 64, 128, 256, 512) if cols // s >= 512)
    if cols >= 8192 and rows <= 65535 and splits:
        out.append({"algo": ("split",), "split": splits, "threads": (128, 256, 512), "vec": vecs})
    # Every split whose chunk fits SPLIT_REGS values per thread at the fewest threads (more
    # threads only hold fewer) and keeps >= 512 elements per chunk.
    reg_splits = tuple(s for s in SPLITS if cols // s >= 512 and ceil_div(cols, s * SPLIT_THREADS[0]) <= SPLIT_REGS)
    if cols >= 8192 and rows <= 65535 and reg_splits:
        # pdl: kernel 2 launched while kernel 1 finishes (programmatic dependent launch, sm_90+).
        pdl = {"pdl": (False, True)} if hw.cc >= 90 else {}
        out.append({"algo": ("split_regs",), "split": reg_splits, "threads": SPLIT_THREADS, "vec": vecs, **pdl})
    # split_coop: every block of the grid resident at once, at most COOP_BLOCKS_PER_SM per SM
    # (a launch that cannot be resident is refused, never run), the chunk in registers at
    # the fewest threads.
    coop_splits = tuple(s for s in SPLITS if rows * s <= COOP_BLOCKS_PER_SM * hw.sm_count and cols // s >= 512
                        and ceil_div(cols, s * COOP_THREADS[0]) <= SPLIT_REGS)
    if cols >= 8192 and coop_splits:
        out.append({"algo": ("split_coop",), "split": coop_splits, "threads": COOP_THREADS, "vec": vecs})
    # split_cluster: a row's chunks are one cluster, each chunk in registers (one space per
    # cluster size: the legal thread counts differ).
    if hw.cc >= 90 and cols >= 8192 and rows <= 65535:
        for s in CLUSTERS:
            threads = tuple(t for t in CLUSTER_THREADS if ceil_div(cols, s * t) <= SPLIT_REGS)
            if cols // s >= 512 and threads:
                out.append({"algo": ("split_cluster",), "split": (s,), "threads": threads, "vec": vecs})
    return out


# split_cluster: blockIdx.x is the block's rank in its row's cluster (cluster dims (S, 1, 1)).
# A block's shared memory must outlive the other blocks' reads of it: each block arrives at
# the second cluster barrier once it has read, and waits on it only after its stores.
_SPLIT_CLUSTER = r"""
__device__ __forceinline__ float2 kf_cluster_read(const float2* local, unsigned rank) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(remote) : "memory");
  return v;
}

extern "C" __global__ void __launch_bounds__(NT) kf_softmax_cluster(const Tin* __restrict__ x, Tout* __restrict__ y) {
  __shared__ float2 part;
  const int lo = blockIdx.x * CH;
  const kf_i64 base = (kf_i64)blockIdx.y * C;
  float v[IT][V];
  kf_load_chunk(x + base, lo, v);
  float m, s;
  kf_chunk_stats(v, m, s);
  if (threadIdx.x == 0) part = make_float2(m, s);
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  // Lane k of every warp reads chunk k's partial (S <= 32); the warp merges them.
  const int lane = threadIdx.x & 31;
  const float2 p = lane < S ? kf_cluster_read(&part, lane) : make_float2(-kf_inf(), 0.f);
  const float rm = kf_warp_max(p.x);
  const float rs = kf_warp_sum(p.x == -kf_inf() ? 0.f : p.y * expf(p.x - rm));
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  kf_store_chunk(y + base, lo, v, rm, rs);
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
"""


def _split_geometry(cols: int, split: int, nt: int, v: int) -> tuple[int, int, int]:
    """(CH, IT, S): chunks of CH elements (whole vectors, about cols/split), IT vector loads
    per thread to cover one, and S = the number of chunks a row really has (<= split)."""
    ch = ceil_div(ceil_div(cols, split), v) * v
    return ch, ceil_div(ch, nt * v), ceil_div(cols, ch)


def default(card: Card, hw: Hardware) -> Knobs:
    rows, cols = _shape(card)
    by_algo = {s["algo"][0]: s for s in spaces(card, hw)}
    vec = _vecs(card, cols)[-1]
    if "split_regs" in by_algo and rows < 2 * hw.sm_count:
        # >= 4 blocks per SM in each kernel, then ~16 values (IT = 4 fp32 16-byte loads) per
        # thread: the whole tensor is in flight at once, loads issued before any arithmetic.
        s = by_algo["split_regs"]
        split = next((v for v in s["split"] if rows * v >= 4 * hw.sm_count), s["split"][-1])
        return {"algo": "split_regs", "split": split, "threads": pick(s["threads"], ceil_div(cols, split) / 16),
                "vec": vec, **({"pdl": False} if "pdl" in s else {})}
    if "split" in by_algo and rows < 2 * hw.sm_count:
        s = by_algo["split"]
        return {"algo": "split", "split": pick(s["split"], 4 * hw.sm_count / rows), "threads": 256, "vec": vec}
    if "warp" in by_algo and cols <= 1024:
        return {"algo": "warp", "warps": 4, "rows": 1, "vec": vec}
    if "block_regs" in by_algo:
        return {"algo": "block_regs", "threads": pick(by_algo["block_regs"]["threads"], cols // 16), "vec": vec}
    algo = "block_smem" if "block_smem" in by_algo else "block_online"
    return {"algo": algo, "threads": pick(by_algo[algo]["threads"], 512), "vec": vec}


# Rows held in registers: a warp (LANES=32) or a block (LANES=NT) per row.
_REGS = r"""
constexpr int IT = (C + LANES * V - 1) / (LANES * V);

extern "C" __global__ void __launch_bounds__(NT) kf_softmax(const Tin* __restrict__ x, Tout* __restrict__ y) {
  const int lane = threadIdx.x % LANES;
  const kf_i64 row0 = ((kf_i64)blockIdx.x * (NT / LANES) + threadIdx.x / LANES) * ROWS;
  float v[ROWS][IT][V];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int c = (it * LANES + lane) * V;
      if (row0 + r < R && c < C) {
        kf_load<Tin, V>(x + (row0 + r) * C + c, v[r][it]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) v[r][it][j] = -kf_inf();
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float m = -kf_inf();
#pragma unroll
    for (int it = 0; it < IT; ++it)
#pragma unroll
      for (int j = 0; j < V; ++j) m = fmaxf(m, v[r][it][j]);
    m = @MAX@(m);
    float s = 0.f;
#pragma unroll
    for (int it = 0; it < IT; ++it)
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float e = expf(v[r][it][j] - m);  // padding holds -inf: contributes 0
        s += e;
        if (!LOG) v[r][it][j] = e;
      }
    s = @SUM@(s);
    const float ls = logf(s);
    if (row0 + r >= R) continue;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int c = (it * LANES + lane) * V;
      if (c < C) {
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = LOG ? v[r][it][j] - m - ls : v[r][it][j] / s;
        kf_store<Tout, V>(y + (row0 + r) * C + c, o);
      }
    }
  }
}
"""

# Online (max, sum) of a thread's strided part of [lo, hi), merged over the block.
_ONLINE = r"""
__device__ __forceinline__ void kf_online(const Tin* __restrict__ p, int lo, int hi, float& m, float& s) {
  m = -kf_inf();
  s = 0.f;
#pragma unroll 4
  for (int c = lo + threadIdx.x * V; c < hi; c += NT * V) {
    float v[V];
    kf_load<Tin, V>(p + c, v);
    float vm = v[0];
#pragma unroll
    for (int j = 1; j < V; ++j) vm = fmaxf(vm, v[j]);
    if (vm == -kf_inf()) continue;  // all -inf: adds nothing
    if (vm > m) { s *= expf(m - vm); m = vm; }
#pragma unroll
    for (int j = 0; j < V; ++j) s += expf(v[j] - m);
  }
}

__device__ __forceinline__ void kf_block_merge(float& m, float& s) {
  const float bm = kf_block_max<NT>(m);
  s = kf_block_sum<NT>(m == -kf_inf() ? 0.f : s * expf(m - bm));
  m = bm;
}

__device__ __forceinline__ void kf_write(const Tin* __restrict__ p, Tout* __restrict__ q, int lo, int hi, float m, float s) {
  const float ls = logf(s);
#pragma unroll 4
  for (int c = lo + threadIdx.x * V; c < hi; c += NT * V) {
    float v[V];
    kf_load<Tin, V>(p + c, v);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = LOG ? v[j] - m - ls : expf(v[j] - m) / s;
    kf_store<Tout, V>(q + c, v);
  }
}
"""

_BLOCK_ONLINE = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_softmax(const Tin* __restrict__ x, Tout* __restrict__ y) {
  const kf_i64 base = (kf_i64)blockIdx.x * C;
  float m, s;
  kf_online(x + base, 0, C, m, s);
  kf_block_merge(m, s);
  kf_write(x + base, y + base, 0, C, m, s);
}
"""

_BLOCK_SMEM = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_softmax(const Tin* __restrict__ x, Tout* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char kf_smem[];
  Tin* row = reinterpret_cast<Tin*>(kf_smem);
  const kf_i64 base = (kf_i64)blockIdx.x * C;
  float m = -kf_inf();
  for (int c = threadIdx.x * V; c < C; c += NT * V) {
    const kf_vec<Tin, V> raw = *reinterpret_cast<const kf_vec<Tin, V>*>(x + base + c);
    *reinterpret_cast<kf_vec<Tin, V>*>(row + c) = raw;
#pragma unroll
    for (int j = 0; j < V; ++j) m = fmaxf(m, kf_f32(raw.v[j]));
  }
  m = kf_block_max<NT>(m);  // its barrier also publishes the cached row
  float s = 0.f;
  for (int c = threadIdx.x * V; c < C; c += NT * V) {
    float v[V];
    kf_load<Tin, V>(row + c, v);
#pragma unroll
    for (int j = 0; j < V; ++j) s += expf(v[j] - m);
  }
  s = kf_block_sum<NT>(s);
  const float ls = logf(s);
  for (int c = threadIdx.x * V; c < C; c += NT * V) {
    float v[V];
    kf_load<Tin, V>(row + c, v);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = LOG ? v[j] - m - ls : expf(v[j] - m) / s;
    kf_store<Tout, V>(y + base + c, v);
  }
}
"""

_SPLIT = r"""
constexpr int CH = (C / S + V - 1) / V * V;  // elements per chunk, whole vectors

extern "C" __global__ void __launch_bounds__(NT) kf_softmax_partial(const Tin* __restrict__ x, float* __restrict__ ws) {
  const int lo = blockIdx.x * CH, hi = min(C, lo + CH);
  float m, s;
  kf_online(x + (kf_i64)blockIdx.y * C, lo, hi, m, s);
  kf_block_merge(m, s);
  if (threadIdx.x == 0) {
    ws[(blockIdx.y * S + blockIdx.x) * 2] = m;
    ws[(blockIdx.y * S + blockIdx.x) * 2 + 1] = s;
  }
}

extern "C" __global__ void __launch_bounds__(NT) kf_softmax_finish(const Tin* __restrict__ x, const float* __restrict__ ws,
                                                                 Tout* __restrict__ y) {
  float m = -kf_inf(), s = 0.f;
  for (int j = threadIdx.x; j < S; j += NT) {
    const float pm = ws[(blockIdx.y * S + j) * 2], ps = ws[(blockIdx.y * S + j) * 2 + 1];
    if (pm == -kf_inf()) continue;
    const float nm = fmaxf(m, pm);
    s = (m == -kf_inf() ? 0.f : s * expf(m - nm)) + ps * expf(pm - nm);
    m = nm;
  }
  kf_block_merge(m, s);
  const int lo = blockIdx.x * CH, hi = min(C, lo + CH);
  const kf_i64 base = (kf_i64)blockIdx.y * C;
  kf_write(x + base, y + base, lo, hi, m, s);
}
"""


# Each chunk of CH elements lives in registers: IT vector loads per thread, all issued
# before any arithmetic. IN_CHUNK / IN_ROW are false when the loads cover the chunk / the
# chunks cover the row exactly, which removes the predicate.
_CHUNKS = r"""
constexpr bool IN_CHUNK = CH % (NT * V) != 0, IN_ROW = C % CH != 0;

__device__ __forceinline__ bool kf_live(int lo, int it) {
  const int k = (it * NT + (int)threadIdx.x) * V;
  return (!IN_CHUNK || k < CH) && (!IN_ROW || lo + k < C);
}

__device__ __forceinline__ void kf_load_chunk(const Tin* __restrict__ p, int lo, float (&v)[IT][V]) {
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    if (kf_live(lo, it)) {
      kf_load<Tin, V>(p + lo + (it * NT + threadIdx.x) * V, v[it]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) v[it][j] = -kf_inf();
    }
  }
}

// The chunk's exact max over the block, then its sum of exp(x - max).
__device__ __forceinline__ void kf_chunk_stats(const float (&v)[IT][V], float& m, float& s) {
  m = -kf_inf();
#pragma unroll
  for (int it = 0; it < IT; ++it)
#pragma unroll
    for (int j = 0; j < V; ++j) m = fmaxf(m, v[it][j]);
  m = kf_block_max<NT>(m);
  const float ref = m == -kf_inf() ? 0.f : m;  // an all -inf chunk sums exp(-inf) = 0
  s = 0.f;
#pragma unroll
  for (int it = 0; it < IT; ++it)
#pragma unroll
    for (int j = 0; j < V; ++j) s += expf(v[it][j] - ref);
  s = kf_block_sum<NT>(s);
}

// The chunk held in registers, normalized by its row's (max, sum of exp), into the row at q.
__device__ __forceinline__ void kf_store_chunk(Tout* __restrict__ q, int lo, const float (&v)[IT][V], float m, float s) {
  const float ls = logf(s);
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    if (kf_live(lo, it)) {
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = LOG ? v[it][j] - m - ls : expf(v[it][j] - m) / s;
      kf_store<Tout, V>(q + lo + (it * NT + threadIdx.x) * V, o);
    }
  }
}

"""

# A row's (max, sum of exp) from its S chunk partials, on every lane of a warp. Each lane
# loads up to 8 partials per round, all in flight at once (a loop of dependent L2 reads
# costs a round trip per partial), merges them online, then the warp merges its lanes.
# CG: read with __ldcg (the partials were written by another SM during this grid, or by a
# grid that may still be running). A NaN partial stays NaN; a row of -inf sums to 0.
_COMBINE = r"""
template <bool CG>
__device__ __forceinline__ float2 kf_combine(const float2* __restrict__ part) {
  constexpr int KP = (S + 31) / 32, K = KP < 8 ? KP : 8;
  const int lane = threadIdx.x & 31;
  float m = -kf_inf(), s = 0.f;
#pragma unroll 1
  for (int k0 = 0; k0 < KP; k0 += K) {
    float2 p[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = (k0 + k) * 32 + lane;
      p[k] = (S % (32 * K) == 0 || j < S) ? (CG ? __ldcg(part + j) : part[j]) : make_float2(-kf_inf(), 0.f);
    }
    float mk = m;
#pragma unroll
    for (int k = 0; k < K; ++k) mk = fmaxf(mk, p[k].x);
    s *= m == -kf_inf() ? 0.f : expf(m - mk);
#pragma unroll
    for (int k = 0; k < K; ++k) s += p[k].y * (p[k].x == -kf_inf() ? 0.f : expf(p[k].x - mk));
    m = mk;
  }
  const float rm = kf_warp_max(m);
  return make_float2(rm, kf_warp_sum(s * (m == -kf_inf() ? 0.f : expf(m - rm))));
}
"""


_SPLIT_REGS = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_softmax_partial(const Tin* __restrict__ x, float2* __restrict__ ws) {
  const int lo = blockIdx.x * CH;
  float v[IT][V];
  kf_load_chunk(x + (kf_i64)blockIdx.y * C, lo, v);
  if constexpr (PDL) asm volatile("griddepcontrol.launch_dependents;");  // kernel 2 may start loading
  float m, s;
  kf_chunk_stats(v, m, s);
  if (threadIdx.x == 0) ws[blockIdx.y * S + blockIdx.x] = make_float2(m, s);
}

extern "C" __global__ void __launch_bounds__(NT) kf_softmax_finish(const Tin* __restrict__ x, const float2* __restrict__ ws,
                                                                 Tout* __restrict__ y) {
  const int lo = blockIdx.x * CH;
  const kf_i64 base = (kf_i64)blockIdx.y * C;
  float v[IT][V];
  kf_load_chunk(x + base, lo, v);  // in flight while the partials are combined
  // With programmatic dependent launch this kernel may start before kernel 1 ends: x is
  // loaded first, then it waits for kernel 1's partials (read from L2 after the wait).
  if constexpr (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  // Every warp combines the row's S partials itself (no barrier; after the first warp of
  // the SM the reads hit L1).
  const float2 ms = kf_combine<PDL>(ws + blockIdx.y * S);
  kf_store_chunk(y + base, lo, v, ms.x, ms.y);
}
"""


# split_coop: one cooperative launch (every block resident). A block publishes its chunk's
# (max, sum of exp), counts itself in on its row's counter (zeroed before the launch) and
# waits for the row's other chunks, then combines the row's partials (read from L2: L1 is
# not coherent across SMs) and writes its chunk from registers: x is read once.
_SPLIT_COOP = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_softmax_coop(const Tin* __restrict__ x, unsigned* __restrict__ ws,
                                                               Tout* __restrict__ y) {
  const int lo = blockIdx.x * CH;
  const kf_i64 base = (kf_i64)blockIdx.y * C;
  float v[IT][V];
  kf_load_chunk(x + base, lo, v);
  float m, s;
  kf_chunk_stats(v, m, s);
  kf_publish_and_wait(ws, blockIdx.y, make_float2(m, s));
  const float2 ms = kf_combine<true>(kf_partials(ws) + blockIdx.y * S);
  kf_store_chunk(y + base, lo, v, ms.x, ms.y);
}
"""


def build(card: Card, knobs: Knobs, hw: Hardware):
    rows, cols = _shape(card)
    x, out = card.args[0].tensor, card.outputs[0]
    algo, v = knobs["algo"], knobs["vec"]
    log = card.op in LOG_OPS
    types = constants(Tin=ctype(x.dtype), Tout=ctype(out.dtype))
    io = [{"in": 0}, {"out": 0}]
    if algo in ("warp", "block_regs"):
        warp = algo == "warp"
        nt = 32 * knobs["warps"] if warp else knobs["threads"]
        per_block = knobs["warps"] * knobs["rows"] if warp else 1
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, LANES=32 if warp else nt,
                           ROWS=knobs["rows"] if warp else 1)
        red = ("kf_warp_max", "kf_warp_sum") if warp else (f"kf_block_max<{nt}>", f"kf_block_sum<{nt}>")
        body = "\n".join([types, consts, render(_REGS, MAX=red[0], SUM=red[1])])
        kernels = [launch("kf_softmax", [ceil_div(rows, per_block)], [nt], io)]
        ws = []
    elif algo in ("block_online", "block_smem"):
        nt = knobs["threads"]
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log)
        smem = algo == "block_smem"
        body = "\n".join([types, consts, _ONLINE, _BLOCK_SMEM if smem else _BLOCK_ONLINE])
        kernels = [launch("kf_softmax", [rows], [nt], io, smem=cols * x.itemsize if smem else 0)]
        ws = []
    elif algo == "split_regs":
        nt = knobs["threads"]
        ch, it, s = _split_geometry(cols, knobs["split"], nt, v)
        pdl = knobs.get("pdl", False)
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s, CH=ch, IT=it, PDL=pdl)
        body = "\n".join([types, consts, _CHUNKS, _COMBINE, _SPLIT_REGS])
        kernels = [launch("kf_softmax_partial", [s, rows], [nt], [{"in": 0}, {"ws": 0}]),
                   launch("kf_softmax_finish", [s, rows], [nt], [{"in": 0}, {"ws": 0}, {"out": 0}], pdl=pdl)]
        ws = [rows * s * 2 * 4]
    elif algo == "split_cluster":
        nt = knobs["threads"]
        ch, it, s = _split_geometry(cols, knobs["split"], nt, v)
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s, CH=ch, IT=it)
        body = "\n".join([types, consts, _CHUNKS, _SPLIT_CLUSTER])
        kernels = [launch("kf_softmax_cluster", [s, rows], [nt], io, cluster=s)]
        ws = []
    elif algo == "split_coop":
        nt = knobs["threads"]
        ch, it, s = _split_geometry(cols, knobs["split"], nt, v)
        wait, wait_ws = group_wait_workspace(rows, s)
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s, CH=ch, IT=it, **wait)
        body = "\n".join([types, consts, _CHUNKS, GROUP_WAIT, _COMBINE, _SPLIT_COOP])
        kernels = [launch("kf_softmax_coop", [s, rows], [nt], [{"in": 0}, {"ws": 0}, {"out": 0}], cooperative=True)]
        ws = [wait_ws]
    else:
        nt, s = knobs["threads"], knobs["split"]
        consts = constants(R=rows, C=cols, NT=nt, V=v, LOG=log, S=s)
        body = "\n".join([types, consts, _ONLINE, _SPLIT])
        kernels = [launch("kf_softmax_partial", [s, rows], [nt], [{"in": 0}, {"ws": 0}]),
                   launch("kf_softmax_finish", [s, rows], [nt], [{"in": 0}, {"ws": 0}, {"out": 0}])]
        ws = [rows * s * 2 * 4]
    return candidate("softmax", card, knobs, {x.dtype, out.dtype}, body, kernels, ws)


TEMPLATE = Template("softmax", OPS, check, spaces, default, build)
