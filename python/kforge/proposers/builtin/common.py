"""Shared pieces of the built-in templates: dtype names, CUDA helpers, source rendering.

Every template emits one self-contained translation unit: `cuda_source(...)` gives the
header (fp16/bf16 includes only when used, conversions, 16-byte vector load/store with
fp32 values, warp and block reductions, Welford merges) and the template appends its
kernels, whose shapes and strides are compile-time constants.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ...cards import TensorMeta

CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
VEC_BYTES = 16  # widest global load/store a thread issues (LDG.128)


def ctype(dtype: str) -> str:
    return CTYPES[dtype]


def unsupported_dtype(metas: list[TensorMeta]) -> str | None:
    """Why these tensors cannot go through a template (dtype or device), or None."""
    for m in metas:
        if m.dtype not in CTYPES:
            return f"dtype {m.dtype} is not templated (float32, float16 and bfloat16 are)"
        if m.device != "cuda":
            return f"a tensor lives on {m.device}; the templates read CUDA memory only"
    return None


def f32(x: float) -> str:
    """A CUDA float literal holding x rounded to fp32, exactly as torch's opmath would."""
    v = float(np.float32(x))
    if math.isnan(v):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(v):
        return "__int_as_float(0x7f800000)" if v > 0 else "__int_as_float(0xff800000)"
    return f"{v!r}f"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def vec_widths(itemsize: int) -> list[int]:
    """Vector widths in elements, widest first, up to 16 bytes per access."""
    return [v for v in (16, 8, 4, 2, 1) if v * itemsize <= VEC_BYTES]


def fits_vec(v: int, extent: int, metas: list[TensorMeta]) -> bool:
    """A vector of v elements along a contiguous extent stays aligned for every tensor."""
    return extent % v == 0 and all(v * m.itemsize <= VEC_BYTES and m.align % (v * m.itemsize) == 0 for m in metas)


def legal_vecs(extent: int, metas: list[TensorMeta]) -> list[int]:
    """Every vector width that is legal for rows of `extent` elements, widest first."""
    widest = min(VEC_BYTES // m.itemsize for m in metas)
    return [v for v in vec_widths(1) if v <= widest and fits_vec(v, extent, metas)]


def constants(**values: int | float | bool | str) -> str:
    """`constexpr` lines: the kernel body refers to these names instead of literals."""
    lines = []
    for name, v in values.items():
        if isinstance(v, bool):
            lines.append(f"constexpr bool {name} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            lines.append(f"constexpr kf_i64 {name} = {v}LL;" if abs(v) >= 2**31 else f"constexpr int {name} = {v};")
        elif isinstance(v, float):
            lines.append(f"constexpr float {name} = {f32(v)};")
        else:
            lines.append(f"typedef {v} {name};")
    return "\n".join(lines)


_PLACEHOLDER = re.compile(r"@([A-Z_][A-Z0-9_]*)@")


def render(template: str, **subs: str | int) -> str:
    """Replace @NAME@ placeholders; a placeholder left without a value is a template bug."""
    out = _PLACEHOLDER.sub(lambda m: str(subs[m.group(1)]) if m.group(1) in subs else m.group(0), template)
    left = _PLACEHOLDER.findall(out)
    if left:
        raise KeyError(f"template placeholders without a value: {sorted(set(left))}")
    return out


_BASE = r"""
typedef long long kf_i64;

__device__ __forceinline__ float kf_f32(float x) { return x; }
template <typename T> __device__ __forceinline__ T kf_cast(float x);
template <> __device__ __forceinline__ float kf_cast<float>(float x) { return x; }
__device__ __forceinline__ float kf_inf() { return __int_as_float(0x7f800000); }

// An aligned vector of V elements: one 16-byte (or narrower) global access.
template <typename T, int V> struct alignas(sizeof(T) * V) kf_vec { T v[V]; };

template <typename T, int V>
__device__ __forceinline__ void kf_load(const T* p, float (&o)[V]) {
  const kf_vec<T, V> r = *reinterpret_cast<const kf_vec<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) o[i] = kf_f32(r.v[i]);
}

template <typename T, int V>
__device__ __forceinline__ void kf_store(T* p, const float (&o)[V]) {
  kf_vec<T, V> r;
#pragma unroll
  for (int i = 0; i < V; ++i) r.v[i] = kf_cast<T>(o[i]);
  *reinterpret_cast<kf_vec<T, V>*>(p) = r;
}

__device__ __forceinline__ float kf_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float kf_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions over a 1-D block of NT threads; every thread gets the result.
// The leading barrier lets a kernel call them back to back on the same scratch.
template <int NT>
__device__ __forceinline__ float kf_block_sum(float v) {
  __shared__ float scratch[32];
  v = kf_warp_sum(v);
  if (NT <= 32) return v;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < NT / 32 ? scratch[threadIdx.x & 31] : 0.f;
  return kf_warp_sum(v);
}

template <int NT>
__device__ __forceinline__ float kf_block_max(float v) {
  __shared__ float scratch[32];
  v = kf_warp_max(v);
  if (NT <= 32) return v;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < NT / 32 ? scratch[threadIdx.x & 31] : -kf_inf();
  return kf_warp_max(v);
}

// Welford statistics (count, mean, sum of squared deviations), merged with Chan's formula
// so partial results of any size combine without the cancellation of sum/sum-of-squares.
struct kf_welford { float n, mean, m2; };

__device__ __forceinline__ kf_welford kf_welford_merge(kf_welford a, kf_welford b) {
  const float n = a.n + b.n;
  if (n == 0.f) return a;
  const float d = b.mean - a.mean, wb = b.n / n;
  return {n, a.mean + d * wb, a.m2 + b.m2 + d * d * a.n * wb};
}

// Statistics of V values held in registers (two-pass: exact for the chunk).
template <int V>
__device__ __forceinline__ kf_welford kf_welford_of(const float (&x)[V]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) s += x[i];
  const float mean = s * (1.f / V);
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) m2 += (x[i] - mean) * (x[i] - mean);
  return {float(V), mean, m2};
}

// Every lane gets lane 0's result: Chan's merge is not commutative in rounding, so the
// butterfly can leave lanes an ulp apart, and one row must use one mean and rstd.
__device__ __forceinline__ kf_welford kf_warp_welford(kf_welford w) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const kf_welford b = {__shfl_xor_sync(0xffffffffu, w.n, o), __shfl_xor_sync(0xffffffffu, w.mean, o),
                          __shfl_xor_sync(0xffffffffu, w.m2, o)};
    w = kf_welford_merge(w, b);
  }
  return {__shfl_sync(0xffffffffu, w.n, 0), __shfl_sync(0xffffffffu, w.mean, 0), __shfl_sync(0xffffffffu, w.m2, 0)};
}

template <int NT>
__device__ __forceinline__ kf_welford kf_block_welford(kf_welford w) {
  __shared__ float sn[32], smean[32], sm2[32];
  w = kf_warp_welford(w);
  if (NT <= 32) return w;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  if (lane == 0) { sn[threadIdx.x >> 5] = w.n; smean[threadIdx.x >> 5] = w.mean; sm2[threadIdx.x >> 5] = w.m2; }
  __syncthreads();
  w = lane < NT / 32 ? kf_welford{sn[lane], smean[lane], sm2[lane]} : kf_welford{0.f, 0.f, 0.f};
  return kf_warp_welford(w);
}
"""

_HALF = r"""
__device__ __forceinline__ float kf_f32(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ __half kf_cast<__half>(float x) { return __float2half_rn(x); }
"""

_BF16 = r"""
__device__ __forceinline__ float kf_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ __nv_bfloat16 kf_cast<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
"""


# Blocks of one cooperative launch that share a reduction (group_norm coop, softmax
# split_coop). The workspace is the groups' 32-bit counters, zeroed
# before the launch, CNT_STRIDE words apart (COUNTER_STRIDE: a 128-byte line each, so the
# waiters of one group do not poll the line every other group counts on), then S float2
# partials per group at word CNT_WORDS.
COUNTER_STRIDE = 32
GROUP_WAIT = r"""
__device__ __forceinline__ float2* kf_partials(unsigned* ws) { return reinterpret_cast<float2*>(ws + CNT_WORDS); }

// Thread 0 publishes this block's partial, counts it in on its group's counter and waits
// for the group's other blocks; then the whole block may read the group's S partials
// (with __ldcg: L1 is not coherent across SMs).
__device__ __forceinline__ void kf_publish_and_wait(unsigned* ws, kf_i64 group, float2 mine) {
  if (threadIdx.x == 0) {
    __stcg(&kf_partials(ws)[group * S + blockIdx.x], mine);
    __threadfence();  // the partial is visible before the count says so
    unsigned* count = ws + group * CNT_STRIDE;
    atomicAdd(count, 1u);
    while (*reinterpret_cast<volatile unsigned*>(count) < (unsigned)S) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}
"""


def group_wait_workspace(groups: int, s: int, stride: int | None = None) -> tuple[dict, dict]:
    """(the constants GROUP_WAIT needs, the zeroed workspace entry) for `groups` groups of
    `s` partials, the counters `stride` words apart (COUNTER_STRIDE by default)."""
    stride = COUNTER_STRIDE if stride is None else stride
    # The last counter's line holds no partials either; the partials start 8-byte aligned.
    words = ceil_div(groups * stride, 2) * 2
    return {"CNT_WORDS": words, "CNT_STRIDE": stride}, {"bytes": words * 4 + groups * s * 8, "zero": True}


def cuda_source(title: str, dtypes: set[str] | list[str], body: str) -> str:
    """A full translation unit: a comment naming the template and its knobs (so every knob
    setting has its own source and digest), the includes the dtypes need, helpers, body."""
    dtypes = set(dtypes)
    parts = [f"// kforge builtin: {title}"]
    if "float16" in dtypes:
        parts.append("#include <cuda_fp16.h>")
    if "bfloat16" in dtypes:
        parts.append("#include <cuda_bf16.h>")
    parts.append(_BASE)
    if "float16" in dtypes:
        parts.append(_HALF)
    if "bfloat16" in dtypes:
        parts.append(_BF16)
    parts.append(body)
    return "\n".join(parts) + "\n"
