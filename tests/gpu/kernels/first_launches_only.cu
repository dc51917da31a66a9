// Row 12: correct for its first 10 launches (more than the checks make), then does no work,
// so it times faster than the HBM roofline allows.
__device__ unsigned launches;
extern "C" __global__ void relu(const float* x, float* y, long n) {
  if (launches >= 10) return;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    y[i] = fmaxf(x[i], 0.f);
}
extern "C" __global__ void count() { launches += 1; }
