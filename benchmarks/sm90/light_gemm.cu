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
// A CTA is three warpgroups (384 threads), persistent. Warpgroup 0 produces: one thread per consumer issues
// the TMA copies (2D tensor maps, 128-byte swizzle) of that consumer's A and B tiles (128 x 64 each, 32 KB a
// stage) into its own ring of kStages slots, completing on the slot's `full` mbarrier. Warpgroups 1 and 2
// consume: each owns a 128 x 128 output tile at a time (its tiles are every (2 x CTAs)-th one), runs
// wgmma.m64n128k16 with both operands from shared memory (two m64 halves per k16 step), frees a slot (its
// `empty` mbarrier, one arrival per warp) once the wgmma group that read it has completed, and writes its
// tile's epilogue (bias, GELU in packed fp16x2, fp16 stores) from registers while the other consumer keeps
// the tensor cores busy: ping-pong by construction, without CUTLASS's ordered barriers. setmaxnreg gives
// the consumers 232 registers (128 accumulators) and the producer 40.
//
// Build and run: benchmarks/sm90/light_gemm.sh (gpu_host.sh lightgemm). No CUTLASS, no cuBLAS: the CUDA
// runtime, the driver's cuTensorMapEncodeTiled through cudaGetDriverEntryPointByVersion, o2f_packed_act.cuh
// and sm90_proto.cuh.
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "o2f_packed_act.cuh"
#include "sm90_proto.cuh"

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 3;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr int kConsumers = 2, kThreads = 128 * (1 + kConsumers);
constexpr int kRingBytes = kConsumers * kStages * kStageBytes;
constexpr int kSmemBytes = 1024 + kRingBytes + 2 * kConsumers * kStages * 8;

// ---- PTX (smem_u32, mbarriers, wgmma group control, fence_reg: sm90_proto.cuh) ----
// A 2D box of the tensor map at (inner coordinate x, outer y) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
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
__global__ void __launch_bounds__(kThreads, 1)
    light_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const float* __restrict__ bias, __half* __restrict__ d, int m, int n, int k) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;   // swizzled tiles: 1024-aligned
  const uint32_t bars = base + kRingBytes;
  auto stage_a = [&](int c, int s) { return base + static_cast<uint32_t>((c * kStages + s) * kStageBytes); };
  auto stage_b = [&](int c, int s) { return stage_a(c, s) + kABytes; };
  auto full = [&](int c, int s) { return bars + static_cast<uint32_t>((c * kStages + s) * 8); };
  auto empty = [&](int c, int s) { return bars + static_cast<uint32_t>(((kConsumers + c) * kStages + s) * 8); };

  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int c = 0; c < kConsumers; ++c)
      for (int s = 0; s < kStages; ++s) {
        mbar_init(full(c, s), 1);
        mbar_init(empty(c, s), 4);   // one arrival per consumer warp
      }
    mbar_init_fence();
  }
  __syncthreads();
  const int mt = (m + kBM - 1) / kBM, nt = (n + kBN - 1) / kBN, tiles = mt * nt, kbs = (k + kBK - 1) / kBK;

  if (wg == 0) {   // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (warp < kConsumers && lane == 0) {
      const int c = warp;
      uint32_t it = 0;
      for (int t = blockIdx.x * kConsumers + c; t < tiles; t += gridDim.x * kConsumers) {
        const int m0 = (t % mt) * kBM, n0 = (t / mt) * kBN;   // down the rows first: a column band of W stays in L2
        for (int kb = 0; kb < kbs; ++kb, ++it) {
          const int s = static_cast<int>(it % kStages);
          mbar_wait(empty(c, s), ((it / kStages) & 1) ^ 1);   // a fresh barrier passes parity 1 at once
          mbar_expect_tx(full(c, s), kStageBytes);               // out-of-bounds parts are zero-filled and counted
          tma_2d(stage_a(c, s), &map_a, kb * kBK, m0, full(c, s));
          tma_2d(stage_b(c, s), &map_b, kb * kBK, n0, full(c, s));
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1;
  uint32_t it = 0;
  float acc[2][64];
  for (int t = blockIdx.x * kConsumers + c; t < tiles; t += gridDim.x * kConsumers) {
    const int m0 = (t % mt) * kBM, n0 = (t / mt) * kBN;
    int prev = 0;
    for (int kb = 0; kb < kbs; ++kb, ++it) {
      const int s = static_cast<int>(it % kStages);
      mbar_wait(full(c, s), (it / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kBK / 16; ++j) {
        const uint64_t db = desc_sw128(stage_b(c, s) + 32 * j);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wgmma_m64n128k16_ss(acc[h], desc_sw128(stage_a(c, s) + h * 64 * 128 + 32 * j), db, kb > 0 || j > 0);
      }
      wgmma_commit();
      if (kb > 0) {
        wgmma_wait<1>();                       // the previous k-block's group has read its slot
        if (lane == 0) mbar_arrive(empty(c, prev));
      }
      prev = s;
    }
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(empty(c, prev));
    fence_acc(acc[0]);
    fence_acc(acc[1]);

    // epilogue: row w*16 + lane/4 (+8) of each m64 half, columns 8i + 2 (lane % 4) (+1)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + h * 64 + warp * 16 + lane / 4;
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) {
        const int col = n0 + 8 * i + 2 * (lane % 4);
        if (col >= n) continue;   // n % 2 == 0: a pair is in or out
        const float2 b = *reinterpret_cast<const float2*>(bias + col);
        const __half2 lo = o2f_h2_gelu(__floats2half2_rn(acc[h][4 * i] + b.x, acc[h][4 * i + 1] + b.y));
        const __half2 hi = o2f_h2_gelu(__floats2half2_rn(acc[h][4 * i + 2] + b.x, acc[h][4 * i + 3] + b.y));
        if (r < m) *reinterpret_cast<__half2*>(d + static_cast<int64_t>(r) * n + col) = lo;
        if (r + 8 < m) *reinterpret_cast<__half2*>(d + static_cast<int64_t>(r + 8) * n + col) = hi;
      }
    }
  }
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

// rows x cols fp16, row-major (cols contiguous), boxes of 128 rows x 64 columns, 128-byte swizzle.
static CUtensorMap tile_map(const __half* p, int rows, int cols) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {kBK, 128}, elem[2] = {1, 1};
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
  const CUtensorMap ma = tile_map(da, m, k), mb = tile_map(dw, n, k);
  const int tiles = ((m + kBM - 1) / kBM) * ((n + kBN - 1) / kBN);
  const int grid = std::max(1, std::min(sms, (tiles + kConsumers - 1) / kConsumers));
  auto launch = [&] { light_gemm<<<grid, kThreads, kSmemBytes>>>(ma, mb, db, dd, m, n, k); };
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
  const double ms = median_ms(launch);
  std::printf("M %d, K %d, N %d: %.4f ms, %.0f TFLOP/s, rel. L2 %.2e, NaN %d (sampled rows); furthest off: "
              "(%d, %d) %.5f against %.5f\n", m, k, n, ms, 2.0 * m * k * n / (ms * 1e-3) / 1e12, std::sqrt(err / ref_sq),
              nan, worst_r, worst_c, worst_got, worst_ref);
  CHECK(cudaFree(da));
  CHECK(cudaFree(dw));
  CHECK(cudaFree(dd));
  CHECK(cudaFree(db));
}

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaFuncSetAttribute(light_gemm, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  run_case(128, 64, 128, sms);       // one tile, one k-block: the swizzle, the descriptors, the fragment layout
  run_case(256, 320, 384, sms);      // five k-blocks through three slots (the ring wraps), both consumers
  run_case(16384, 768, 3072, sms);   // ViT-B's first GEMM (CUTLASS Pingpong128x128: 131.1 us, seventeenth run)
  run_case(16384, 3072, 768, sms);   // its second (without the residual)
  run_case(4096, 784, 512, sms);     // mnist's first layer
  run_case(1000, 776, 520, sms);     // tails in every dimension (K % 64, M % 128, N % 128)
  return 0;
}
