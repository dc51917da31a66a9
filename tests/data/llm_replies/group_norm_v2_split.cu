// native_group_norm for x [1, 128, 64, 64] bf16, 32 groups, spread over 512 blocks instead
// of 32 (eager's one block per group leaves most SMs idle):
//   group_norm_partial: 16 blocks per group each reduce 1024 elements to (mean, M2);
//   group_norm_apply:   the same 512 blocks merge their group's 16 partials (Chan's formula,
//                       exact for equal counts) and normalize, 8 elements per thread with
//                       16-byte loads and stores.
#include <cuda_bf16.h>

#define CHUNKS 16       // blocks per group
#define THREADS 128
#define PER_THREAD 8    // bf16 per 16-byte access
#define CHUNK (THREADS * PER_THREAD)

__device__ float block_sum(float v, float* red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? red[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ void load8(const __nv_bfloat16* p, float* f)
{
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 t = __bfloat1622float2(h[k]);
        f[2 * k] = t.x;
        f[2 * k + 1] = t.y;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
group_norm_partial(const __nv_bfloat16* __restrict__ x, float* __restrict__ partials, int group_size)
{
    __shared__ float red[32];
    const int g = blockIdx.y, chunk = blockIdx.x;
    float f[PER_THREAD];
    load8(x + (long long)g * group_size + chunk * CHUNK + threadIdx.x * PER_THREAD, f);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) s += f[k];
    const float mean = block_sum(s, red) / CHUNK;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) q += (f[k] - mean) * (f[k] - mean);
    const float m2 = block_sum(q, red);
    if (threadIdx.x == 0) {
        partials[2 * (g * CHUNKS + chunk)] = mean;
        partials[2 * (g * CHUNKS + chunk) + 1] = m2;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
group_norm_apply(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                 const __nv_bfloat16* __restrict__ b, const float* __restrict__ partials,
                 __nv_bfloat16* __restrict__ y, __nv_bfloat16* __restrict__ mean_out,
                 __nv_bfloat16* __restrict__ rstd_out, int channels_per_group, int hw, float eps)
{
    const int g = blockIdx.y, chunk = blockIdx.x;
    const float* p = partials + 2 * g * CHUNKS;
    float mean = 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) mean += p[2 * k];
    mean *= 1.f / CHUNKS;
    float m2 = 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const float d = p[2 * k] - mean;
        m2 += p[2 * k + 1] + CHUNK * d * d;
    }
    const int group_size = channels_per_group * hw;
    const float rstd = rsqrtf(m2 / group_size + eps);

    const int i = chunk * CHUNK + threadIdx.x * PER_THREAD;  // within the group; 8 | hw, so one channel
    const int c = g * channels_per_group + i / hw;
    const float a = rstd * __bfloat162float(w[c]);
    const float shift = __bfloat162float(b[c]) - mean * a;
    const long long off = (long long)g * group_size + i;
    float f[PER_THREAD];
    load8(x + off, f);
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(f[2 * k] * a + shift, f[2 * k + 1] * a + shift);
    *reinterpret_cast<uint4*>(y + off) = raw;
    if (chunk == 0 && threadIdx.x == 0) {
        mean_out[g] = __float2bfloat16(mean);
        rstd_out[g] = __float2bfloat16(rstd);
    }
}
