// o2f_wide_glu.cuh: the wide design's glu pass for a gated layer (SwiGLU, GeGLU; plan/wide.py): its GEMM
// wrote the gate and up products side by side, hg[r] = [gate (NP columns) | up (NP columns)] in the
// 16-bit compute type; this pass writes the hidden row h[r, j] = act(gate[j]) * up[j] (NP columns, the
// next GEMM's A operand). Static code included inside the generated source's namespace o2f_<chain>,
// after elem_raw, DeviceInfo and the activation functors. Memory bound: it reads 4 and writes 2 bytes per
// output column; the activation and the product are fp32, rounded to the compute type once.
#pragma once
#include "o2f_wide_half2.cuh"

using elem_raw2 = o2f_pair_t<elem_raw>;
template <typename T2> __device__ __forceinline__ T2 glu_pack2(float a, float b);
template <> __device__ __forceinline__ __half2 glu_pack2<__half2>(float a, float b) { return __floats2half2_rn(a, b); }
template <> __device__ __forceinline__ __nv_bfloat162 glu_pack2<__nv_bfloat162>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}

// Eight output columns a thread: a 16-byte load of the gate products, one of the up products, and a
// 16-byte store (NP is a multiple of 8, and every row of hg and h starts 16-byte aligned).
template <typename Act, int kHalf>
__global__ void glu_rows(const elem_raw* __restrict__ hg, elem_raw* __restrict__ h, int64_t m) {
  static_assert(kHalf % 8 == 0, "the gated layer's padded width is a multiple of 8");
  constexpr int kVecs = kHalf / 8;
  const Act act;
  const int64_t total = m * kVecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / kVecs;
    const int c = static_cast<int>(i - r * kVecs) * 8;
    const elem_raw* row = hg + r * (2 * kHalf);
    const uint4 g = *reinterpret_cast<const uint4*>(row + c);
    const uint4 u = *reinterpret_cast<const uint4*>(row + kHalf + c);
    const elem_raw2* g2 = reinterpret_cast<const elem_raw2*>(&g);
    const elem_raw2* u2 = reinterpret_cast<const elem_raw2*>(&u);
    uint4 out;
    elem_raw2* o2 = reinterpret_cast<elem_raw2*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 gf = o2f_float2(g2[j]), uf = o2f_float2(u2[j]);
      o2[j] = glu_pack2<elem_raw2>(__fmul_rn(act(gf.x), uf.x), __fmul_rn(act(gf.y), uf.y));
    }
    *reinterpret_cast<uint4*>(h + r * kHalf + c) = out;
  }
}

template <typename Act, int kHalf>
cudaError_t glu(const DeviceInfo& dev, const void* hg, void* h, int m, cudaStream_t s) {
  const int64_t vecs = static_cast<int64_t>(m) * (kHalf / 8);
  const int grid = static_cast<int>(vecs / 256 + 1 < 8LL * dev.sms ? vecs / 256 + 1 : 8LL * dev.sms);
  glu_rows<Act, kHalf><<<grid, 256, 0, s>>>(static_cast<const elem_raw*>(hg), static_cast<elem_raw*>(h), m);
  return cudaGetLastError();
}
