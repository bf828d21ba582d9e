// o2f_wgmma_norm.cuh: a transformer block in the wgmma kernel (plan/wgmma.py, BLOCK_K0_MAX): the norm of each
// input row in front, the residual add of x behind. Static device code included inside the generated kernel's
// anonymous namespace after o2f_wgmma.cuh (its load_ks pattern) and, with a norm, the constants kNormK0,
// kNormEps, kNormLayer, kNormBias, kNormRoundHalf and kNormKp; fp32 I/O (in_t is float).
//
// The norm works on the A fragments' values of a tile's rows: a thread's load_ks values of every k-step of
// rows r and r + 8 (columns 16 ks + t2 + {0, 1, 8, 9}), all k-steps in registers before any is converted;
// the 4 lanes of a quad hold a row between them, so a row's sums take two xor shuffles. The arithmetic is
// the mma.sync kernels' (o2f_block_norm.cuh, norm_value): the mean, then the squared deviations from it
// (two passes over the held row), IEEE-rounded, 1 / sqrt(var + eps) once a row; only the K0 true features
// enter the sums, and the padded ones stay zeros. The sums run in another order than there (per thread over
// its columns, then the quad), which moves a value by at most an ulp or so of fp32 before its rounding to 16
// bits.
#pragma once

#ifdef O2F_WGMMA_NORM
#include "o2f_norm_value.cuh"

// A row's sum over its quad of lanes (every lane of the quad gets the same bits).
__device__ __forceinline__ float norm_quad_sum(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Rows r (h = 0) and r + 8 (h = 1) of a thread's k-step values (load_ks): v[ks][norm_idx(h, j)] is feature
// 16 ks + t2 + norm_col(j), j = 0..3.
__device__ __forceinline__ constexpr int norm_idx(int h, int j) { return 2 * h + (j & 1) + 4 * (j >> 1); }
__device__ __forceinline__ constexpr int norm_col(int j) { return (j & 1) + 8 * (j >> 1); }

// The KS k-steps' values of a thread's two rows, normalised in place; `params`: the norm's scale, then its
// bias kNormKp floats on (shared memory, zero-padded; a thread's columns come in pairs: one 8-byte load each).
template <int KS>
__device__ __forceinline__ void norm_tile(float (&v)[KS][8], int t2, const float* params) {
  const float k0 = static_cast<float>(kNormK0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (16 * ks + t2 + norm_col(j) < kNormK0) sum = __fadd_rn(sum, v[ks][norm_idx(h, j)]);
    const float mean = kNormLayer ? __fdiv_rn(norm_quad_sum(sum), k0) : 0.0f;
    float sumsq = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (16 * ks + t2 + norm_col(j) < kNormK0) {
          const float e = kNormLayer ? __fsub_rn(v[ks][norm_idx(h, j)], mean) : v[ks][norm_idx(h, j)];
          sumsq = __fadd_rn(sumsq, __fmul_rn(e, e));
        }
    // (a NaN, a row holding an Inf, stays NaN)
    const float dv = __fdiv_rn(norm_quad_sum(sumsq), k0);
    const float var = dv < 0.0f ? 0.0f : dv;
    const float b = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, kNormEps)));
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int p = 0; p < 2; ++p) {   // columns c and c + 1
        const int c = 16 * ks + t2 + 8 * p;
        const float2 sc = *reinterpret_cast<const float2*>(params + c);
        const float2 bi = kNormBias ? *reinterpret_cast<const float2*>(params + kNormKp + c) : make_float2(0.0f, 0.0f);
        float& x0 = v[ks][norm_idx(h, 2 * p)];
        float& x1 = v[ks][norm_idx(h, 2 * p + 1)];
        x0 = c < kNormK0 ? norm_value(x0, mean, b, sc.x, bi.x) : 0.0f;
        x1 = c + 1 < kNormK0 ? norm_value(x1, mean, b, sc.y, bi.y) : 0.0f;
      }
  }
}
#endif  // O2F_WGMMA_NORM

#ifdef O2F_WGMMA_RESIDUAL
// The residual behind: x at (row, col), 0 past the batch or the row's end (K0 == N: x's rows are N wide).
__device__ __forceinline__ float residual_at(const float* __restrict__ x, int64_t rows, int64_t row, int col) {
  return row < rows && col < kNOut ? __ldg(x + row * kNOut + col) : 0.0f;
}
// x's values (row, col..col + 1) and (row, col..col + 3): what a pair or quad store adds. A chunk's stores
// have all their values loaded ahead (cuda_wgmma.cu.j2, residual_loads): every store orders memory ("memory"
// clobber), so a load between two stores could not start before the first had issued, and each paid the
// whole global-memory latency in turn.
__device__ __forceinline__ float2 residual2_at(const float* __restrict__ x, int64_t rows, int64_t row, int col) {
  return make_float2(residual_at(x, rows, row, col), residual_at(x, rows, row, col + 1));
}
__device__ __forceinline__ float4 residual4_at(const float* __restrict__ x, int64_t rows, int64_t row, int col) {
  return make_float4(residual_at(x, rows, row, col), residual_at(x, rows, row, col + 1),
                     residual_at(x, rows, row, col + 2), residual_at(x, rows, row, col + 3));
}
// ... or, where the tile's rows are staged (plan.wgmma IN_BUFFERS_RESIDUAL: the tile's buffer stays until its
// last layer), x's values (row, col..col + 3) or (row, col..col + 1) of the tile from its buffer `buf` (rows RB
// bytes apart; col a multiple of 4, or of 2: aligned loads). Columns past K0 hold zeros (bulk_zero_pad); rows
// past the batch hold stale values, whose outputs are never stored.
template <int RB>
__device__ __forceinline__ float4 residual4_staged(uint32_t buf, int row, int col) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(buf + row * RB + col * 4) : "memory");
  return v;
}
template <int RB>
__device__ __forceinline__ float2 residual2_staged(uint32_t buf, int row, int col) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(buf + row * RB + col * 4) : "memory");
  return v;
}
#endif  // O2F_WGMMA_RESIDUAL
