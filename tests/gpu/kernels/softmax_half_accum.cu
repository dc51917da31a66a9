// Row 9: an fp32 softmax whose exponentials and sum are kept in fp16.
#include <cuda_fp16.h>
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h and so no INFINITY
extern "C" __global__ void softmax_rows(const float* x, float* y, int cols) {
  __shared__ float mx;
  __shared__ __half total;
  const float* row = x + (long)blockIdx.x * cols;
  if (threadIdx.x == 0) {
    float m = NEG_INF;
    for (int i = 0; i < cols; ++i) m = fmaxf(m, row[i]);
    __half s = __float2half(0.f);
    for (int i = 0; i < cols; ++i) s = __hadd(s, __float2half(__expf(row[i] - m)));
    mx = m;
    total = s;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < cols; i += blockDim.x)
    y[(long)blockIdx.x * cols + i] = __half2float(__hdiv(__float2half(__expf(row[i] - mx)), total));
}
