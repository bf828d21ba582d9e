// o2f_register_fragments.cuh: the resident design's register path (mma_fragments, to_fragments).
// Static device code included inside the generated kernel's anonymous namespace, after elem_t, kE, kPad,
// act_pack_masked<L>, ldmatrix_x4 and mma_step (16-bit operands only).
#pragma once
// The register design. m16n8k16's accumulator fragment of two adjacent n8 tiles (lane: rows g and g+8,
// columns 2t and 2t+1 of each) is exactly the A fragment of one k16 step of the next layer, so a
// layer's output becomes the next layer's input without leaving the warp's registers.

// acc[16*MT x 8*NT8] += af (16*MT rows x 16*KT features, packed A fragments) x the layer's weights at
// `w`: chunks of KC features x all the layer's padded columns, n-major, row stride KC + kPad, chunk
// stride CE elements.
template <int MT, int NT8, int KT, int KC, int CE>
__device__ __forceinline__ void mma_fragments(float (&acc)[MT][NT8][4], const uint32_t (&af)[MT][KT][4],
                                              const elem_t* w, int lane) {
  constexpr int LDW = KC + kPad;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    const elem_t* wk = w + (kt * 16 / KC) * CE + (kt * 16) % KC;
#pragma unroll
    for (int np = 0; np < NT8 / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, wk + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDW + ((lane >> 3) & 1) * kE);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_step(acc[mt][2 * np], af[mt][kt], b[0], b[1]);
        mma_step(acc[mt][2 * np + 1], af[mt][kt], b[2], b[3]);
      }
    }
  }
}

// Hidden layer epilogue of the register design: activation of the accumulators (bias included),
// rounded and packed (act_pack: fp32 or packed fp16x2 forms) into the next layer's A fragments.
// Columns >= N (padding) become zeros.
template <int L, int N, int MT, int NT8>
__device__ __forceinline__ void to_fragments(const float (&acc)[MT][NT8][4], uint32_t (&af)[MT][NT8 / 2][4],
                                             int lane) {
  const int t2 = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
      const int col = j * 8 + t2;
      const bool mask = j * 8 + 8 > N;  // resolved at compile time
      af[mt][j / 2][(j & 1) * 2] = act_pack_masked<L>(acc[mt][j][0], acc[mt][j][1], col, N, mask);
      af[mt][j / 2][(j & 1) * 2 + 1] = act_pack_masked<L>(acc[mt][j][2], acc[mt][j][3], col, N, mask);
    }
}
