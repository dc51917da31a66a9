// Row 1: aborts the launch with a trap.
extern "C" __global__ void relu(const float* x, float* y, long n) {
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 12345) __trap();
  if (i < n) y[i] = fmaxf(x[i], 0.f);
}
