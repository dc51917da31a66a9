// Softmax with one thread per row: simple, but neighbouring threads read addresses 4 KB
// apart, so no load is coalesced. Correct and much slower than eager (the scripted
// "slower" revision).
extern "C" __global__ void __launch_bounds__(128)
softmax_thread_per_row(const float* __restrict__ x, float* __restrict__ y, int rows, int cols)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = x + (long long)r * cols;
    float* out = y + (long long)r * cols;
    float m = __int_as_float(0xff800000);
    for (int i = 0; i < cols; ++i) m = fmaxf(m, row[i]);
    float s = 0.f;
    for (int i = 0; i < cols; ++i) s += expf(row[i] - m);
    const float inv = 1.f / s;
    for (int i = 0; i < cols; ++i) out[i] = expf(row[i] - m) * inv;
}
