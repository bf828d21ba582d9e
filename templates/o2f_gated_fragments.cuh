// o2f_gated_fragments.cuh: the resident register path's epilogue of a gated layer (to_fragments_gated).
// Static device code included inside the generated kernel's anonymous namespace (16-bit operands, chains
// with a gated layer), after pack2 and o2f_gated.cuh's gated_value.
#pragma once
// acc: the layer's NT8 GEMM n8 tiles, (gate, up) pairs (o2f_gated.cuh), i.e. NT8 / 2 output n8 tiles; output
// n8 tiles 2t and 2t+1 (columns [16t, 16t+16)) form the next layer's A fragment of k16 step t. act(gate) * up
// in fp32, rounded and packed; columns >= N (padding) become zeros.
template <int L, int N, int MT, int NT8>
__device__ __forceinline__ void to_fragments_gated(const float (&acc)[MT][NT8][4], uint32_t (&af)[MT][NT8 / 4][4],
                                                   int lane) {
  static_assert(NT8 % 4 == 0, "two output n8 tiles (four GEMM tiles) per k16 step");
  const int t2 = 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT8 / 2; ++j) {
      const int col = j * 8 + t2;
      const bool mask = j * 8 + 8 > N;  // resolved at compile time
      const float(&g)[4] = acc[mt][2 * j];
      const float(&u)[4] = acc[mt][2 * j + 1];
      af[mt][j / 2][(j & 1) * 2] = pack2(gated_value<L>(g[0], u[0], col, N, mask), gated_value<L>(g[1], u[1], col + 1, N, mask));
      af[mt][j / 2][(j & 1) * 2 + 1] =
          pack2(gated_value<L>(g[2], u[2], col, N, mask), gated_value<L>(g[3], u[3], col + 1, N, mask));
    }
}
