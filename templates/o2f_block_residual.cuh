// o2f_block_residual.cuh: a transformer block's epilogue in the tensor-core fused kernels (resident,
// streamed): the last layer's output plus the block's input row, x as it came in (read from global memory,
// never the normalised tile), in fp32 before the conversion to the output type, as the CPU kernel's
// add_rows does. Static device code included inside the generated kernel's anonymous namespace, only by
// chains with a residual, after io_t, act<L> and the o2f_fused_io helpers. K0 == N: x's rows are N wide.
#pragma once

// x at (row, col) and (row, col + 1); the second is 0 past the row's end (odd N).
template <int N>
__device__ __forceinline__ float2 residual_pair(const io_t* __restrict__ x, int64_t row, int col) {
  const io_t* p = x + row * N + col;
  return make_float2(o2f_load(p), col + 1 < N ? o2f_load(p + 1) : 0.0f);
}

// store_output (o2f_fused_epilogue.cuh) with the residual.
template <int L, int N, int MT, int NT8>
__device__ __forceinline__ void store_output_res(const float (&acc)[MT][NT8][4], int col0, io_t* __restrict__ y,
                                                 const io_t* __restrict__ x, int64_t rows, int64_t row0, int lane) {
  const int g = lane >> 2, t2 = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = col0 + j * 8 + t2;
        const int64_t row = row0 + mt * 16 + g + 8 * h;
        if (row >= rows || col >= N) continue;
        const float2 r = residual_pair<N>(x, row, col);
        const float v0 = act<L>(acc[mt][j][2 * h], col) + r.x;
        const float v1 = act<L>(acc[mt][j][2 * h + 1], col + 1) + r.y;
        store_out_pair<N>(y + row * N + col, col, v0, v1);
      }
}

// store_output_gated (o2f_gated.cuh) with the residual: a gated last layer, acc[mt][2p] its gate and
// acc[mt][2p + 1] its up values of the same output columns.
template <int L, int N, int MT, int NT8>
__device__ __forceinline__ void store_output_gated_res(const float (&acc)[MT][NT8][4], int col0, io_t* __restrict__ y,
                                                       const io_t* __restrict__ x, int64_t rows, int64_t row0, int lane) {
  static_assert(NT8 % 2 == 0, "a gated layer's n8 tiles come in (gate, up) pairs");
  const int g = lane >> 2, t2 = 2 * (lane & 3);
  const int out0 = col0 / 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int p = 0; p < NT8 / 2; ++p)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = out0 + p * 8 + t2;
        const int64_t row = row0 + mt * 16 + g + 8 * h;
        if (row >= rows || col >= N) continue;
        const float2 r = residual_pair<N>(x, row, col);
        const float v0 = act<L>(acc[mt][2 * p][2 * h], col) * acc[mt][2 * p + 1][2 * h] + r.x;
        const float v1 = act<L>(acc[mt][2 * p][2 * h + 1], col + 1) * acc[mt][2 * p + 1][2 * h + 1] + r.y;
        store_out_pair<N>(y + row * N + col, col, v0, v1);
      }
}
