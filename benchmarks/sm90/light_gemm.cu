// Prototype for docs/DESIGN.md's "Planned: a Hopper GEMM of our own" (issue 14 §5): the wide design's GEMM
// on sm_90a WITHOUT CUTLASS, so that a cold build compiles in seconds instead of a CUTLASS 3.x instance's
// 35-40 s. NOT RUN YET on a GPU (written when no device time was left): the first run tells whether it
// is correct (the sampled rows against float64) and how far it is from CUTLASS's Pingpong128x128 on the
// same GEMM (benchmarks/RESULTS.md, seventeenth run: 131.1 us for ViT-B's first GEMM, 16384 x 768 -> 3072,
// bias + packed GELU, in benchmarks/sm90/ln_fold_gemm.cu's setting).
//
//   D[M, N] = gelu(A[M, K] W + b): A row-major fp16, W stored n-major ([N][K], K contiguous: the wide
//   design's packing), b fp32, D fp16 row-major; fp32 accumulation.
//
// A CTA is three warpgroups (384 threads), persistent; its tiles (128 x 128 outputs) are blockIdx.x,
// + gridDim.x, ..., taken in turn by the two consumer warpgroups (1 and 2). Warpgroup 0 produces: one
// thread issues, tile after tile, the TMA copies (2D tensor maps, 128-byte swizzle) of each k-block's A and
// B tiles (128 x 64 each, 32 KB a stage) into ONE ring of kStages slots, completing on the slot's `full`
// mbarrier. A consumer runs wgmma.m64n128k16 with both operands from shared memory (two m64 halves per k16
// step) and frees a slot (its `empty` mbarrier, one arrival per warp) once the wgmma group that read it has
// completed. Ping-pong (CUTLASS's Pingpong schedule, by two `turn` mbarriers instead of its ordered
// barrier): the consumers' mainloops take turns, a consumer hands the turn over once it has issued its last
// k-block, and its epilogue (bias, GELU in packed fp16x2, fp16 stores from registers) then runs while the
// other's mainloop keeps the tensor cores busy. As the mainloops alternate, the ring's slots are used in
// tile order, and the active consumer sees all kStages slots of lookahead. setmaxnreg gives the consumers
// 232 registers (128 accumulators) and the producer 40.
//
// Build and run: benchmarks/sm90/light_gemm.sh (gpu_host.sh lightgemm). The kernel needs no CUTLASS and no
// cuBLAS: the CUDA runtime, the driver's cuTensorMapEncodeTiled through cudaGetDriverEntryPointByVersion,
// o2f_packed_act.cuh and sm90_proto.cuh. The host links cuBLAS only to time its GEMM (without bias or
// GELU) on each case as the reference.
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#if __has_include(<cublas_v2.h>)   // the reference only: light_gemm.sh links cuBLAS where the toolkit has it
#include <cublas_v2.h>
#define O2F_WITH_CUBLAS 1
#endif
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "o2f_packed_act.cuh"
#include "sm90_proto.cuh"

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 5;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr int kConsumers = 2, kThreads = 128 * (1 + kConsumers);
constexpr int kRingBytes = kStages * kStageBytes;
// Each consumer stages its output tile for the TMA store: four 64 x 64 boxes (8 KB each, 128-byte swizzle).
constexpr int kBoxBytes = 64 * 64 * 2, kOutBytes = 4 * kBoxBytes;
constexpr int kSmemBytes = 1024 + kRingBytes + kConsumers * kOutBytes + (2 * kStages + kConsumers) * 8;

// ---- PTX (smem_u32, mbarriers, wgmma group control, fence_reg: sm90_proto.cuh) ----
// A 2D box of the tensor map at (inner coordinate x, outer y) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// The same, multicast: the box lands at `dst` in every CTA of `mask` (cluster ranks), each completing on
// its own barrier at `bar`'s offset.
__device__ __forceinline__ void tma_2d_multicast(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar,
                                                 uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
      : "memory");
}
// A box from shared memory `src` to the tensor map's (x, y): the rows and columns past its bounds are not
// written. Committed as a bulk group by the issuing thread.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int x, int y, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The issuing thread's committed stores have read their shared memory (it may be written again).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// This thread's generic-proxy writes to shared memory, visible to the async proxy (the TMA store).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The 128 threads of one consumer warpgroup (barrier 0 is __syncthreads').
__device__ __forceinline__ void consumer_sync(int c) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory"); }
__device__ __forceinline__ void st_shared_b32(uint32_t addr, __half2 v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(*reinterpret_cast<uint32_t*>(&v)) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// An arrival on the mbarrier at `bar`'s offset in the cluster's CTA `rank`.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// Every thread of every CTA of the cluster: what each wrote before is visible to all after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Keeps the accumulators' reads below the wait that makes them valid.
__device__ __forceinline__ void fence_acc(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) fence_reg(d[i]);
}
// A K-major operand tile in the 128-byte swizzled layout TMA wrote (rows of 128 bytes, 8-row groups 1024
// bytes apart): start address >> 4, leading byte offset 1 (unused when swizzled), stride byte offset
// 1024 >> 4, layout SWIZZLE_128B. A k16 step inside the 64-wide tile is +32 bytes on the start address.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// ---- the kernel ----
// kCm CTAs in a cluster along M (1 or 2) take the tiles of kCm adjacent row bands in one column band: each
// loads its own A tile and 1/kCm of the shared B tile, multicast to all of them, so a stage costs the L2
// kABytes + kBBytes / kCm per CTA instead of kStageBytes (128 x 128 tiles at 64 flop per byte need ~7 TB/s
// from the L2 at the tensor cores' rate: more than it gives). A slot is refilled only when the consumer warps
// of every CTA of the cluster have released it (each arrives on every CTA's `empty`).
template <int kCm>
__global__ void __launch_bounds__(kThreads, 1)
    light_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_d, const float* __restrict__ bias, int m, int n, int k,
               int n_fastest) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;   // swizzled tiles: 1024-aligned
  const uint32_t staging = base + kRingBytes;                 // the ring's size keeps it 1024-aligned
  const uint32_t bars = staging + kConsumers * kOutBytes;
  auto stage_a = [&](int s) { return base + static_cast<uint32_t>(s * kStageBytes); };
  auto stage_b = [&](int s) { return stage_a(s) + kABytes; };
  auto full = [&](int s) { return bars + static_cast<uint32_t>(s * 8); };
  auto empty = [&](int s) { return bars + static_cast<uint32_t>((kStages + s) * 8); };
  auto turn = [&](int c) { return bars + static_cast<uint32_t>((2 * kStages + c) * 8); };

  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const uint32_t rank = kCm > 1 ? cluster_rank() : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 4 * kCm);   // one arrival per consumer warp of each CTA of the cluster
    }
    for (int c = 0; c < kConsumers; ++c) mbar_init(turn(c), 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (kCm > 1) cluster_sync();   // the partner's copies and arrivals find initialised barriers
  // Units of work: kCm row bands x one column band; cluster q takes units q, q + clusters, ..., its CTA of
  // rank r the r-th row band of each. The host orders them so that the smaller operand stays in the L2:
  // across the columns first when A is the larger (each row band of A read from memory once), else down the
  // rows. Past the last band (odd row-band counts) the box is out of bounds: zero-filled, and not stored.
  const int mt = (m + kBM - 1) / kBM, nt = (n + kBN - 1) / kBN, kbs = (k + kBK - 1) / kBK;
  const int mu = (mt + kCm - 1) / kCm, units = mu * nt;
  const int cid = static_cast<int>(blockIdx.x) / kCm, clusters = static_cast<int>(gridDim.x) / kCm;
  auto origin = [&](int u, int& m0, int& n0) {
    const int mi = n_fastest ? u / nt : u % mu, ni = n_fastest ? u % nt : u / mu;
    m0 = (mi * kCm + static_cast<int>(rank)) * kBM;
    n0 = ni * kBN;
  };

  if (wg == 0) {   // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (warp == 0 && lane == 0) {
      uint32_t it = 0;
      for (int u = cid; u < units; u += clusters) {
        int m0, n0;
        origin(u, m0, n0);
        for (int kb = 0; kb < kbs; ++kb, ++it) {
          const int s = static_cast<int>(it % kStages);
          mbar_wait(empty(s), ((it / kStages) & 1) ^ 1);     // a fresh barrier passes parity 1 at once
          mbar_expect_tx(full(s), kStageBytes);              // out-of-bounds parts are zero-filled and counted
          tma_2d(stage_a(s), &map_a, kb * kBK, m0, full(s));
          if (kCm == 1)
            tma_2d(stage_b(s), &map_b, kb * kBK, n0, full(s));
          else   // this CTA's share of B, to every CTA of the cluster (the partner's share arrives likewise)
            tma_2d_multicast(stage_b(s) + rank * (kBBytes / kCm), &map_b, kb * kBK, n0 + static_cast<int>(rank) * (kBN / kCm),
                             full(s), static_cast<uint16_t>((1u << kCm) - 1));
        }
      }
    }
    __syncwarp();
  } else {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1;
  float acc[2][64];
  auto release = [&](int s) {
    if (lane != 0) return;
    for (int q = 0; q < kCm; ++q) {
      if (q == static_cast<int>(rank)) mbar_arrive(empty(s));
      else mbar_arrive_cluster(empty(s), static_cast<uint32_t>(q));
    }
  };
  // This consumer's i-th unit is the cluster's (2i + c)-th: its k-blocks are the ring's from (2i + c) * kbs on.
  for (int i = 0, u = cid + c * clusters; u < units; ++i, u += kConsumers * clusters) {
    int m0, n0;
    origin(u, m0, n0);
    // The bias of this thread's columns (8f + 2 (lane % 4), + 1), loaded before the mainloop hides the loads
    float2 bias_r[kBN / 8];
#pragma unroll
    for (int f = 0; f < kBN / 8; ++f) {
      const int col = n0 + 8 * f + 2 * (lane % 4);   // n % 8 == 0 (the TMA maps' strides): a pair is in or out
      bias_r[f] = col < n ? *reinterpret_cast<const float2*>(bias + col) : make_float2(0.f, 0.f);
    }
    // Consumer 0's i-th mainloop follows consumer 1's (i-1)-th (i completions of turn(0); the first passes
    // on a fresh barrier); consumer 1's i-th follows consumer 0's i-th (i + 1 completions of turn(1)).
    mbar_wait(turn(c), c == 0 ? (i & 1) ^ 1 : i & 1);
    uint32_t it = static_cast<uint32_t>((kConsumers * i + c) * kbs);
    int prev = 0;
    for (int kb = 0; kb < kbs; ++kb, ++it) {
      const int s = static_cast<int>(it % kStages);
      mbar_wait(full(s), (it / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kBK / 16; ++j) {
        const uint64_t db = desc_sw128(stage_b(s) + 32 * j);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wgmma_m64n128k16_ss(acc[h], desc_sw128(stage_a(s) + h * 64 * 128 + 32 * j), db, kb > 0 || j > 0);
      }
      wgmma_commit();
      if (kb > 0) {
        wgmma_wait<1>();                       // the previous k-block's group has read its slot
        release(prev);
      }
      prev = s;
    }
    if (threadIdx.x % 128 == 0) mbar_arrive(turn(1 - c));   // all issued: the other consumer's turn
    wgmma_wait<0>();
    release(prev);
    fence_acc(acc[0]);
    fence_acc(acc[1]);

    // Epilogue: bias, GELU in fp16x2, into this consumer's staging boxes, then TMA stores (which clip the
    // tails). Thread (warp, lane) holds rows warp*16 + lane/4 (+8) of each m64 half h and columns 8f +
    // 2 (lane % 4) (+1): in box (h, f / 8), 16-byte chunk f % 8 of its 128-byte row, which the 128-byte
    // swizzle moves to chunk (f % 8) ^ (row % 8): the eight rows of a store land in eight different banks.
    const uint32_t out = staging + c * kOutBytes;
    if (threadIdx.x % 128 == 0) bulk_wait_read();   // the previous tile's stores have read the boxes
    consumer_sync(c);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + lane / 4;
#pragma unroll
      for (int f = 0; f < kBN / 8; ++f) {
        const __half2 lo = o2f_h2_gelu(__floats2half2_rn(acc[h][4 * f] + bias_r[f].x, acc[h][4 * f + 1] + bias_r[f].y));
        const __half2 hi = o2f_h2_gelu(__floats2half2_rn(acc[h][4 * f + 2] + bias_r[f].x, acc[h][4 * f + 3] + bias_r[f].y));
        const uint32_t box = out + (2 * h + f / 8) * kBoxBytes, word = ((f % 8) ^ (row % 8)) * 16 + (lane % 4) * 4;
        st_shared_b32(box + row * 128 + word, lo);
        st_shared_b32(box + (row + 8) * 128 + word, hi);   // (row + 8) % 8 == row % 8
      }
    }
    fence_async_smem();
    consumer_sync(c);
    if (threadIdx.x % 128 == 0) {
      for (int q = 0; q < 4; ++q) tma_store_2d(&map_d, n0 + 64 * (q % 2), m0 + 64 * (q / 2), out + q * kBoxBytes);
      bulk_commit();
    }
  }
  if (threadIdx.x % 128 == 0) bulk_wait_read();   // the last stores have read the staging before the CTA leaves
  }
  if (kCm > 1) cluster_sync();   // no CTA leaves while the partner's copies and arrivals may still reach it
}

// ---- host ----
static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (!fn || q != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "no cuTensorMapEncodeTiled in this driver\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// rows x cols fp16, row-major (cols contiguous; cols % 8 == 0), boxes of box_rows rows x 64 columns,
// 128-byte swizzle.
static CUtensorMap tile_map(const __half* p, int rows, int cols, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {kBK, static_cast<cuuint32_t>(box_rows)}, elem[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<__half*>(p), dims, strides, box,
                                    elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r));
    std::exit(1);
  }
  return map;
}

static double gelu_ref(double a) { return 0.5 * a * (1 + std::erf(a / std::sqrt(2.0))); }

// One case: time (median of 50, CUDA events) and relative L2 against float64 on sampled rows.
template <int kCm>
static void run_case(int m, int k, int n, int sms) {
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<__half> a(static_cast<size_t>(m) * k), w(static_cast<size_t>(n) * k);
  std::vector<float> bias(n);
  for (auto& v : a) v = __float2half(g(rng));
  for (auto& v : w) v = __float2half(g(rng) / std::sqrt(static_cast<float>(k)));
  for (auto& v : bias) v = 0.1f * g(rng);
  __half *da, *dw, *dd;
  float* db;
  CHECK(cudaMalloc(&da, a.size() * 2));
  CHECK(cudaMalloc(&dw, w.size() * 2));
  CHECK(cudaMalloc(&dd, static_cast<size_t>(m) * n * 2));
  CHECK(cudaMalloc(&db, n * 4));
  CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, bias.data(), n * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dd, 0xff, static_cast<size_t>(m) * n * 2));   // NaN: an unwritten element shows
  const CUtensorMap ma = tile_map(da, m, k, kBM), mb = tile_map(dw, n, k, kBN / kCm), md = tile_map(dd, m, n, 64);
  const int n_fastest = m >= n;   // A is the larger operand: keep W in the L2 (the kernel's unit order)
  const int units = ((m + kCm * kBM - 1) / (kCm * kBM)) * ((n + kBN - 1) / kBN);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCm;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(sms / kCm * kCm);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int resident = sms / kCm;   // clusters that fit at once (a GPC's odd SM stays idle in pairs)
  CHECK(cudaOccupancyMaxActiveClusters(&resident, light_gemm<kCm>, &cfg));
  cfg.gridDim = dim3(std::max(1, std::min(resident, units)) * kCm);
  auto launch = [&] { CHECK(cudaLaunchKernelEx(&cfg, light_gemm<kCm>, ma, mb, md, (const float*)db, m, n, k, n_fastest)); };
  launch();
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<__half> out(static_cast<size_t>(m) * n);
  CHECK(cudaMemcpy(out.data(), dd, out.size() * 2, cudaMemcpyDeviceToHost));
  double err = 0, ref_sq = 0, worst = 0;
  int nan = 0, worst_r = -1, worst_c = -1;
  float worst_got = 0.f, worst_ref = 0.f;
  std::vector<int> rows;   // 64 rows spread over the batch, the last one among them
  for (int r = 0; r < m; r += std::max(1, m / 64)) rows.push_back(r);
  if (rows.back() != m - 1) rows.push_back(m - 1);
  for (int r : rows) {
    for (int j = 0; j < n; ++j) {
      double acc = bias[j];
      for (int q = 0; q < k; ++q)
        acc += static_cast<double>(__half2float(a[static_cast<size_t>(r) * k + q])) * __half2float(w[static_cast<size_t>(j) * k + q]);
      const double ref = gelu_ref(acc), got = __half2float(out[static_cast<size_t>(r) * n + j]);
      if (std::isnan(got)) ++nan;
      const double gap = std::isnan(got) ? INFINITY : std::fabs(got - ref);
      if (gap > worst || worst_r < 0) {   // the element furthest off: where a layout bug shows first
        worst = gap;
        worst_r = r;
        worst_c = j;
        worst_got = static_cast<float>(got);
        worst_ref = static_cast<float>(ref);
      }
      err += (got - ref) * (got - ref);
      ref_sq += ref * ref;
    }
  }
  const double ms = median_ms(launch, 20, 10);
  double ms_blas = NAN;
#ifdef O2F_WITH_CUBLAS
  // cuBLAS on the same operands (D = A W^T, column-major view: D^T[N, M] = W[N, K] . A^T), no bias, no GELU
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) std::exit(1);
  const float one = 1.f, zero = 0.f;
  auto blas = [&] {
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, dw, CUDA_R_16F, k, da, CUDA_R_16F, k, &zero, dd,
                 CUDA_R_16F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  ms_blas = median_ms(blas, 20, 10);
  cublasDestroy(h);
#endif
  auto tflops = [&](double t) { return 2.0 * m * k * n / (t * 1e-3) / 1e12; };
  std::printf("cluster %d (%d CTAs) M %d, K %d, N %d: %.4f ms, %.0f TFLOP/s (cuBLAS GEMM alone %.4f ms, %.0f TFLOP/s), rel. L2 %.2e, "
              "NaN %d (sampled rows); furthest off: (%d, %d) %.5f against %.5f\n", kCm, cfg.gridDim.x, m, k, n, ms, tflops(ms), ms_blas,
              tflops(ms_blas), std::sqrt(err / ref_sq), nan, worst_r, worst_c, worst_got, worst_ref);
  CHECK(cudaFree(da));
  CHECK(cudaFree(dw));
  CHECK(cudaFree(dd));
  CHECK(cudaFree(db));
}

// No arguments: every case, clusters of 1 and 2. `light_gemm M K N CM`: that case only (for a profiler).
int main(int argc, char** argv) {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaFuncSetAttribute(light_gemm<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  CHECK(cudaFuncSetAttribute(light_gemm<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  if (argc == 5) {
    const int m = std::atoi(argv[1]), k = std::atoi(argv[2]), n = std::atoi(argv[3]);
    (std::atoi(argv[4]) == 2 ? run_case<2> : run_case<1>)(m, k, n, sms);
    return 0;
  }
  for (auto run : {run_case<1>, run_case<2>}) {
    run(128, 64, 128, sms);       // one tile, one k-block: the swizzle, the descriptors, the fragment layout
    run(256, 320, 384, sms);      // two tiles of five k-blocks each through six slots (the ring wraps), both consumers
    run(16384, 768, 3072, sms);   // ViT-B's first GEMM (CUTLASS Pingpong128x128: 131.1 us, seventeenth run)
    run(16384, 3072, 768, sms);   // its second (without the residual)
    run(4096, 784, 512, sms);     // mnist's first layer
    run(1000, 776, 520, sms);     // tails in every dimension (K % 64, M % 128, N % 128)
  }
  return 0;
}
