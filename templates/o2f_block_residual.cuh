// o2f_block_residual.cuh: a transformer block's epilogue in the tensor-core fused kernels (resident,
// streamed): the last layer's output plus the block's input row, x as it came in (read from global memory,
// never the normalised tile), in fp32 before the conversion to the output type, as the CPU kernel's
// add_rows does. Static device code included inside the generated kernel's anonymous namespace, only by
// chains with a residual, after io_t, act<L> and the o2f_fused_io helpers. K0 == N: x's rows are N wide.
#pragma once

// What the last layer's store_output / store_output_gated add (their `res`, o2f_fused_epilogue.cuh's
// NoResidual elsewhere): x at (row, col) and (row, col + 1), the second 0 past the row's end (odd N).
template <int N>
struct Residual {
  const io_t* __restrict__ x;
  static constexpr bool kAdds = true;
  __device__ __forceinline__ float2 operator()(int64_t row, int col) const {
    const io_t* p = x + row * N + col;
    return make_float2(o2f_load(p), col + 1 < N ? o2f_load(p + 1) : 0.0f);
  }
};

