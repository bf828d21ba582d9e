// o2f_light_gemm.cuh: the wide design's Hopper GEMM without CUTLASS (plan.sm90's Light128x128): TMA loads,
// wgmma, ping-pong consumers, a TMA-store epilogue. A unit that runs it compiles in seconds where a
// CUTLASS 3.x instance takes 35-40 s (docs/DESIGN.md, "A Hopper GEMM of our own"; the prototype and its
// measurements: benchmarks/sm90/light_gemm.cu, RESULTS.md eighteenth and nineteenth runs; Nsight Compute
// beside cuBLAS: benchmarks/sm90/light_ncu.sh).
//
//   D[m, n] = PairAct(A[m, K] W^T + bias[n] (+ C[m, n]))   A row-major (row stride k), W n-major ([n][k]),
//   Elem operands (fp16 or bf16; fp32 read as tf32), fp32 accumulation, bias, C (the residual: kResidual)
//   and D of type Out.
// kGated (a gated layer: SwiGLU, GeGLU): W holds 2n rows, the gate products' n then the up products' n,
// and the kernel writes the hidden rows D[m, j] = act(g_j) * u_j, with g_j and u_j the gate and up
// products plus their bias, each rounded to Out first (the numbers the separate GEMM + glu pass computed:
// stock ORT's fp16 model rounds its two MatMuls' outputs too), the product in fp32 and rounded once. Its
// tiles are 128 x 64 outputs: a W stage holds 64 gate rows and the 64 up rows of the same columns (two
// TMA boxes), so a thread's accumulators hold both products of each of its columns, and neither the 2n
// products nor a glu pass ever touch memory.
//
// Static code included inside a kernel instance unit's namespace (templates/cuda_wide_light.cu.j2),
// after <cuda.h>, <cudaTypedefs.h>, o2f_wide_launch.cuh and the unit's Elem, Out, kResidual and PairAct
// (float2 PairAct{}(float, float): the activation of two adjacent columns, computed in fp32 or packed; a
// packed one also has `uint32_t packed(float, float)`, its two fp16 results' bits: PackedStore).
//
// The kernel: a CTA is three warpgroups (384 threads), persistent; its tiles (128 x 128 outputs) are
// blockIdx.x, + gridDim.x, ..., taken in turn by the two consumer warpgroups. Warpgroup 0 produces: one
// thread issues, tile after tile, the TMA copies (128-byte swizzle) of each k-block's A and W tiles (128
// rows of 128 bytes each, 32 KB a stage) into one ring of kStages slots, completing on the slot's `full`
// mbarrier. A consumer runs wgmma.m64n128k16 (k8 for tf32) with both operands from shared memory (two
// m64 halves per step) and frees a slot (its `empty` mbarrier, one arrival per warp) once the wgmma group
// that read it completed.
// The consumers' mainloops take turns (two `turn` mbarriers): one hands the turn over once it has issued
// its last k-block, and its epilogue then runs while the other's mainloop keeps the tensor cores busy
// (CUTLASS's Pingpong schedule). The epilogue goes through swizzled 64-row staging boxes per consumer
// (Layout): TMA loads C there during the mainloop, the epilogue reads it and writes D in its place, and
// TMA stores clip the tails (the direct stores of a quad wrote 16 of each 32-byte sector: 1.5x slower on
// ViT-B's first GEMM; an fp32 D's float2 stores, a whole sector each, still made the FFN case 18% slower
// through ORT than CUTLASS's TMA-store epilogue).
#pragma once
#include "o2f_sm90_ptx.cuh"

namespace o2f_light {
// A k-block is 128 bytes of each operand row (the 128-byte swizzle's width): 64 fp16/bf16 columns, or 32
// fp32 ones read as tf32; a wgmma step is 32 bytes of it (k16, or k8 for tf32).
constexpr int kBM = 128, kBN = 128, kRowBytes = 128, kConsumers = 2, kThreads = 128 * (1 + kConsumers);
constexpr int kABytes = kBM * kRowBytes, kWBytes = kBN * kRowBytes;
template <typename Elem>
constexpr int kBK = kRowBytes / static_cast<int>(sizeof(Elem));
constexpr int kBoxBytes = 64 * 128;   // a staging box: 64 rows of 128 bytes (64 16-bit or 32 fp32 columns)

// The shared-memory layout of one instantiation. D is staged: each consumer owns boxes where TMA loads
// the residual C during the mainloop (kResidual), the epilogue writes D in C's place, and TMA stores them.
// Reading C directly took ViT-B's block 28% longer (its loads, 64 float2 per thread, wait in the epilogue:
// there are no registers to hold them earlier). An fp32 D is staged one m64 half at a time (kHalved: 32 KB
// of boxes per consumer, as a 16-bit tile's): the whole tile's 64 KB per consumer left the ring 3 slots,
// and the down projection of ViT-B's block took 164 us. An fp32 D without C was stored from registers
// (float2 per thread) until the FFN case (16384 x 768 -> 3072 -> 768, fp32 out) took 0.378 ms through ORT
// on an H100 against 0.319 with CUTLASS's TMA-store epilogue, more than ViT-B's whole block with its
// halved staging (0.323).
//
// (A variant with 256 x 128 CTA tiles, both consumers on one tile sharing each W stage, 3 slots, measured
// slower in every case, twice: RESULTS.md nineteenth run; its code is in git history up to commit 9f606dd.)
template <typename Out, bool kResidual, int kTileN = kBN>   // kTileN: output columns a tile (a gated one's 64)
struct Layout {
  static constexpr int kStageBytes = kABytes + kWBytes;
  static constexpr bool kHalved = sizeof(Out) == 4;
  static constexpr int kBoxCols = 128 / static_cast<int>(sizeof(Out));
  static constexpr int kHalfBoxes = kTileN / kBoxCols;        // the column boxes of an m64 half
  static constexpr int kOwnBoxes = kHalved ? kHalfBoxes : 2 * kHalfBoxes;
  static constexpr int kOutBytes = kConsumers * kOwnBoxes * kBoxBytes;
  // as many slots as fit beside the boxes and the barriers, at most 5
  static constexpr int kFit = (227 * 1024 - 1024 - kOutBytes - 256) / kStageBytes;
  static constexpr int kStages = kFit < 5 ? kFit : 5;
  static constexpr int kRingBytes = kStages * kStageBytes;
  // barriers: full and empty per slot, turn and the residual's arrival per consumer
  static constexpr int kSmemBytes = 1024 + kRingBytes + kOutBytes + (2 * kStages + 2 * kConsumers) * 8;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// A box from shared memory to the tensor map's (x, y); rows and columns past its bounds are not written.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int x, int y, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The issuing thread's committed stores have read their shared memory (it may be written again).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// This thread's writes to shared memory, visible to the async proxy (the TMA store that reads them).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The 128 threads of consumer c (barrier 0 is __syncthreads').
__device__ __forceinline__ void consumer_sync(int c) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory"); }

// A K-major tile in the 128-byte swizzled layout TMA writes (rows of 128 bytes, 8-row groups 1024 bytes
// apart): start address >> 4, leading byte offset 1 (unused when swizzled), stride byte offset 1024 >> 4,
// layout SWIZZLE_128B. A k16 step inside the 64-wide tile is +32 bytes on the start address.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// wgmma.m64n128k{16, 8} f32 += Elem x Elem, both operands from shared memory (SS), scale-d a predicate; the
// 16-bit forms take the transpose immediates (none: both K-major), tf32's has none.
#define O2F_LIGHT_WGMMA_SS(SHAPE_TYPES, TAIL)                                                                          \
  asm volatile(                                                                                                          \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                                       \
      "wgmma.mma_async.sync.aligned." SHAPE_TYPES " "                                                                    \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
      "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                      \
      "%64, %65, p, 1, 1" TAIL ";\n}\n"                                                                                 \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),          \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),         \
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),         \
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),         \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),         \
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                       \
      : "l"(desc_a), "l"(desc_w), "r"(scale_d))
template <typename E>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_w, int scale_d) {
  if constexpr (std::is_same_v<E, __half>)
    O2F_LIGHT_WGMMA_SS("m64n128k16.f32.f16.f16", ", 0, 0");
  else if constexpr (std::is_same_v<E, __nv_bfloat16>)
    O2F_LIGHT_WGMMA_SS("m64n128k16.f32.bf16.bf16", ", 0, 0");
  else   // fp32 operands: the tensor cores read their top 19 bits (tf32)
    O2F_LIGHT_WGMMA_SS("m64n128k8.f32.tf32.tf32", "");
}
#undef O2F_LIGHT_WGMMA_SS

__device__ __forceinline__ float2 load_pair(const float* p, bool two) {
  return two ? *reinterpret_cast<const float2*>(p) : make_float2(p[0], 0.f);
}
__device__ __forceinline__ float2 load_pair(const __half* p, bool two) {
  return two ? __half22float2(*reinterpret_cast<const __half2*>(p)) : make_float2(__half2float(p[0]), 0.f);
}
__device__ __forceinline__ float2 load_pair(const __nv_bfloat16* p, bool two) {
  return two ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p)) : make_float2(__bfloat162float(p[0]), 0.f);
}
__device__ __forceinline__ uint32_t pack_pair(__half, float2 v) {
  const __half2 h = __floats2half2_rn(v.x, v.y);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_pair(__nv_bfloat16, float2 v) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A pair of adjacent columns of a staging box, as Out, to and from fp32.
__device__ __forceinline__ float2 lds_pair(float, uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
// A 16-bit pair's bits as fp32 values.
__device__ __forceinline__ float2 unpack_pair(__half, uint32_t u) { return __half22float2(*reinterpret_cast<const __half2*>(&u)); }
__device__ __forceinline__ float2 unpack_pair(__nv_bfloat16, uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
template <typename Out>
__device__ __forceinline__ float2 lds_pair(Out, uint32_t addr) {   // (16-bit Out)
  uint32_t u;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(u) : "r"(addr) : "memory");
  return unpack_pair(Out{}, u);
}
__device__ __forceinline__ void sts_pair(float, uint32_t addr, float2 v) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}
__device__ __forceinline__ void sts_b32(uint32_t addr, uint32_t bits) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(bits) : "memory");
}
template <typename Out>
__device__ __forceinline__ void sts_pair(Out, uint32_t addr, float2 v) {
  sts_b32(addr, pack_pair(Out{}, v));
}

// An activation with a packed fp16x2 form (`uint32_t packed(float, float)`: the two results' fp16 bits) is
// stored as it comes where D is fp16: the fp32 round trip of operator() and the second rounding to fp16
// cost a third of the epilogue's instructions (three conversions per pair).
template <class Act, typename Out, typename = void>
struct PackedStore : std::false_type {};
template <class Act>
struct PackedStore<Act, __half, std::void_t<decltype(Act{}.packed(0.f, 0.f))>> : std::true_type {};

// A pair rounded to Out and back: the value a 16-bit output of it holds.
template <typename Out>
__device__ __forceinline__ float2 rounded_pair(float a, float b) {
  return unpack_pair(Out{}, pack_pair(Out{}, make_float2(a, b)));
}

// A tile's output columns: 128, or 64 of a gated layer (its W tile: their gate and up rows).
template <bool kGated>
constexpr int kTileCols = kGated ? kBN / 2 : kBN;

template <typename Elem, typename Out, class PairAct, bool kResidual, bool kGated>
__global__ void __launch_bounds__(kThreads, 1)
    light_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
               const __grid_constant__ CUtensorMap map_d, const __grid_constant__ CUtensorMap map_c,
               const Out* __restrict__ bias, int m, int n, int k, int n_fastest) {
  static_assert(!kGated || (!kResidual && sizeof(Out) == 2), "a gated layer is hidden: 16-bit D, no residual");
  constexpr int kTileN = kTileCols<kGated>;
  using L = Layout<Out, kResidual, kTileN>;
  constexpr int kStages = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;   // swizzled tiles: 1024-aligned
  const uint32_t staging = base + L::kRingBytes;                  // the ring's size keeps it 1024-aligned
  const uint32_t bars = staging + L::kOutBytes;
  auto stage_a = [&](int s) { return base + static_cast<uint32_t>(s * L::kStageBytes); };
  auto stage_w = [&](int s) { return stage_a(s) + kABytes; };
  auto full = [&](int s) { return bars + static_cast<uint32_t>(s * 8); };
  auto empty = [&](int s) { return bars + static_cast<uint32_t>((kStages + s) * 8); };
  auto turn = [&](int c) { return bars + static_cast<uint32_t>((2 * kStages + c) * 8); };
  auto c_full = [&](int c) { return bars + static_cast<uint32_t>((2 * kStages + kConsumers + c) * 8); };

  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 4);   // one arrival per warp of the consumer that reads the slot
    }
    for (int c = 0; c < kConsumers; ++c) {
      mbar_init(turn(c), 1);
      mbar_init(c_full(c), 1);
    }
    mbar_init_fence();
  }
  __syncthreads();
  // Tile order: across the columns first when A is the larger operand (n_fastest: each row band of A is
  // read from memory once while W stays in the L2), else down the rows.
  const int mt = (m + kBM - 1) / kBM, nt = (n + kTileN - 1) / kTileN, tiles = mt * nt;
  const int kbs = (k + kBK<Elem> - 1) / kBK<Elem>;
  auto origin = [&](int t, int& m0, int& n0) {
    m0 = (n_fastest ? t / nt : t % mt) * kBM;
    n0 = (n_fastest ? t % nt : t / mt) * kTileN;
  };

  if (wg == 0) {   // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (warp == 0 && lane == 0) {
      int s = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int m0, n0;
        origin(t, m0, n0);
        for (int kb = 0; kb < kbs; ++kb) {
          mbar_wait(empty(s), phase ^ 1);
          mbar_expect_tx(full(s), L::kStageBytes);   // out-of-bounds parts are zero-filled and counted
          tma_load_2d(stage_a(s), &map_a, kb * kBK<Elem>, m0, full(s));
          tma_load_2d(stage_w(s), &map_w, kb * kBK<Elem>, n0, full(s));   // (gated: the gate rows n0..)
          // the up rows of the same columns, n + n0.. (a last tile's gate box runs into the first up rows:
          // columns past n, which the TMA store clips; the up box's rows past 2n are zero-filled)
          if constexpr (kGated) tma_load_2d(stage_w(s) + kWBytes / 2, &map_w, kb * kBK<Elem>, n + n0, full(s));
          if (++s == kStages) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1;
  float acc[2][64];
  // Ping-pong: this consumer's i-th tile is the CTA's (2i + c)-th, its k-blocks the ring's from (2i + c) *
  // kbs on.
  const int first = blockIdx.x + c * gridDim.x, step = kConsumers * gridDim.x;
  // slot 0's wgmma descriptors, the mainloop's base (32-bit arithmetic on the low word: its high word is
  // the same constant in every descriptor)
  const uint64_t desc_a0 = desc_sw128(stage_a(0)), desc_w0 = desc_sw128(stage_w(0));
  const uint32_t a_lo = static_cast<uint32_t>(desc_a0), w_lo = static_cast<uint32_t>(desc_w0);
  const uint64_t desc_hi = desc_a0 & 0xFFFFFFFF00000000ull;
  for (int i = 0, t = first; t < tiles; ++i, t += step) {
    int m0, n0;
    origin(t, m0, n0);
    // The bias of this thread's accumulator columns 8f + 2 (lane % 4) (+ 1), loaded before the mainloop's
    // waits: output columns n0 + those, or gated, f < 8 the gate products' and f >= 8 the up products' of
    // output columns n0 + 8 (f - 8) + ... (bias index n + that).
    auto out_col = [&](int f) { return n0 + 8 * (kGated ? f % 8 : f) + 2 * (lane % 4); };
    auto bias_at = [&](int f) { return bias + (kGated && f >= 8 ? n : 0) + out_col(f); };
    float2 bias_r[kBN / 8];
    if (n0 + kTileN <= n && n % 2 == 0) {   // a whole column tile: every pair there, aligned (no branches)
#pragma unroll
      for (int f = 0; f < kBN / 8; ++f) bias_r[f] = load_pair(bias_at(f), true);
    } else {
#pragma unroll
      for (int f = 0; f < kBN / 8; ++f) {
        const int col = out_col(f);
        bias_r[f] = col < n ? load_pair(bias_at(f), col + 1 < n) : make_float2(0.f, 0.f);
      }
    }
    const uint32_t out = staging + c * (L::kOutBytes / kConsumers);   // this consumer's boxes
    // The boxes of m64 halves [h0, h0 + halves) of this tile: C into them (completing on c_full), D out.
    // Box q holds columns n0 + (q % kHalfBoxes) kBoxCols.. of rows m0 + 64 (h0 + q / kHalfBoxes)..
    auto box_x = [&](int q) { return n0 + (q % L::kHalfBoxes) * L::kBoxCols; };
    auto box_y = [&](int q, int h0) { return m0 + 64 * (h0 + q / L::kHalfBoxes); };
    auto load_c = [&](int h0, int halves) {
      mbar_expect_tx(c_full(c), halves * L::kHalfBoxes * kBoxBytes);
      for (int q = 0; q < halves * L::kHalfBoxes; ++q) tma_load_2d(out + q * kBoxBytes, &map_c, box_x(q), box_y(q, h0), c_full(c));
    };
    auto store_d = [&](int h0, int halves) {
      for (int q = 0; q < halves * L::kHalfBoxes; ++q) tma_store_2d(&map_d, box_x(q), box_y(q, h0), out + q * kBoxBytes);
      bulk_commit();
    };
    if (threadIdx.x % 128 == 0) {
      bulk_wait_read();   // the previous tile's stores have read the boxes
      if constexpr (kResidual) load_c(0, L::kHalved ? 1 : 2);   // arriving during the mainloop
    }
    // Consumer 0's i-th mainloop follows consumer 1's (i-1)-th (i completions of turn(0); the first passes
    // on a fresh barrier); consumer 1's i-th follows consumer 0's i-th (i + 1 completions of turn(1)).
    mbar_wait(turn(c), c == 0 ? (i & 1) ^ 1 : i & 1);
    // The ring position of this tile's first k-block, then advanced one slot at a time (no division in
    // the loop). The wgmma descriptors are slot 0's plus constants: a descriptor's low 14 bits are the
    // address / 16 (below 2^18: no carry out), so a byte offset b is + b / 16. Computing each descriptor
    // from its address took 123 instructions a k-block to issue 8 wgmma, while the tensor cores had
    // only the previous k-block's 8 queued (the other consumer issues nothing during these turns).
    const uint32_t start = static_cast<uint32_t>((kConsumers * i + c) * kbs);
    int s = static_cast<int>(start % kStages);
    uint32_t phase = (start / kStages) & 1;
    int prev = 0;
    for (int kb = 0; kb < kbs; ++kb) {
      mbar_wait(full(s), phase);
      wgmma_fence();
      const uint32_t slot = static_cast<uint32_t>(s) * (L::kStageBytes / 16);
#pragma unroll
      for (int j = 0; j < kRowBytes / 32; ++j) {   // 32 bytes of each row a step
        const uint64_t dw = desc_hi | (w_lo + slot + 2 * j);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wgmma_ss<Elem>(acc[h], desc_hi | (a_lo + slot + (h * 64 * 128 + 32 * j) / 16), dw, kb > 0 || j > 0);
      }
      wgmma_commit();
      if (kb > 0) {
        wgmma_wait<1>();   // the previous k-block's group has read its slot
        if (lane == 0) mbar_arrive(empty(prev));
      }
      prev = s;
      if (++s == kStages) {
        s = 0;
        phase ^= 1;
      }
    }
    if (threadIdx.x % 128 == 0) mbar_arrive(turn(1 - c));   // all issued: the other consumer's turn
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(empty(prev));
    fence_acc(acc[0]);
    fence_acc(acc[1]);

    // Epilogue. Thread (warp, lane) holds rows warp*16 + lane/4 (+8) of each m64 half h and columns
    // t = 8f + 2 (lane % 4) (+1), f < 16: staged, in box (h, t / kBoxCols), 16-byte chunk (t % kBoxCols) /
    // kPerChunk of its 128-byte row, which the 128-byte swizzle moves to chunk ^ (row % 8): the eight rows
    // of one access land in different banks.
    // (c_full completes once per tile, or twice where halved: the h-th load of a tile has parity h)
    if constexpr (kResidual) mbar_wait(c_full(c), L::kHalved ? 0 : i & 1);   // C is in the boxes
    consumer_sync(c);   // (thread 0 waited for the previous stores before any thread writes)
    constexpr int kPerChunk = 16 / static_cast<int>(sizeof(Out));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (L::kHalved) {
        if (h == 1) {   // half 0 out, then (C's half 1 into) the same boxes
          fence_async_smem();
          consumer_sync(c);
          if (threadIdx.x % 128 == 0) {
            store_d(0, 1);
            bulk_wait_read();
            if constexpr (kResidual) load_c(1, 1);
          }
          if constexpr (kResidual) mbar_wait(c_full(c), 1);
          else consumer_sync(c);   // the stores have read the boxes
        }
      }
      const int row = warp * 16 + lane / 4;
      if constexpr (kGated) {   // output column t = 8f + 2 (lane % 4) from accumulator pairs f (gate), f + 8 (up)
#pragma unroll
        for (int f = 0; f < kBN / 16; ++f) {
          const int t = 8 * f + 2 * (lane % 4);
          const uint32_t box = out + h * kBoxBytes;   // one box of 64 columns an m64 half
          const uint32_t word = ((t / kPerChunk) ^ (row % 8)) * 16 + (t % kPerChunk) * static_cast<int>(sizeof(Out));
#pragma unroll
          for (int r = 0; r < 2; ++r) {   // rows `row` and row + 8: accumulators 4f + 2r (+ 1)
            const float2 g = rounded_pair<Out>(acc[h][4 * f + 2 * r] + bias_r[f].x, acc[h][4 * f + 2 * r + 1] + bias_r[f].y);
            const float2 u = rounded_pair<Out>(acc[h][4 * (f + 8) + 2 * r] + bias_r[f + 8].x,
                                               acc[h][4 * (f + 8) + 2 * r + 1] + bias_r[f + 8].y);
            sts_pair(Out{}, box + (row + 8 * r) * 128 + word,
                     make_float2(__fmul_rn(PairAct::act(g.x), u.x), __fmul_rn(PairAct::act(g.y), u.y)));
          }
        }
      } else {
#pragma unroll
        for (int f = 0; f < kBN / 8; ++f) {
          const int t = 8 * f + 2 * (lane % 4);
          const int cb = t % L::kBoxCols;
          const uint32_t box = out + ((L::kHalved ? 0 : h * L::kHalfBoxes) + t / L::kBoxCols) * kBoxBytes;
          const uint32_t word = ((cb / kPerChunk) ^ (row % 8)) * 16 + (cb % kPerChunk) * static_cast<int>(sizeof(Out));
          const uint32_t at_lo = box + row * 128 + word, at_hi = box + (row + 8) * 128 + word;   // (row + 8) % 8 == row % 8
          float2 lo = make_float2(acc[h][4 * f] + bias_r[f].x, acc[h][4 * f + 1] + bias_r[f].y);
          float2 hi = make_float2(acc[h][4 * f + 2] + bias_r[f].x, acc[h][4 * f + 3] + bias_r[f].y);
          if constexpr (kResidual) {   // the block's input rows (zeros past the tails)
            const float2 xl = lds_pair(Out{}, at_lo), xh = lds_pair(Out{}, at_hi);
            lo.x += xl.x;
            lo.y += xl.y;
            hi.x += xh.x;
            hi.y += xh.y;
          }
          if constexpr (PackedStore<PairAct, Out>::value) {
            sts_b32(at_lo, PairAct{}.packed(lo.x, lo.y));
            sts_b32(at_hi, PairAct{}.packed(hi.x, hi.y));
          } else {
            sts_pair(Out{}, at_lo, PairAct{}(lo.x, lo.y));
            sts_pair(Out{}, at_hi, PairAct{}(hi.x, hi.y));
          }
        }
      }
    }
    fence_async_smem();
    consumer_sync(c);
    if (threadIdx.x % 128 == 0) store_d(L::kHalved ? 1 : 0, L::kHalved ? 1 : 2);
  }
  if (threadIdx.x % 128 == 0) bulk_wait_read();   // the last stores have read the boxes before the CTA leaves
}

// ---- host ----
template <typename T>
constexpr CUtensorMapDataType tma_type() {
  if constexpr (std::is_same_v<T, __half>) return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  else return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

// The driver's cuTensorMapEncodeTiled through the runtime (the library links no libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
    return e == cudaSuccess && q == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p)
                                                                 : nullptr;
  }();
  return fn;
}

// A row-major [rows][cols] matrix (row stride ld elements), boxes of box_rows x (128 bytes of T), 128-byte
// swizzle; false where the driver refuses it (TMA needs 16-byte aligned rows and base).
template <typename T>
bool tile_map(CUtensorMap* map, const void* p, int rows, int cols, int64_t ld, int box_rows) {
  const auto encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * sizeof(T)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / sizeof(T)), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return encode(map, tma_type<T>(), 2, const_cast<void*>(p), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Everything a launch's tensor maps depend on.
struct MapKey {
  int dev = -1, m = 0, n = 0, k = 0, ldd = 0;
  const void* a = nullptr;
  const void* w = nullptr;
  const void* src = nullptr;
  const void* d = nullptr;
  bool operator==(const MapKey& o) const {
    return dev == o.dev && m == o.m && n == o.n && k == o.k && ldd == o.ldd && a == o.a && w == o.w && src == o.src &&
           d == o.d;
  }
};

// The tensor maps of one launch.
struct Maps {
  MapKey key;   // dev -1: not built
  CUtensorMap a, w, d, c;
};

// How many launches' tensor maps each kernel instance keeps a thread: every GEMM of a model that shares the
// instance (ViT's 12 blocks, LLaMA-7B's 32 layers) keeps its own, where one slot rebuilt the maps (four
// encodes) and the shared-memory attribute at each call as the layers took turns.
constexpr int kMapSlots = 64;

// The slot holding `key`'s maps on this thread, or the oldest slot, its key reset (the caller builds it).
inline Maps* find_maps(Maps (&slots)[kMapSlots], int& next, const MapKey& key, bool* hit) {
  for (Maps& m : slots)
    if (m.key == key) {
      *hit = true;
      return &m;
    }
  Maps* m = &slots[next];
  next = (next + 1) % kMapSlots;
  m->key = MapKey{};
  *hit = false;
  return m;
}

// Launches D = PairAct(A W^T + bias (+ src)) on stream s: m x n outputs, depth k (k % 8 == 0, a and w
// 16-byte aligned: TMA). c.raster picks the tile order (plan.sm90.RASTERS: 0 by the operands' sizes,
// 1 down the rows, 2 across the columns). A launch's tensor maps are kept for the next call with the same
// operands on this thread (find_maps: ORT hands a session the same buffers run after run), and the kernel's
// shared-memory size is set once a device.
template <typename Elem, typename Out, class PairAct, bool kResidual, bool kGated = false>
cudaError_t run(const o2f_wide::DeviceInfo& dev, const o2f_wide::Choice& c, int m, int n, int k, const void* a,
                const void* w, const Out* bias, const Out* src, Out* d, int ldd, cudaStream_t s) {
  if (m <= 0 || n <= 0) return cudaSuccess;
  // gated: the up rows start at row n, and each thread loads its bias as aligned pairs there (gatedN's n is
  // the layer's padded half, a multiple of 8)
  if (kGated && n % 8 != 0) return cudaErrorInvalidValue;
  constexpr int kTileN = kTileCols<kGated>;
  using L = Layout<Out, kResidual, kTileN>;
  const int w_rows = kGated ? 2 * n : n;   // gated: n gate rows, then n up rows
  auto kernel = light_gemm<Elem, Out, PairAct, kResidual, kGated>;
  static std::atomic<unsigned long long> opted{0};
  if (const cudaError_t err = o2f_wide::smem_opt_in_once(kernel, L::kSmemBytes, dev.id, opted)) return err;
  thread_local Maps slots[kMapSlots];
  thread_local int next = 0;
  const MapKey key{dev.id, m, n, k, ldd, a, w, kResidual ? src : nullptr, d};
  bool hit = false;
  Maps* maps = find_maps(slots, next, key, &hit);
  if (!hit) {
    if (!tile_map<Elem>(&maps->a, a, m, k, k, kBM) || !tile_map<Elem>(&maps->w, w, w_rows, k, k, kTileN))   // gated: a box per half of a W stage
      return cudaErrorInvalidValue;
    maps->c = maps->a;   // unused where C is not read
    if (!tile_map<Out>(&maps->d, d, m, n, ldd, 64)) return cudaErrorInvalidValue;
    if (kResidual && !tile_map<Out>(&maps->c, src, m, n, ldd, 64)) return cudaErrorInvalidValue;
    maps->key = key;
  }
  const int tiles = ((m + kBM - 1) / kBM) * ((n + kTileN - 1) / kTileN);
  const int n_fastest = c.raster == 1 ? 0 : c.raster == 2 ? 1 : m >= w_rows;
  const int grid = tiles < dev.sms ? tiles : dev.sms;
  kernel<<<grid, kThreads, L::kSmemBytes, s>>>(maps->a, maps->w, maps->d, maps->c, bias, m, n, k, n_fastest);
  return cudaGetLastError();
}
}  // namespace o2f_light
