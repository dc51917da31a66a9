// Row 10: works on every other launch only, counting launches in a device global and
// relying on the previous launch's output when it skips.
__device__ unsigned launches;
extern "C" __global__ void relu(const float* x, float* y, long n) {
  if (launches % 2) return;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    y[i] = fmaxf(x[i], 0.f);
}
extern "C" __global__ void count() { launches += 1; }
