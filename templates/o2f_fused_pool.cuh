// o2f_fused_pool.cuh: the last layer's epilogue of a pooled chain (MLPSpec.pool "max") in the mma.sync
// kernels: in place of store_output, each output column's maximum over the warp's rows goes into the float
// entries y [groups, N] (o2f_pool.cuh). A warp's rows (16 * MT, consecutive) mostly lie in one group
// (PointNet's 1024 points a cloud): each lane takes the max of its rows, three shuffles give the warp's,
// and one lane a column pair raises the group's entries, one atomic each; a warp whose rows straddle two
// groups raises them row by row (for_each_output, store_output's fragment loop). Static device code included
// inside the generated kernel's anonymous namespace, after o2f_fused_epilogue.cuh.
#pragma once
#include "o2f_pool.cuh"

template <int L, int N, int MT, int NT8>
__device__ __forceinline__ void store_output_pool(const float (&acc)[MT][NT8][4], int col0, pool_t* __restrict__ y,
                                                  int64_t rows, int64_t row0, int lane, int64_t group_rows) {
  const int g = lane >> 2, t2 = 2 * (lane & 3);
  if (row0 >= rows) return;
  const int64_t last = (row0 + 16 * MT < rows ? row0 + 16 * MT : rows) - 1;
  const int64_t group = row0 / group_rows;
  if (last / group_rows == group) {   // warp-uniform: the shuffles below see every lane
    pool_t* out = y + group * N;
    float m[NT8][2];
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
      const int col = col0 + j * 8 + t2;
      m[j][0] = m[j][1] = -INFINITY;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (row0 + mt * 16 + g + 8 * h > last) continue;
          m[j][0] = o2f_max_nan(m[j][0], act<L>(acc[mt][j][2 * h], col));
          m[j][1] = o2f_max_nan(m[j][1], act<L>(acc[mt][j][2 * h + 1], col + 1));
        }
#pragma unroll
      for (int d = 4; d < 32; d *= 2) {
        m[j][0] = o2f_max_nan(m[j][0], __shfl_xor_sync(0xffffffffu, m[j][0], d));
        m[j][1] = o2f_max_nan(m[j][1], __shfl_xor_sync(0xffffffffu, m[j][1], d));
      }
    }
    if (g != 0) return;
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
      const int col = col0 + j * 8 + t2;
      if (col >= N) continue;
      o2f_atomic_max(out + col, m[j][0]);
      if (col + 1 < N) o2f_atomic_max(out + col + 1, m[j][1]);
    }
    return;
  }
  for_each_output<L, N>(acc, col0, last + 1, row0, lane, [&](int64_t row, int col, float v0, float v1) {
    pool_t* out = y + (row / group_rows) * N;
    o2f_atomic_max(out + col, v0);
    if (col + 1 < N) o2f_atomic_max(out + col + 1, v1);
  });
}
