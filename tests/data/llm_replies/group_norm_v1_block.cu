// native_group_norm for x [1, 128, 64, 64] bf16, 32 groups (4 channels x 4096 = 16384
// contiguous elements per group): one block per group, three passes (mean, variance,
// normalize), statistics in float like PyTorch.
#include <cuda_bf16.h>

__device__ float block_sum(float v, float* red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // red may still be read by the previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nwarps ? red[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(512)
group_norm_block(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                 const __nv_bfloat16* __restrict__ b, __nv_bfloat16* __restrict__ y,
                 __nv_bfloat16* __restrict__ mean_out, __nv_bfloat16* __restrict__ rstd_out,
                 int channels_per_group, int hw, float eps)
{
    __shared__ float red[32];
    const int g = blockIdx.x;
    const int n = channels_per_group * hw;
    const long long base = (long long)g * n;

    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __bfloat162float(x[base + i]);
    const float mean = block_sum(s, red) / n;

    float q = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = __bfloat162float(x[base + i]) - mean;
        q += d * d;
    }
    const float rstd = rsqrtf(block_sum(q, red) / n + eps);

    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int c = g * channels_per_group + i / hw;
        const float a = rstd * __bfloat162float(w[c]);
        const float v = (__bfloat162float(x[base + i]) - mean) * a + __bfloat162float(b[c]);
        y[base + i] = __float2bfloat16(v);
    }
    if (threadIdx.x == 0) {
        mean_out[g] = __float2bfloat16(mean);
        rstd_out[g] = __float2bfloat16(rstd);
    }
}
