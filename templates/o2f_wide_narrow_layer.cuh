// o2f_wide_narrow_layer.cuh: the wide design's thread-per-row kernel for a last layer of at most 8
// outputs. Static device code included inside the generated source's namespace o2f_<chain>, after elem_t and elem_raw.
#pragma once
// A last layer of at most 8 outputs (a score, a few logits): a tensor-core tile would compute at least 64
// columns for it, so one thread per row takes the dot products with the weights from shared memory
// (N x KP floats), reading its row's 16-byte vectors: memory bound, one pass over the input.
template <template <typename> class Act, typename Out, int N, int KP>
__global__ void __launch_bounds__(256) narrow_layer(const elem_t* __restrict__ a, const elem_t* __restrict__ w,
                                                    const Out* __restrict__ bias, Out* __restrict__ d, int m, int ldd) {
  __shared__ float wt[N][KP];
  __shared__ float bt[N];
  for (int i = threadIdx.x; i < N * KP; i += blockDim.x) wt[i / KP][i % KP] = static_cast<float>(w[i]);
  if (threadIdx.x < N) bt[threadIdx.x] = static_cast<float>(bias[threadIdx.x]);
  __syncthreads();
  const Act<float> act;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < m;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc[N];
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] = bt[n];
    const uint4* row = reinterpret_cast<const uint4*>(a + r * KP);
#pragma unroll 4
    for (int v = 0; v < KP / 8; ++v) {
      const uint4 q = row[v];
      const elem_raw* e = reinterpret_cast<const elem_raw*>(&q);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x = static_cast<float>(e[j]);
#pragma unroll
        for (int n = 0; n < N; ++n) acc[n] = fmaf(x, wt[n][v * 8 + j], acc[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) d[r * ldd + n] = Out(act(acc[n]));
  }
}
