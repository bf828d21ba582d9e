// o2f_wgmma.cuh: the wgmma design's device helpers (templates/cuda_wgmma.cu.j2): bulk-copy PTX (mbarriers
// and wgmma group control: o2f_sm90_ptx.cuh), fragment packing, streaming input loads and output stores of io_t.
// Static device code for sm_90a only (included under O2F_WGMMA_DEVICE), inside the generated source's
// anonymous namespace, after io_t.
#pragma once
#include "o2f_sm90_ptx.cuh"
#include "o2f_cp_async.cuh"   // commit and wait of the staged input's cp.async copies
// (bulk_g2s, fence_frag, wdesc: o2f_sm90_ptx.cuh)
// Two fp32 values -> one register of the chain's operand type (fp16x2, kBf16: bf16x2), the first (lower
// column) in the low half, as A fragments want.
__device__ __forceinline__ uint32_t pack_ab2(float lo, float hi) {
  uint32_t r;
  if constexpr (kBf16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Streaming accesses: the input is read once (fp32 rows: no L1 allocation), the output written once.
__device__ __forceinline__ float2 o2f_ld2(const float* p) {
  float2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}
// fp16 rows, as raw bits (the packed input path takes a pair as an A register as it is): a k-step's two
// loads per row (columns 2t.. and 2t+8..) are the two halves of one 32-byte sector, so the line is kept
// in L1 for the second (no_allocate fetched every sector twice from L2). (void*: also named, never
// called, for fp32 rows.)
__device__ __forceinline__ uint32_t o2f_ld2_raw(const void* p) {
  uint32_t r;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t o2f_ld1_raw(const void* p) {
  unsigned short r;
  asm volatile("ld.global.nc.L1::no_allocate.b16 %0, [%1];\n" : "=h"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ float2 o2f_ld2(const __half* p) {
  const uint32_t r = o2f_ld2_raw(p);
  return __half22float2(*reinterpret_cast<const __half2*>(&r));
}
__device__ __forceinline__ float o2f_ld1(const float* p) {
  float v;
  asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float o2f_ld1(const __half* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(o2f_ld1_raw(p))));
}
// Outputs are streamed (evict-first in L2: read by the next op, not by this kernel); O2F_DIAG_STORE_WB, a
// diagnostic build, stores with the default policy instead.
#ifdef O2F_DIAG_STORE_WB
#define O2F_ST_HINT ""
#else
#define O2F_ST_HINT ".cs"
#endif
// The output stores order memory ("memory" clobber): no load moves across one. O2F_DIAG_ST_FREE, a diagnostic
// build, lets the compiler move loads (x's residual, the bias in shared memory) ahead of them.
#ifdef O2F_DIAG_ST_FREE
#define O2F_ST_ORDER
#else
#define O2F_ST_ORDER : "memory"
#endif
__device__ __forceinline__ void o2f_st2(float* p, float a, float b) {
  asm volatile("st.global" O2F_ST_HINT ".v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) O2F_ST_ORDER);
}
__device__ __forceinline__ void o2f_st2(__half* p, float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  asm volatile("st.global" O2F_ST_HINT ".b32 [%0], %1;\n" ::"l"(p), "r"(*reinterpret_cast<uint32_t*>(&h)) O2F_ST_ORDER);
}
__device__ __forceinline__ void o2f_st1(float* p, float a) { asm volatile("st.global" O2F_ST_HINT ".f32 [%0], %1;\n" ::"l"(p), "f"(a) O2F_ST_ORDER); }
__device__ __forceinline__ void o2f_st1(__half* p, float a) {
  asm volatile("st.global" O2F_ST_HINT ".b16 [%0], %1;\n" ::"l"(p), "h"(__half_as_ushort(__float2half_rn(a))) O2F_ST_ORDER);
}

// fp16 rows into fp16 operands: a loaded pair already is the A fragment's register (converting to fp32
// and back gives the same bits), so the input stays packed: half the registers, no conversions.
constexpr bool kInPacked = std::is_same<io_t, __half>::value && !kBf16;
using in_t = std::conditional_t<kInPacked, uint32_t, float>;
constexpr int kInRegs = kInPacked ? 4 : 8;   // one k-step's input values for a thread's two rows

// The input values of k-step ks for rows r0 and r0 + 8 in the A-fragment pattern: (r0, c..c+1),
// (r0+8, c..c+1), (r0, c+8..c+9), (r0+8, c+8..c+9), c = 16 ks + t2: eight floats, or (kInPacked) the
// four fp16 pairs. Zeros past the batch and past K0. `vec`: x is aligned to two elements (pairs are
// loaded as one access when K0 is even).
template <int K0>
__device__ __forceinline__ void load_ks(in_t (&v)[kInRegs], const io_t* __restrict__ x, int64_t rows, int64_t r0, int ks,
                                        int t2, int vec) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t r = r0 + 8 * (q & 1);
    const int col = 16 * ks + t2 + 8 * (q >> 1);
    if constexpr (kInPacked) {
      uint32_t w = 0u;
      if (r < rows) {
        const io_t* p = x + r * K0 + col;
        if (K0 % 2 == 0 && vec) {
          if (K0 % 16 == 0 || col < K0) w = o2f_ld2_raw(p);
        } else {
          if (col < K0) w = o2f_ld1_raw(p);
          if (col + 1 < K0) w |= o2f_ld1_raw(p + 1) << 16;
        }
      }
      v[q] = w;
    } else {
      float2 w = make_float2(0.0f, 0.0f);
      if (r < rows) {
        const io_t* p = x + r * K0 + col;
        if (K0 % 2 == 0 && vec) {
          if (K0 % 16 == 0 || col < K0) w = o2f_ld2(p);
        } else {
          if (col < K0) w.x = o2f_ld1(p);
          if (col + 1 < K0) w.y = o2f_ld1(p + 1);
        }
      }
      v[2 * q] = w.x;
      v[2 * q + 1] = w.y;
    }
  }
}
__device__ __forceinline__ void to_a(uint32_t (&a)[4], const float (&v)[8]) {
  a[0] = pack_ab2(v[0], v[1]);
  a[1] = pack_ab2(v[2], v[3]);
  a[2] = pack_ab2(v[4], v[5]);
  a[3] = pack_ab2(v[6], v[7]);
}
__device__ __forceinline__ void to_a(uint32_t (&a)[4], const uint32_t (&v)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = v[i];
}

// Staged input (plan/wgmma.py, STAGED_INPUT): a warpgroup's 64-row tile of fp32 rows, columns C0..C0+KS-1
// (C0: the k-steps prefetched into registers), in its shared-memory buffer, each row's 16-byte chunks
// XOR-swizzled by the row (the 8 rows of a warp's A-fragment read fall in different banks). stage_tile
// copies the tile whose first row is first_row (cp.async, 16 bytes a copy; zeros past the batch and past
// K0, K0 % 4 == 0), staged_ks reads the A fragments of the tile's k-step ks (counted from C0).
template <int KS>
__device__ __forceinline__ uint32_t staged_offset(int row, int chunk) {
  constexpr int kChunks = KS / 4;
  constexpr int kSwizzle = (kChunks % 8 == 0 ? 8 : 4) - 1;   // within the row (kChunks: a multiple of 4)
  return static_cast<uint32_t>(row * KS * 4 + (chunk ^ (row & kSwizzle)) * 16);
}
template <int K0, int C0, int KS>
__device__ __forceinline__ void stage_tile(uint32_t buf, const float* __restrict__ x, int64_t rows, int64_t first_row,
                                           int tid_wg) {
  constexpr int kChunks = KS / 4;
  static_assert(K0 % 4 == 0 && KS % 16 == 0, "whole 16-byte chunks, as many for every thread");
#ifdef O2F_DIAG_NO_LOAD   // a diagnostic build (kernel_check.py --diag): the tile computed from stale bytes
  return;
#endif
#pragma unroll 1   // (unrolled, ptxas held every copy's address at once: silu spilled)
  for (int i = 0; i < 64 * kChunks / 128; ++i) {
    const int j = tid_wg + 128 * i;
    const int row = j / kChunks, chunk = j % kChunks;
    const int64_t r = first_row + row;
    const int col = C0 + 4 * chunk;
    const bool in = r < rows && col < K0;
    const float* src = in ? x + r * K0 + col : x;   // src-size 0: sixteen zero bytes, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(buf + staged_offset<KS>(row, chunk)), "l"(src),
                 "r"(in ? 16 : 0) : "memory");
  }
  cp_async_commit();
}
// k-step ks's A fragments of rows rin and rin + 8 from a staged fp32 tile, value (row, col) at shared
// address addr(row, col): (row, c..c+1) with c = 16 ks + t2 and c + 8, as load_ks's pattern, rounded to
// the operand type.
template <class Addr>
__device__ __forceinline__ void staged_frags(uint32_t (&a)[4], int rin, int ks, int t2, Addr addr) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int row = rin + 8 * (q & 1);
    const int col = 16 * ks + t2 + 8 * (q >> 1);
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr(row, col)) : "memory");
    a[q] = pack_ab2(v.x, v.y);
  }
}
// Bulk-staged input (plan/wgmma.py, BULK_INPUT): the same tile's rows, each copied by one cp.async.bulk
// (columns C0..K0-1, K0 % 4 == 0: whole 16-byte units) into a row RB bytes long (KS * 4 +
// plan.wgmma.BULK_ROW_PAD: an A-fragment read's 8 rows in distinct banks), unswizzled; its
// columns K0..C0+KS-1 (padding to the k-step) are zeroed once by bulk_zero_pad, copies never write them.
// Warpgroup thread 0 arms the tile's mbarrier for every row's bytes (a row's copy may land before that:
// the phase cannot complete without the arming arrival); rows past the batch are not copied (stale
// values, whose output rows are never stored).
// Rows R0..R1-1 of the tile (plan.wgmma input_parts: a tile's copies spread over its pass's first
// chunks); ARM: the first part, whose thread 0 arms the barrier for the whole tile.
template <int K0, int C0, int RB, int R0 = 0, int R1 = 64, bool ARM = true>
__device__ __forceinline__ void bulk_stage_tile(uint32_t buf, uint32_t bar, const float* __restrict__ x, int64_t rows,
                                                int64_t first_row, int tid_wg) {
  constexpr uint32_t kBytes = K0 > C0 ? (K0 - C0) * 4 : 0;
  static_assert(K0 % 4 == 0 && RB % 16 == 0, "whole 16-byte units");
  const int64_t left = rows - first_row;
  const int n = left <= 0 ? 0 : left < 64 ? static_cast<int>(left) : 64;
#ifdef O2F_DIAG_NO_LOAD   // a diagnostic build (kernel_check.py --diag): the tile computed from stale bytes
  if (ARM && tid_wg == 0) mbar_arrive(bar);
  return;
#endif
  if (ARM && tid_wg == 0) mbar_expect_tx(bar, n * kBytes);
  if (kBytes > 0 && tid_wg >= R0 && tid_wg < R1 && tid_wg < n)
    bulk_g2s(buf + tid_wg * RB, x + (first_row + tid_wg) * K0 + C0, kBytes, bar);
}
template <int K0, int C0, int KS, int RB>
__device__ __forceinline__ void bulk_zero_pad(unsigned char* buf, int tid_wg) {
  constexpr int kFrom = K0 > C0 ? K0 - C0 : 0, kPad = KS > kFrom ? KS - kFrom : 1;
  if constexpr (KS > kFrom) {
    for (int i = tid_wg; i < 64 * kPad; i += 128)
      reinterpret_cast<float*>(buf + (i / kPad) * RB)[kFrom + i % kPad] = 0.0f;
  }
}
template <int RB>
__device__ __forceinline__ void bulk_staged_ks(uint32_t (&a)[4], uint32_t buf, int rin, int ks, int t2) {
  staged_frags(a, rin, ks, t2, [=](int row, int col) { return buf + row * RB + col * 4; });
}
// The same values unconverted (fp32, load_ks's pattern: v[2q], v[2q + 1] are the pair q of staged_frags):
// a norm's input (o2f_wgmma_norm.cuh).
template <int RB>
__device__ __forceinline__ void bulk_staged_vals(float (&v)[8], uint32_t buf, int rin, int ks, int t2) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t addr = buf + (rin + 8 * (q & 1)) * RB + (16 * ks + t2 + 8 * (q >> 1)) * 4;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v[2 * q]), "=f"(v[2 * q + 1]) : "r"(addr) : "memory");
  }
}
// The 128 threads of warpgroup wg (named barrier 1 + wg; barrier 0 is __syncthreads').
__device__ __forceinline__ void wg_sync(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); }
// k-step ks's A fragments for rows rin and rin + 8 of the swizzled staged tile (staged_frags).
template <int KS>
__device__ __forceinline__ void staged_ks(uint32_t (&a)[4], uint32_t buf, int rin, int ks, int t2) {
  staged_frags(a, rin, ks, t2, [=](int row, int col) { return buf + staged_offset<KS>(row, col / 4) + (col % 4) * 4; });
}

__device__ __forceinline__ void o2f_st4(float* p, float a, float b, float c, float d) {
  asm volatile("st.global" O2F_ST_HINT ".v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) O2F_ST_ORDER);
}
__device__ __forceinline__ void o2f_st4(__half* p, float a, float b, float c, float d) {
  __half2 h0 = __floats2half2_rn(a, b), h1 = __floats2half2_rn(c, d);
  asm volatile("st.global" O2F_ST_HINT ".v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(*reinterpret_cast<uint32_t*>(&h0)),
               "r"(*reinterpret_cast<uint32_t*>(&h1)) O2F_ST_ORDER);
}
// Row r, columns col and col + 1 of the NO-wide output (only those that exist); vec != 0: y's rows hold
// pairs aligned for one store.
template <int NO>
__device__ __forceinline__ void store_out(io_t* __restrict__ y, int64_t rows, int64_t r, int col, float v0, float v1, int vec) {
  if (r >= rows) return;
#ifdef O2F_DIAG_NO_STORE   // a diagnostic build (kernel_check.py --diag): no stores, the values still computed
  if ((__float_as_uint(v0) ^ __float_as_uint(v1)) != 0x7fc0deadu) return;
#endif
  io_t* p = y + r * NO + col;
  if (NO % 2 == 0 && vec) {
    if (col < NO) o2f_st2(p, v0, v1);   // col even, NO even: col + 1 < NO too
  } else {
    if (col < NO) o2f_st1(p, v0);
    if (col + 1 < NO) o2f_st1(p + 1, v1);
  }
}
// STORE_ROWS: columns col..col + 3 of a row at p (the row's pointer plus the quad's first column), where
// the row is in the batch (`in`) and, in a quad running past the width (kPartial), col is in it (NO % 4
// == 0: then all 4 are). y's rows hold aligned quads (the launch checks y).
template <bool kPartial, int NO>
__device__ __forceinline__ void store_row4(io_t* p, bool in, int col, float v0, float v1, float v2, float v3) {
  if (!in || (kPartial && col >= NO)) return;
#ifdef O2F_DIAG_NO_STORE
  if ((__float_as_uint(v0) ^ __float_as_uint(v1) ^ __float_as_uint(v2) ^ __float_as_uint(v3)) != 0x7fc0deadu) return;
#endif
  o2f_st4(p, v0, v1, v2, v3);
}
// Columns col..col + 3 (col % 4 == 0): one store where NO % 4 == 0 and vec == 2 (y's rows hold aligned
// quads), else as two pairs.
template <int NO>
__device__ __forceinline__ void store_out4(io_t* __restrict__ y, int64_t rows, int64_t r, int col, float v0, float v1,
                                           float v2, float v3, int vec) {
  if (NO % 4 == 0 && vec == 2) {
    if (r >= rows) return;
#ifdef O2F_DIAG_NO_STORE
    if ((__float_as_uint(v0) ^ __float_as_uint(v1) ^ __float_as_uint(v2) ^ __float_as_uint(v3)) != 0x7fc0deadu) return;
#endif
    if (col < NO) o2f_st4(y + r * NO + col, v0, v1, v2, v3);
  } else {
    store_out<NO>(y, rows, r, col, v0, v1, vec);
    store_out<NO>(y, rows, r, col + 2, v2, v3, vec);
  }
}
