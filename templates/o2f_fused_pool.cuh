// o2f_fused_pool.cuh: the last layer's epilogue of a pooled chain (MLPSpec.pool) in the mma.sync kernels: in
// place of store_output, each output column's pool (maximum or sum: o2f_pool_combine) over the warp's rows
// goes into the float entries y [groups, N] (o2f_pool.cuh). A warp's rows (16 * MT, consecutive) mostly lie in one group
// (PointNet's 1024 points a cloud): each lane takes the max of its rows per column, the 8 lanes holding the
// same columns reduce them by halving exchanges (pool_halve: 7 shuffles for 8 values, where three butterfly
// shuffles a value took 24), and every lane raises the group's entries of the columns left to it, one
// atomic each; a warp whose rows straddle two groups raises them row by row (for_each_output,
// store_output's fragment loop). Static device code included inside the generated kernel's anonymous
// namespace, after o2f_fused_epilogue.cuh.
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
    // the lane's pools of its rows, column pair j's at v[2j], v[2j + 1], padded with kPoolStart to whole halvings
    constexpr int V = 8 * ((2 * NT8 + 7) / 8);
    float v[V];
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = kPoolStart;
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
      const int col = col0 + j * 8 + t2;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (row0 + mt * 16 + g + 8 * h > last) continue;
          v[2 * j] = o2f_pool_combine(v[2 * j], act<L>(acc[mt][j][2 * h], col));
          v[2 * j + 1] = o2f_pool_combine(v[2 * j + 1], act<L>(acc[mt][j][2 * h + 1], col + 1));
        }
    }
    pool_halve<V / 2>(v, lane, 16);
    pool_halve<V / 4>(v, lane, 8);
    pool_halve<V / 8>(v, lane, 4);
    pool_t* out = y + group * N;
#pragma unroll
    for (int k = 0; k < V / 8; ++k) {   // the lane's values: those first at g V/8 + k
      const int i = g * (V / 8) + k, col = col0 + (i >> 1) * 8 + t2 + (i & 1);
      if (i < 2 * NT8 && col < N) o2f_pool_raise(out + col, v[k]);
    }
    return;
  }
  for_each_output<L, N>(acc, col0, last + 1, row0, lane, [&](int64_t row, int col, float v0, float v1) {
    pool_t* out = y + (row / group_rows) * N;
    o2f_pool_raise(out + col, v0);
    if (col + 1 < N) o2f_pool_raise(out + col + 1, v1);
  });
}
