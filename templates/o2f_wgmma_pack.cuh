// o2f_wgmma_pack.cuh: packing of the wgmma design's weight image and bias (templates/cuda_wgmma.cu.j2).
// Static code for every arch (the pack entry runs on any GPU), included inside the generated source's
// anonymous namespace.
//
// The image of one layer: chunks of NC output columns, each an NC x KP tile, K-major (row n holds the
// column's KP features, contiguous), tiled by swizzle atoms of 8 rows x ATOM bytes: atoms follow each
// other along N first (8 rows at a time), then along K (NC/8 atoms on): CuTe's
// tile_to_shape(GMMA::Layout_K_SW{128,64,32}_Atom<half>, (NC, KP)). The 16-byte column inside an atom row
// is XORed with the row (Swizzle<3|2|1,4,3> on byte offsets; chunks start at multiples of the pattern's
// period, so relative offsets swizzle as the absolute shared-memory addresses the hardware sees).
#pragma once
__host__ __device__ __forceinline__ unsigned wgmma_swizzle(unsigned b, int atom) {
  return b ^ (((b >> 7) & static_cast<unsigned>(atom / 16 - 1)) << 4);
}

__device__ __forceinline__ void wgmma_store_elem(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void wgmma_store_elem(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Padded column n of a layer -> its column in the source weight or bias (-1: padding). Gated layers
// (gated = the hidden width H > 0; the source has gate columns 0..H-1, then up columns H..2H-1) interleave
// by n8 blocks: block 2m holds gate columns 8m..8m+7, block 2m+1 the up columns of the same features.
// A last layer in quads (plan.wgmma QUAD_STORES) permutes each 16 columns so that the two n8 blocks'
// pairs a thread holds are 4 adjacent outputs: column 16m + 8h + 2t + e holds output 16m + 4t + 2h + e.
__host__ __device__ __forceinline__ int wgmma_source_column(int n, int N, int gated, int quads) {
  if (quads) n = (n & ~15) + 4 * ((n >> 1) & 3) + 2 * ((n >> 3) & 1) + (n & 1);
  if (!gated) return n < N ? n : -1;
  const int b = n / 8, h = 8 * (b / 2) + n % 8;
  return h < gated ? h + (b % 2) * gated : -1;
}

// W [K, N] fp32 (y = x @ W) times `scale` (a power of two: plan.wgmma PRESCALE) -> the layer's chunks at
// `img` in the operand type E (fp16 or bf16; zeroed before: padding stays 0), one thread per padded (n, k).
template <typename E>
__global__ void wgmma_pack_layer(const float* __restrict__ w, unsigned char* __restrict__ img, int K, int N, int KP,
                                 int NP, int NC, int atom, int chunk_bytes, int gated, int quads,
                                 float scale) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= NP * KP) return;
  const int n = i / KP, k = i - n * KP;
  const int src = wgmma_source_column(n, N, gated, quads);
  const int c = n / NC, nn = n - c * NC, kb = 2 * k;
  const unsigned off = static_cast<unsigned>((nn % 8) * atom + (nn / 8) * 8 * atom + kb % atom + (kb / atom) * (NC / 8) * 8 * atom);
  const float v = (src >= 0 && k < K) ? scale * w[static_cast<int64_t>(k) * N + src] : 0.0f;
  wgmma_store_elem(reinterpret_cast<E*>(img + static_cast<int64_t>(c) * chunk_bytes + wgmma_swizzle(off, atom)), v);
}

__global__ void wgmma_pack_bias(const float* __restrict__ b, float* __restrict__ dst, int N, int NP, int gated,
                                int quads, float scale) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= NP) return;
  const int src = wgmma_source_column(i, N, gated, quads);
  dst[i] = src >= 0 ? scale * b[src] : 0.0f;
}
