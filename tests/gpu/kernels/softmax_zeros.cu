// Row 4: returns zeros, which a blanket atol of 1e-2 would pass on softmax rows of 4096.
extern "C" __global__ void softmax_rows(const float* x, float* y, int cols) {
  for (int i = threadIdx.x; i < cols; i += blockDim.x) y[(long)blockIdx.x * cols + i] = 0.f;
}
