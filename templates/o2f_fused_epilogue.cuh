// o2f_fused_epilogue.cuh: the tensor-core kernels' accumulator start (bias) and epilogues (hidden
// layer into shared memory, last layer to global memory). Static device code included inside the
// generated kernel's anonymous namespace, after elem_t, io_t, act<L>, store_act2 and the o2f_fused_io helpers.
#pragma once
// Accumulators start at the bias (`bias` at the layer's first column, `col0` the warp's first
// column), which saves the epilogue an add per element.
template <int MT, int NT8>
__device__ __forceinline__ void init_acc(float (&acc)[MT][NT8][4], int col0, const float* bias, int lane) {
  const int t2 = 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < NT8; ++j) {
#ifdef O2F_DIAG_NO_BIAS   // a diagnostic build (kernel_check.py --diag): accumulators from zero, what the bias costs
    const float2 b = make_float2(0.0f, 0.0f);
#else
    const float2 b = *reinterpret_cast<const float2*>(bias + col0 + j * 8 + t2);
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      acc[mt][j][0] = b.x; acc[mt][j][1] = b.y; acc[mt][j][2] = b.x; acc[mt][j][3] = b.y;
    }
  }
}

// Hidden layer epilogue: activation of the accumulators (bias included; store_act2: in fp32, or packed
// fp16x2 where the layer has that form), rounded into the activation buffer (`dst` at the warp's first
// row, `col0` the warp's first column). Columns >= N are
// written as zeros: they are the padded features of the next layer. `col0` is the layer's own column
// (per-channel constants, padding); column c lands in dst's column c - dst_col0 (nonzero for a fused
// pair's hidden block, whose buffer H holds only the block's columns).
template <int L, int N, int MT, int NT8>
__device__ __forceinline__ void store_hidden(const float (&acc)[MT][NT8][4], int col0, elem_t* dst, int ldd, int lane,
                                             int dst_col0 = 0) {
  const int g = lane >> 2, t2 = 2 * (lane & 3);
  const bool padded = col0 + 8 * NT8 > N;  // only the tile holding the last true column masks
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = col0 + j * 8 + t2;
        store_act2<L>(dst + (mt * 16 + g + 8 * h) * ldd + (col - dst_col0), acc[mt][j][2 * h], acc[mt][j][2 * h + 1],
                      col, N, padded);
      }
}

// Output columns col and col + 1 of a row (`out` points at col) in the output type: one paired store
// where N is even (col is then even too), else one at a time, the second only inside the row.
template <int N>
__device__ __forceinline__ void store_out_pair(io_t* __restrict__ out, int col, float v0, float v1) {
  if (N % 2 == 0) o2f_store2(out, v0, v1);
  else { o2f_store(out, v0); if (col + 1 < N) o2f_store(out + 1, v1); }
}

// What the last layer's epilogue adds to its outputs before the conversion: nothing here; a block's input
// row with a residual behind (o2f_block_residual.cuh, Residual). kAdds false: no code at all.
struct NoResidual {
  static constexpr bool kAdds = false;
  __device__ __forceinline__ float2 operator()(int64_t, int) const { return make_float2(0.0f, 0.0f); }
};

// Each output pair this thread holds of a last layer's fragments, in rows before `end` and columns before N:
// fn(row, col, v0, v1), v0 and v1 the activations of columns col and col + 1 (col + 1 may be N: padding).
template <int L, int N, int MT, int NT8, class F>
__device__ __forceinline__ void for_each_output(const float (&acc)[MT][NT8][4], int col0, int64_t end, int64_t row0,
                                                int lane, F&& fn) {
  const int g = lane >> 2, t2 = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = col0 + j * 8 + t2;
        const int64_t row = row0 + mt * 16 + g + 8 * h;
        if (row >= end || col >= N) continue;
        fn(row, col, act<L>(acc[mt][j][2 * h], col), act<L>(acc[mt][j][2 * h + 1], col + 1));
      }
}

// Last layer epilogue: activation (plus `res`), converted to the output type, straight to global memory.
template <int L, int N, int MT, int NT8, class Res = NoResidual>
__device__ __forceinline__ void store_output(const float (&acc)[MT][NT8][4], int col0, io_t* __restrict__ y,
                                             int64_t rows, int64_t row0, int lane, Res res = Res()) {
  for_each_output<L, N>(acc, col0, rows, row0, lane, [&](int64_t row, int col, float v0, float v1) {
    if constexpr (Res::kAdds) {
      const float2 r = res(row, col);
      v0 += r.x;
      v1 += r.y;
    }
    store_out_pair<N>(y + row * N + col, col, v0, v1);
  });
}
