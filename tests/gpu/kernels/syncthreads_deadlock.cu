// Row 2: warp 0 waits at a barrier that warp 1 never reaches, because warp 1 waits for warp 0.
extern "C" __global__ void relu(const float* x, float* y, long n) {
  __shared__ volatile int ready;
  if (threadIdx.x == 0) ready = 0;
  if (threadIdx.x < 32) {
    __syncthreads();
    ready = 1;
  } else {
    while (!ready) {}
  }
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i], 0.f);
}
