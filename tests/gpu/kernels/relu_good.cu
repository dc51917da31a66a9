// Good: grid-stride ReLU, vectorized by four where the pointers allow it.
extern "C" __global__ void relu(const float* __restrict__ x, float* __restrict__ y, long n) {
  long tid = (long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long)gridDim.x * blockDim.x;
  long n4 = n / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  for (long i = tid; i < n4; i += stride) {
    float4 v = x4[i];
    y4[i] = make_float4(fmaxf(v.x, 0.f), fmaxf(v.y, 0.f), fmaxf(v.z, 0.f), fmaxf(v.w, 0.f));
  }
  for (long i = 4 * n4 + tid; i < n; i += stride) y[i] = fmaxf(x[i], 0.f);
}
