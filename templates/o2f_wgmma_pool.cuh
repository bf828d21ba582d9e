// o2f_wgmma_pool.cuh: the last layer's epilogue of a pooled chain (MLPSpec.pool) in the wgmma kernel: in
// place of its stores, each output column's maximum (or sum: o2f_pool_combine, o2f_pool_raise) over the
// warp's 16 rows of a tile raises (adds to) the group's float entry (o2f_pool.cuh); "maxima" below read as
// either. The kernel runs where a group has at least 16 rows (the run function leaves smaller groups to the
// mma.sync fallback), so a warp's 16 rows lie in one group or straddle two: the warp takes its rows one
// group at a time (at most two parts; PointNet's 1024 points a cloud always one, a CNN head's
// 7 x 7 = 49 positions two for about a third of its warps). In a part, each lane takes the max of its two
// rows (g, g + 8) per column where they are in the part (pool_take), then a chunk's 16 values a lane are
// reduced across the 8 lanes that hold the same columns
// (those of one lane % 4) by halving exchanges (pool_chunk: 8 + 4 + 2 shuffles, each lane keeping the half
// its partner does not), which leaves every lane the maxima of two columns to raise in a shared-memory copy
// of the group's entries, flushed into the global ones once a tile (or, where the warpgroup's 64 rows
// straddle groups, in global memory directly). (Three butterfly shuffles a value, 48 a chunk, and a global
// atomic from a quarter of the lanes took more issue slots than the chunk's MMAs; a row-by-row path for
// warps across two groups, inlined into each of a 1024-wide layer's 128 blocks, doubled the kernel's code;
// the parts' second copy of the epilogue is in the kStraddle instance only, and runs only where a warp
// straddles two groups. Its lanes raising their second part's values at once instead, without a second
// reduction, spilled nothing but took 380 us where the parts take 236 (PointNet, 1000 points a cloud) and
// 63 against 48 (MobileNetV2's head): a branch a block broke the epilogue's straight code.)
// Static device code included inside the generated kernel's anonymous namespace, after o2f_pool.cuh;
// sm_90a only.
#pragma once

// Columns col and col + 1 of rows row0 (a0, a1) and row0 + 8 (b0, b1), the layer's activations: their max
// over the two rows in v0, v1 (rows outside the part [lo, hi): kPoolStart). kFirst: the first part, which
// starts at the warp's first row (no lower bound to check: the registers of the one-part epilogue).
template <bool kFirst>
__device__ __forceinline__ void pool_take(int64_t lo, int64_t hi, int64_t row0, float a0, float a1, float b0, float b1,
                                          float& v0, float& v1) {
  const bool in0 = (kFirst || row0 >= lo) && row0 < hi, in1 = (kFirst || row0 + 8 >= lo) && row0 + 8 < hi;
  v0 = o2f_pool_combine(in0 ? a0 : kPoolStart, in1 ? b0 : kPoolStart);
  v1 = o2f_pool_combine(in0 ? a1 : kPoolStart, in1 ? b1 : kPoolStart);
}

// The warpgroup's maxima of a tile whose 64 rows all lie in one group: its warps raise a shared-memory copy
// of the group's entries (shared atomics), and the warpgroup raises the global ones once at the end of the
// tile (pool_flush): a quarter of the global atomics (PointNet at 256 clouds: 16.8 million a run, one per
// column and warp, where the L2's atomic units took longer than the MMAs). Two copies a warpgroup, used by
// turns, so that one barrier a tile orders a copy's flush before its next use (o2f_pool_raise raises
// shared entries as it does global ones). nullptr: the tile straddles groups or lies past the batch (its
// warps raise the global entries themselves).
template <int N>
__device__ __forceinline__ float* pool_tile(float* copies, int64_t rows, int64_t tile, int64_t stride,
                                               int64_t group_rows) {
  const int64_t first = tile * 64, last = (first + 64 < rows ? first + 64 : rows) - 1;
  if (first >= rows || first / group_rows != last / group_rows) return nullptr;
  return copies + ((tile / stride) & 1) * N;
}

// A chunk of NB n8 blocks from column c0: v[2j], v[2j + 1] are this lane's two-row maxima of block j's
// columns c0 + 8j + 2t and + 1 (t = lane % 4; kPoolStart past NB) over the part of the warp's rows from `lo`
// to `hi` (warp-uniform). After the exchanges over g's three bits, lane (g, t) holds block g's: it raises those
// entries in the tile's shared copy or, where the tile has none, the part's group's in global memory (`out`).
template <int N, int NB>
__device__ __forceinline__ void pool_chunk(float* shared, pool_t* out, int64_t lo, int64_t hi, int c0, int lane,
                                           float (&v)[16]) {
  if (lo >= hi) return;   // no rows (the warp's past the batch)
  pool_halve<8>(v, lane, 16);
  pool_halve<4>(v, lane, 8);
  pool_halve<2>(v, lane, 4);
  const int g = lane >> 2, col = c0 + 8 * g + 2 * (lane & 3);
  if (g >= NB || col >= N) return;
  if (shared != nullptr) {
    o2f_pool_raise(shared + col, v[0]);
    if (col + 1 < N) o2f_pool_raise(shared + col + 1, v[1]);
    return;
  }
  o2f_pool_raise(out + col, v[0]);
  if (col + 1 < N) o2f_pool_raise(out + col + 1, v[1]);
}

// The end of a warpgroup's tile: once its warps are done with the shared copy, its entries raise the
// global ones (each thread every 128th column) and go back to kPoolStart for the tile after next. Every thread of
// the warpgroup calls it every tile (the barrier).
template <int N>
__device__ __forceinline__ void pool_flush(float* shared, pool_t* y, int64_t tile, int64_t group_rows, int wg, int wtid) {
  wg_sync(wg);
  if (shared == nullptr) return;
  pool_t* out = y + tile * 64 / group_rows * N;
  for (int c = wtid; c < N; c += 128) {
    const float v = shared[c];
    shared[c] = kPoolStart;
    if (v != kPoolStart) o2f_pool_raise(out + c, v);   // (NaN too)
  }
}
