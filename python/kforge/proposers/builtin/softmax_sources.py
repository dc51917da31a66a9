"""The CUDA C of the softmax template (kforge.proposers.builtin.softmax), one string per piece
its algorithms put together: rows in registers, the online max/sum, the block and split
kernels, the chunked loads and the partials' combine. softmax.build chooses and renders them."""

# Rows held in registers: a warp (LANES=32) or a block (LANES=NT) per row.
REGS = r"""
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
ONLINE = r"""
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

BLOCK_ONLINE = r"""
extern "C" __global__ void __launch_bounds__(NT) kf_softmax(const Tin* __restrict__ x, Tout* __restrict__ y) {
  const kf_i64 base = (kf_i64)blockIdx.x * C;
  float m, s;
  kf_online(x + base, 0, C, m, s);
  kf_block_merge(m, s);
  kf_write(x + base, y + base, 0, C, m, s);
}
"""

BLOCK_SMEM = r"""
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

SPLIT = r"""
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
CHUNKS = r"""
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
COMBINE = r"""
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


SPLIT_REGS = r"""
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
SPLIT_COOP = r"""
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


# split_cluster: blockIdx.x is the block's rank in its row's cluster (cluster dims (S, 1, 1)).
# A block's shared memory must outlive the other blocks' reads of it: each block arrives at
# the second cluster barrier once it has read, and waits on it only after its stores.
SPLIT_CLUSTER = r"""
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
