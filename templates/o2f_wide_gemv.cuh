// o2f_wide_gemv.cuh: the wide design's GEMV path (plan/wide.py): a pass of at most kGemvRows (<= 16) rows
// runs each layer as one weight-streaming kernel instead of a CUTLASS GEMM, whose 128-row tiles would be
// mostly padding while the pass's cost is reading every weight once anyway. Static code included inside
// the generated source's namespace o2f_<chain>, after elem_t, elem_raw, io_t, DeviceInfo and kGemvRows.
//
// The products run on the tensor cores (mma.sync m16n8k16, fp32 accumulation), the m rows padded to 16
// with zeros in registers: the CUDA-core version (a warp per column, every activation converted to fp32
// for every column) was bound by those conversions at 16 rows, 4x slower than the weight read.
//
// A block owns 16 output columns as two 8-column tiles: columns [16b, 16b + 16), or for a gated layer
// gate columns [8b, 8b + 8) and their up columns at +second, so act(gate) * up pairs meet in one block.
// Its 8 warps split K: warp w takes the 32-wide K chunks w, w + 8, ... Lane (g = lane / 4, q = lane % 4)
// copies 16 bytes per chunk and tile, 8 consecutive k of weight column g (the n-major packing makes a
// column's K contiguous; L2 only, each weight is read once), and 16 bytes of activation rows g and g + 8
// at the same k (L1-cached: every block re-reads them). A dot product does not care which k meet in which
// MMA step, so the lane's 8 k feed two m16n8k16 steps as they lie, and A and B agree: step s, register j,
// element e hold k = 8q + 4s + 2j + e of the chunk for both operands.
// The copies are cp.async into a ring of kGemvStages chunks per lane in shared memory, each lane reading
// back only what it copied itself (so no barrier): a pass is bound by how many weight bytes are in flight,
// and loads into registers (the first version, 4 chunks per warp, 2 blocks per SM) kept too few of them to
// cover HBM's latency (2.2 TB/s on an H200's 4.8). The ring keeps kGemvStages - 1 chunks in flight per
// warp without registers, 3 blocks per SM on Hopper.
// The warps' accumulators meet in shared memory; a thread per output element adds bias, applies the
// activation and stores. The roundings are the GEMM path's: a gated layer's gate and up products are
// rounded to 16 bits before act(gate) * up (its GEMM writes them to the gate buffer), each output once.
#pragma once
#include <atomic>
#include <type_traits>

constexpr int kGemvWarps = 8;                  // warps per block: 8-way split of K
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvChunk = 32;                 // K per warp step: 4 lanes x 8 k
constexpr int kGemvStages = 4;                 // the ring's chunks per warp: kGemvStages - 1 in flight
constexpr int kGemvTileCols = 8;               // an m16n8k16 tile's columns
// The ring: [warp][stage][item][lane] 16 bytes, items A row g, A row g + 8, weight tile 0, weight tile 1
// (lane-consecutive: conflict-free). 64 KiB: dynamic shared memory, opted in per device.
constexpr int kGemvItems = 4;
constexpr int kGemvSmemBytes = kGemvWarps * kGemvStages * kGemvItems * 32 * 16;
static_assert(kGemvRows >= 1 && kGemvRows <= 16, "one m16 tile of rows");

// v rounded to the compute type (round to nearest even), as a float: what a 16-bit tensor of the GEMM
// path holds.
__device__ __forceinline__ float gemv_round(float v) {
  if constexpr (std::is_same<elem_raw, __half>::value) return __half2float(__float2half_rn(v));
  else return __bfloat162float(__float2bfloat16_rn(v));
}

// 16 bytes global -> shared, asynchronously; zeros where !ok (nothing is read then). Weights (kCached
// false) skip L1, read once; activation rows stay in L1 for the block's other warps.
template <bool kCached>
__device__ __forceinline__ void gemv_copy(uint4* dst, const elem_t* src, bool ok) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int bytes = ok ? 16 : 0;
  if constexpr (kCached)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(src), "r"(bytes) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void gemv_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void gemv_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory"); }
__device__ __forceinline__ uint4 gemv_read(const uint4* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))) : "memory");
  return v;
}

// acc += A (16 x 16, rows a01 (row g) and a23 (row g + 8) as two registers each) * B (16 x 8), fp32.
__device__ __forceinline__ void gemv_mma(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<elem_raw, __half>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// One layer on m <= kGemvRows rows: a [m][lda] in the compute type (rows 16-byte aligned, lda a multiple
// of 8, columns [0, kp) real or zero padding), w [*][kp] n-major (kp a multiple of 8).
// kGated = false: d[r][c] = act(a[r] . w[c] + bias[c]) for c < columns.
// kGated = true: d[r][c] = act(g) * u, g = a[r] . w[c] + bias[c], u = a[r] . w[second + c] + bias[second + c],
// both rounded to the compute type first. kIntoOutput (a block's last layer): d[r][c] = act(a[r] . w[c] +
// d[r][c]), d holding x + bias already (the residual). d rows are ldd apart.
template <template <typename> class Act, bool kGated, bool kIntoOutput, typename Out>
__global__ void __launch_bounds__(kGemvThreads)
gemv_layer(const elem_t* __restrict__ a, int lda, const elem_t* __restrict__ w, int kp, int second,
           const Out* __restrict__ bias, Out* __restrict__ d, int ldd, int columns, int m) {
  __shared__ float partial[kGemvWarps][2][4][32];   // [warp][tile][accumulator][lane]: conflict-free
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane / 4, q = lane % 4;
  // The two tiles' first output columns and the weight rows lane g streams.
  const int base = kGated ? blockIdx.x * kGemvTileCols : blockIdx.x * 2 * kGemvTileCols;
  auto tile_col = [&](int t) { return kGated ? base : base + t * kGemvTileCols; };
  const elem_t* wcol[2];
  bool wok[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int c = tile_col(t) + g;
    wok[t] = c < columns;
    wcol[t] = w + static_cast<int64_t>(wok[t] ? c + (kGated ? t * second : 0) : 0) * kp;
  }
  const elem_t* row_lo = a + static_cast<int64_t>(g) * lda;        // row g
  const elem_t* row_hi = a + static_cast<int64_t>(g + 8) * lda;    // row g + 8
  const bool lo_ok = g < m, hi_ok = g + 8 < m, hi_any = m > 8;     // hi_any: warp-uniform

  extern __shared__ uint4 gemv_ring[];
  uint4* ring = gemv_ring + warp * kGemvStages * kGemvItems * 32 + lane;
  const int chunks = (kp + kGemvChunk - 1) / kGemvChunk;
  const int mine = chunks > warp ? (chunks - warp + kGemvWarps - 1) / kGemvWarps : 0;   // this warp's chunks
  // This warp's i-th chunk into stage i % kGemvStages; past the last one, an empty group (the waits count
  // groups). kp is a multiple of 8: a lane's 8 k are all in or all out.
  auto issue = [&](int i) {
    if (i < mine) {
      const int k = (warp + i * kGemvWarps) * kGemvChunk + 8 * q;
      const bool kok = k < kp;
      uint4* slot = ring + (i % kGemvStages) * kGemvItems * 32;
      gemv_copy<true>(slot, kok && lo_ok ? row_lo + k : a, kok && lo_ok);
      if (hi_any) gemv_copy<true>(slot + 32, kok && hi_ok ? row_hi + k : a, kok && hi_ok);
#pragma unroll
      for (int t = 0; t < 2; ++t)
        gemv_copy<false>(slot + (2 + t) * 32, kok && wok[t] ? wcol[t] + k : w, kok && wok[t]);
    }
    gemv_commit();
  };

  float acc[2][4] = {};
#pragma unroll
  for (int i = 0; i < kGemvStages - 1; ++i) issue(i);
  for (int i = 0; i < mine; ++i) {
    issue(i + kGemvStages - 1);        // refills the stage chunk i - 1 left (read into registers already)
    gemv_wait<kGemvStages - 1>();      // chunk i's group is complete
    const uint4* slot = ring + (i % kGemvStages) * kGemvItems * 32;
    const uint4 alo = gemv_read(slot), ahi = hi_any ? gemv_read(slot + 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint4 b = gemv_read(slot + (2 + t) * 32);
      gemv_mma(acc[t], alo.x, ahi.x, alo.y, ahi.y, b.x, b.y);   // k 8q + 0..3
      gemv_mma(acc[t], alo.z, ahi.z, alo.w, ahi.w, b.z, b.w);   // k 8q + 4..7
    }
  }
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][t][i][lane] = acc[t][i];
  __syncthreads();

  // Accumulator i of lane l holds row l / 4 + 8 (i / 2), column 2 (l % 4) + i % 2 of its tile.
  const Act<float> act;
  const int e = threadIdx.x;              // one (tile, accumulator, lane) each: 2 x 4 x 32 = kGemvThreads
  const int t = e / 128, i = (e / 32) % 4, l = e % 32;
  if (kGated && t == 1) return;           // the up tile is read by the gate tile's thread
  const int row = l / 4 + 8 * (i / 2), col = tile_col(t) + 2 * (l % 4) + i % 2;
  if (row >= m || col >= columns) return;
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int ww = 0; ww < kGemvWarps; ++ww) {
    sum[0] += partial[ww][t][i][l];
    if constexpr (kGated) sum[1] += partial[ww][1][i][l];
  }
  Out* out = d + static_cast<int64_t>(row) * ldd + col;
  if constexpr (kGated) {
    const float gate = gemv_round(sum[0] + static_cast<float>(bias[col]));
    const float up = gemv_round(sum[1] + static_cast<float>(bias[second + col]));
    *out = Out(__fmul_rn(act(gate), up));
  } else {
    *out = Out(act(sum[0] + static_cast<float>(kIntoOutput ? *out : bias[col])));
  }
}

// Launches one layer: `columns` outputs (NP, or a gated layer's NP gate and up pairs), a block per 16
// (gated: 8 pairs).
template <template <typename> class Act, bool kGated, bool kIntoOutput = false, typename Out>
cudaError_t gemv(const DeviceInfo& dev, int m, const elem_t* a, int lda, const elem_t* w, int kp, int second,
                 const Out* bias, Out* d, int ldd, int columns, cudaStream_t s) {
  const int per_block = kGated ? kGemvTileCols : 2 * kGemvTileCols;
  const int blocks = (columns + per_block - 1) / per_block;
  auto kernel = gemv_layer<Act, kGated, kIntoOutput, Out>;
  // The ring is over 48 KiB: opted in once a device.
  static std::atomic<unsigned long long> opted{0};
  if (const cudaError_t err = o2f_wide::smem_opt_in_once(kernel, kGemvSmemBytes, dev.id, opted)) return err;
  kernel<<<blocks, kGemvThreads, kGemvSmemBytes, s>>>(a, lda, w, kp, second, bias, d, ldd, columns, m);
  return cudaGetLastError();
}
