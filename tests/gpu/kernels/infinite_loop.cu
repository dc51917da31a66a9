// Row 2: spins until its output holds a value nothing ever writes there. The output
// starts poisoned, and the read is volatile global memory, so the loop cannot be
// optimized away (a volatile local can be: NVRTC dropped `while (spin) {}`).
extern "C" __global__ void relu(const float* x, float* y, long n) {
  volatile float* first = y;
  while (first[0] != 12345.f) {}
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i], 0.f);
}
