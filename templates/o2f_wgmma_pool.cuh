// o2f_wgmma_pool.cuh: the last layer's epilogue of a pooled chain (MLPSpec.pool) in the wgmma kernel: in
// place of its stores, each output column's maximum (or sum: o2f_pool_combine, o2f_pool_raise) over the
// warp's 16 rows of a tile raises (adds to) the group's float entry (o2f_pool.cuh); "maxima" below read as
// either. The kernel runs only where a group's rows are a multiple of 16
// (PointNet's 1024 points a cloud; the run function leaves other groups to the mma.sync fallback), so a
// warp's 16 rows always lie in one group: each lane takes the max of its two rows (g, g + 8) per column
// (pool_take), then a chunk's 16 values a lane are reduced across the 8 lanes that hold the same columns
// (those of one lane % 4) by halving exchanges (pool_chunk: 8 + 4 + 2 shuffles, each lane keeping the half
// its partner does not), which leaves every lane the maxima of two columns to raise in a shared-memory copy
// of the group's entries, flushed into the global ones once a tile (or, where the warpgroup's 64 rows
// straddle groups, in global memory directly). (Three butterfly shuffles a value, 48 a chunk, and a global
// atomic from a quarter of the lanes took more issue slots than the chunk's MMAs; a row-by-row path for
// warps across two groups, inlined into each of a 1024-wide layer's 128 blocks, doubled the kernel's code.)
// Static device code included inside the generated kernel's anonymous namespace, after o2f_pool.cuh;
// sm_90a only.
#pragma once

// Columns col and col + 1 of rows row0 (a0, a1) and row0 + 8 (b0, b1), the layer's activations: their max
// over the two rows in v0, v1 (rows past the batch: kPoolStart).
__device__ __forceinline__ void pool_take(int64_t rows, int64_t row0, float a0, float a1, float b0, float b1,
                                          float& v0, float& v1) {
  const bool in0 = row0 < rows, in1 = row0 + 8 < rows;
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
// columns c0 + 8j + 2t and + 1 (t = lane % 4; kPoolStart past NB). After the exchanges over g's three bits, lane
// (g, t) holds block g's: it raises those entries in the tile's shared copy or, where the tile has none,
// in global memory. `in_batch`: any of the warp's rows is (warp-uniform).
template <int N, int NB>
__device__ __forceinline__ void pool_chunk(bool in_batch, float* shared, pool_t* y, int64_t row0, int64_t group_rows,
                                           int c0, int lane, float (&v)[16]) {
  if (!in_batch) return;
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
  pool_t* out = y + (row0 - g) / group_rows * N;   // (row0 - g: the warp's first row)
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
