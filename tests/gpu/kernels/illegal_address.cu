// Row 1: writes a terabyte past its output.
extern "C" __global__ void relu(const float* x, float* y, long n) {
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i + (1L << 40)] = fmaxf(x[i], 0.f);
}
