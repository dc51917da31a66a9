// Softmax over rows of exactly 1024 floats: one warp per row, the row held in registers
// (8 float4 per lane, coalesced 16-byte loads), so HBM is read once and written once.
#define VEC_PER_LANE 8  // 1024 floats / 32 lanes / 4 floats per float4

extern "C" __global__ void __launch_bounds__(256)
softmax_warp_row(const float4* __restrict__ x, float4* __restrict__ y, int rows)
{
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float4* in = x + (long long)row * (32 * VEC_PER_LANE);
    float4* out = y + (long long)row * (32 * VEC_PER_LANE);

    float4 v[VEC_PER_LANE];
    float m = __int_as_float(0xff800000);
#pragma unroll
    for (int k = 0; k < VEC_PER_LANE; ++k) {
        v[k] = in[lane + 32 * k];
        m = fmaxf(m, fmaxf(fmaxf(v[k].x, v[k].y), fmaxf(v[k].z, v[k].w)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));

    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VEC_PER_LANE; ++k) {
        v[k].x = expf(v[k].x - m); v[k].y = expf(v[k].y - m);
        v[k].z = expf(v[k].z - m); v[k].w = expf(v[k].w - m);
        s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);

    const float inv = 1.f / s;
#pragma unroll
    for (int k = 0; k < VEC_PER_LANE; ++k)
        out[lane + 32 * k] = make_float4(v[k].x * inv, v[k].y * inv, v[k].z * inv, v[k].w * inv);
}
