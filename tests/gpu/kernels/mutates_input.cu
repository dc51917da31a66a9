// Row 7: right answer, but it clobbers its input on the way.
extern "C" __global__ void relu(float* x, float* y, long n) {
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    y[i] = fmaxf(x[i], 0.f);
    x[i] = 0.f;
  }
}
