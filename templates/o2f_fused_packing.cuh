// o2f_fused_packing.cuh: weight and bias packing of the tensor-core kernels (chunks of NC columns x KC
// features, n-major), and the persistent grid size per device. Static code included inside the generated
// kernel's anonymous namespace, after elem_t, kPad, kWeightElems and to_elem.
#pragma once
// Packing: W [K, N] fp32 (y = x @ W) times `scale` (a power of two: MLPSpec.prescale) -> chunks of NC
// columns x KC features, n-major, stride KC+kPad.
__global__ void pack_weights(const float* __restrict__ w, elem_t* __restrict__ dst, int K, int N, int KC, int NC,
                             int n_kchunks, int total, float scale) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int ce = NC * (KC + kPad);
  const int chunk = i / ce, e = i - chunk * ce;
  const int nci = chunk / n_kchunks, kci = chunk - nci * n_kchunks;
  const int n = e / (KC + kPad), kk = e - n * (KC + kPad);
  const int gn = nci * NC + n, gk = kci * KC + kk;
  dst[i] = to_elem((kk < KC && gn < N && gk < K) ? scale * w[static_cast<int64_t>(gk) * N + gn] : 0.0f);
}

__global__ void pack_bias(const float* __restrict__ b, float* __restrict__ dst, int N, int NP, float scale) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < NP) dst[i] = i < N ? scale * b[i] : 0.0f;
}

constexpr size_t kBiasOffsetBytes = static_cast<size_t>(kWeightElems) * sizeof(elem_t);

// Full persistent grid of `kernel` on device `dev`: computed on the first launch there (idempotent,
// so two threads racing compute and store the same number).
template <typename Kernel>
cudaError_t grid_blocks(Kernel kernel, int threads, int smem, int dev, std::atomic<int>* cache, int* blocks) {
  *blocks = cache[dev].load(std::memory_order_acquire);
  if (*blocks) return cudaSuccess;
  int sms = 0, per_sm = 0;
  cudaError_t err;
  if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
      (err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem)) != cudaSuccess)
    return err;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  *blocks = sms * per_sm;
  cache[dev].store(*blocks, std::memory_order_release);
  return cudaSuccess;
}
