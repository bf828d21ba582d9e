// o2f_gated.cuh: gated layers (SwiGLU/GeGLU: y = act(x Wg + bg) * (x Wu + bu)) in the tensor-core kernels:
// pack-time interleave of gate and up, and the epilogues. Static device code included inside the generated
// kernel's anonymous namespace (only by chains with a gated layer), after elem_t, kPad, to_elem, store2,
// act<L> and the o2f_fused_io helpers.
//
// A gated layer of N outputs (NP padded) is one GEMM of 2*NP columns whose weights and bias are packed
// with gate and up interleaved in blocks of 8 columns: GEMM n8 tile 2q holds gate columns [8q, 8q+8),
// tile 2q+1 up columns [8q, 8q+8). mma.sync's accumulator layout then gives a lane the gate and up values
// of the same output columns in acc[mt][2q] and acc[mt][2q+1], so act(gate) * up is formed in registers.
// A warp's first GEMM column is a multiple of 16 (its n8 tiles come in pairs): output column = GEMM
// column / 2 of the pair's gate tile.
#pragma once

// The column of W ([K, 2N], gate columns first) that GEMM column c of a gated layer reads; -1: padding.
__device__ __forceinline__ int gated_source_col(int c, int N) {
  const int j = (c >> 4) * 8 + (c & 7);
  if (j >= N) return -1;
  return (c & 8) ? N + j : j;
}

// pack_weights for a gated layer: chunks of NC GEMM columns (NC / 2 output columns) x KC features.
__global__ void pack_weights_gated(const float* __restrict__ w, elem_t* __restrict__ dst, int K, int N, int KC,
                                   int NC, int n_kchunks, int total) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int ce = NC * (KC + kPad);
  const int chunk = i / ce, e = i - chunk * ce;
  const int nci = chunk / n_kchunks, kci = chunk - nci * n_kchunks;
  const int n = e / (KC + kPad), kk = e - n * (KC + kPad);
  const int src = gated_source_col(nci * NC + n, N), gk = kci * KC + kk;
  dst[i] = to_elem((kk < KC && src >= 0 && gk < K) ? w[static_cast<int64_t>(gk) * (2 * N) + src] : 0.0f);
}

// The bias (2N: gate's, then up's) in the same interleaved order, `cols` = 2 * NP GEMM columns.
__global__ void pack_bias_gated(const float* __restrict__ b, float* __restrict__ dst, int N, int cols) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= cols) return;
  const int src = gated_source_col(i, N);
  dst[i] = src >= 0 ? b[src] : 0.0f;
}

// act(gate) * up of output column col, computed in fp32; with `mask`, 0 for columns >= n (padding: the
// next layer's padded features).
template <int L>
__device__ __forceinline__ float gated_value(float g, float u, int col, int n, bool mask) {
  return mask && col >= n ? 0.0f : act<L>(g, col) * u;
}

// store_hidden of a gated layer: acc holds MT x NT8 GEMM tiles from GEMM column col0 (a multiple of 16),
// NT8 / 2 (gate, up) pairs; output column c lands in dst's column c - dst_col0.
template <int L, int N, int MT, int NT8>
__device__ __forceinline__ void store_hidden_gated(const float (&acc)[MT][NT8][4], int col0, elem_t* dst, int ldd,
                                                   int lane, int dst_col0 = 0) {
  static_assert(NT8 % 2 == 0, "a gated layer's n8 tiles come in (gate, up) pairs");
  const int g = lane >> 2, t2 = 2 * (lane & 3);
  const int out0 = col0 / 2;
  const bool padded = out0 + 4 * NT8 > N;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int p = 0; p < NT8 / 2; ++p)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = out0 + p * 8 + t2;
        store2(dst + (mt * 16 + g + 8 * h) * ldd + (col - dst_col0),
               gated_value<L>(acc[mt][2 * p][2 * h], acc[mt][2 * p + 1][2 * h], col, N, padded),
               gated_value<L>(acc[mt][2 * p][2 * h + 1], acc[mt][2 * p + 1][2 * h + 1], col + 1, N, padded));
      }
}

// store_output of a gated last layer: act(gate) * up (plus `res`) converted to the output type, to global memory.
template <int L, int N, int MT, int NT8, class Res = NoResidual>
__device__ __forceinline__ void store_output_gated(const float (&acc)[MT][NT8][4], int col0, io_t* __restrict__ y,
                                                   int64_t rows, int64_t row0, int lane, Res res = Res()) {
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
        float v0 = act<L>(acc[mt][2 * p][2 * h], col) * acc[mt][2 * p + 1][2 * h];
        float v1 = act<L>(acc[mt][2 * p][2 * h + 1], col + 1) * acc[mt][2 * p + 1][2 * h + 1];
        if constexpr (Res::kAdds) {
          const float2 r = res(row, col);
          v0 += r.x;
          v1 += r.y;
        }
        store_out_pair<N>(y + row * N + col, col, v0, v1);
      }
}
