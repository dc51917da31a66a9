// Softmax over rows of 1024 floats, one block per row. Deliberately broken: `lane` and
// `warp` are used but never declared (the scripted model forgets them; the repair adds them).
extern "C" __global__ void __launch_bounds__(256)
softmax_rows_block(const float* __restrict__ x, float* __restrict__ y, int cols)
{
    __shared__ float red[32];
    const float* row = x + (long long)blockIdx.x * cols;
    float* out = y + (long long)blockIdx.x * cols;
    const int nwarps = blockDim.x >> 5;

    float m = __int_as_float(0xff800000);  // -inf
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, row[i]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = lane < nwarps ? red[lane] : __int_as_float(0xff800000);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();

    float s = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += expf(row[i] - m);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    s = lane < nwarps ? red[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);

    const float inv = 1.f / s;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[i] = expf(row[i] - m) * inv;
}
