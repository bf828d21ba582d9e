// The transformer FFN in one Hopper kernel, the hidden layer never leaving the SM (issue 16's next step,
// docs/DESIGN.md "Gated layers"): y = act(x W1g) * (x W1u) W2 (gated, as LLaMA's and timm's SwiGLU) or
// y = act(x W1) W2, fp32 rows in and out, fp16 operands, fp32 accumulation; no bias (LLaMA's MLP has none).
// A standalone prototype with its harness (time, TFLOP/s, error against float64 on sampled rows, and
// cuBLAS's two GEMMs alone on the same operands for scale); it needs no CUTLASS and no ORT.
//
// Design (FlashAttention's shape, with the hidden width in the role of the keys):
//  * A CTA is 2 warpgroups, persistent; a pass is one 64-row tile per warpgroup; both run every pass.
//  * The tile's rows are converted once to fp16 into a 128-byte-swizzled shared-memory tile: layer 1's A
//    operand by descriptor (SS wgmma), so that the 64 x 256 input does not hold 64 registers a thread.
//  * The hidden width runs in chunks of HC columns (HC gate + HC up for a gated block): one
//    m64n{HC or 2 HC}k16 wgmma per k-step of K0 into the chunk's accumulators; act(g) * u in fp32,
//    rounded to fp16, is in registers the A operand of layer 2's slice of HC rows (RS wgmma
//    m64nNk16), which accumulates into the tile's 64 x N output (N/2 registers a thread) across chunks.
//  * Each ring slot holds one chunk's weights: layer 1's HC (2 HC) columns then layer 2's HC rows, copied
//    by cp.async.bulk through the library's streamed-weight ring (templates/o2f_wgmma_ring.cuh): the
//    warps of both warpgroups release a slot, the last refills it kStages chunks ahead.
//  * A warpgroup waits for its chunk's layer-1 product before its epilogue (the tensor core then runs the
//    other warpgroup's wgmmas: the two warpgroups overlap each other's epilogues).
//
// Build and run: benchmarks/sm90/ffn_wgmma.sh (a binary per shape: -DFFN_K0, FFN_H, FFN_N, FFN_GATED).
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define O2F_WITH_CUBLAS 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "sm90_proto.cuh"
#include "o2f_packed_act.cuh"

#ifndef FFN_K0
#define FFN_K0 256
#endif
#ifndef FFN_H
#define FFN_H 1024
#endif
#ifndef FFN_N
#define FFN_N 256
#endif
#ifndef FFN_GATED
#define FFN_GATED 1
#endif
#ifndef FFN_FILL_ROWS
#define FFN_FILL_ROWS 4   // input rows a lane loads before it converts and stores them (4, 8 or 16)
#endif
#ifndef FFN_PREFETCH
#define FFN_PREFETCH 0    // 1: each pass prefetches its warpgroup's next rows into L2 (cp.async.bulk.prefetch)
#endif
#ifndef FFN_STAGES
#define FFN_STAGES 3
#endif

namespace ffn {
constexpr int kK0 = FFN_K0;        // input features (a multiple of 64: whole 128-byte swizzle atoms)
constexpr int kH = FFN_H;          // hidden features (a multiple of kHC)
constexpr int kN = FFN_N;          // output features (64..256, a multiple of 64)
constexpr bool kGated = FFN_GATED;
constexpr int kHC = 32;            // hidden features per chunk
constexpr int kL1N = kGated ? 2 * kHC : kHC;   // layer 1's columns per chunk (gate block, then up block)
constexpr int kChunks = kH / kHC;
constexpr int kL1Bytes = kL1N * kK0 * 2;        // a chunk's layer-1 weights: kL1N x kK0, K-major, 128 B swizzle
constexpr int kL2Bytes = kN * kHC * 2;          // its layer-2 rows: kN x kHC, K-major, 64 B swizzle
constexpr int kXTileBytes = 64 * kK0 * 2;       // a warpgroup's input tile, fp16, K-major, 128 B swizzle
static_assert(kK0 % 64 == 0 && kK0 <= 256, "K0: whole 128-byte atoms, at most 256");
static_assert(kH % kHC == 0 && kN % 64 == 0 && kN <= 256, "shapes");
constexpr int kNwg = 2;
constexpr int kThreads = 128 * kNwg;

// What the library's ring (o2f_wgmma_ring.cuh) reads from its translation unit.
constexpr uint32_t kStages = FFN_STAGES;
constexpr uint32_t kSlotBytes = (kL1Bytes + kL2Bytes + 1023) / 1024 * 1024;
constexpr uint32_t kRingChunks = kChunks;
constexpr uint32_t kWarps = kThreads / 32;
#ifndef FFN_CLUSTER
#define FFN_CLUSTER 1
#endif
// CTAs of a cluster (FFN_CLUSTER > 1): they run their passes in step and each copies 1/kCluster of every
// chunk into the slot of all of them (the ring's multicast): a chunk leaves L2 once per cluster.
constexpr uint32_t kCluster = FFN_CLUSTER;
__device__ __forceinline__ uint2 stream_chunk(uint32_t p) { return make_uint2(p * (kL1Bytes + kL2Bytes), kL1Bytes + kL2Bytes); }
// The wgmma forms: the library's FFN kernel's (fp16 operands here).
#define O2F_FFN_AB "f16"
#include "o2f_ffn_wgmma.cuh"

// Diagnostic builds (where the time goes; results wrong by design, the check then fails): FFN_DIAG_NO_FILL
// moves no weight bytes (the ring's O2F_DIAG_NO_FILL), FFN_DIAG_NO_X converts the input tile on the first
// pass only, FFN_DIAG_NO_EPI packs the layer-0 products without the activation.
#ifdef FFN_DIAG_NO_FILL
#define O2F_DIAG_NO_FILL 1
#endif
#include "o2f_wgmma_ring.cuh"

constexpr int kRingSmem = 0;
constexpr int kXSmem = kStages * kSlotBytes;
constexpr int kBarSmem = kXSmem + kNwg * kXTileBytes;
constexpr int kPeerBarSmem = kBarSmem + 8 * kStages;   // clusters: the slots' "the other CTAs are done"
constexpr int kCntSmem = kPeerBarSmem + 8 * kStages;
constexpr int kSmemBytes = kCntSmem + 4 * kStages + 1024;   // + alignment slack

// (kHi128, kHi64, kstep_off, wg_sync, fence_proxy_async, pack_h2: o2f_ffn_wgmma.cuh; wdesc, fence_frag,
// bulk_g2s: o2f_sm90_ptx.cuh)
__device__ __forceinline__ float4 ld4(const float* p) {
  float4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st2(float* p, float a, float b) {
  asm volatile("st.global.cs.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}

// The hidden activation: SiLU (gated blocks) or GELU (the library's packed fp16x2 form).
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// A warpgroup's 64 input rows from `row0` (fp32) into its fp16 tile (zeros past the batch): warp w converts
// rows w, w + 4, ...; lane l holds columns 8l..8l+7 (one 16-byte unit of the swizzled tile).
__device__ __forceinline__ void fill_x(unsigned char* tile, const float* __restrict__ x, int64_t rows, int64_t row0,
                                       int warp, int lane) {
  if (lane >= kK0 / 8) return;
  const int atom = lane / 8, unit = lane % 8;
#pragma unroll
  for (int rb = 0; rb < 16; rb += FFN_FILL_ROWS) {
    float4 v[FFN_FILL_ROWS][2];
#pragma unroll
    for (int i = 0; i < FFN_FILL_ROWS; ++i) {
      const int r = warp + 4 * (rb + i);
      const int64_t g = row0 + r;
      if (g < rows) {
        v[i][0] = ld4(x + g * kK0 + 8 * lane);
        v[i][1] = ld4(x + g * kK0 + 8 * lane + 4);
      } else {
        v[i][0] = v[i][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int i = 0; i < FFN_FILL_ROWS; ++i) {
      const int r = warp + 4 * (rb + i);
      uint4 h;
      h.x = pack_h2(v[i][0].x, v[i][0].y);
      h.y = pack_h2(v[i][0].z, v[i][0].w);
      h.z = pack_h2(v[i][1].x, v[i][1].y);
      h.w = pack_h2(v[i][1].z, v[i][1].w);
      *reinterpret_cast<uint4*>(tile + atom * 64 * 128 + r * 128 + ((unit ^ (r & 7)) * 16)) = h;
    }
  }
}

// FFN_PINGPONG: the two warpgroups issue their wgmmas in turns (named barriers 3 and 4, FlashAttention-3's
// warp-scheduler barriers), so that one's activation and input conversion run while the other's wgmmas
// keep the tensor cores busy; without it both wait on the same ring slot and work in step.
#ifndef FFN_PINGPONG
#define FFN_PINGPONG 0
#endif
// (turn_wait, turn_pass: o2f_ffn_wgmma.cuh)

__global__ void __launch_bounds__(kThreads, 1)
ffn_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows, const unsigned char* __restrict__ wimg) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  if (tid == 0) {
    for (uint32_t s = 0; s < kStages; ++s) mbar_init(base + kBarSmem + 8 * s, 1);
    if constexpr (kCluster > 1)
      for (uint32_t s = 0; s < kStages; ++s) mbar_init(base + kPeerBarSmem + 8 * s, kCluster - 1);
    mbar_init_fence();
  }
  for (uint32_t i = tid; i < kStages; i += kThreads) reinterpret_cast<uint32_t*>(smem + kCntSmem)[i] = 0u;
  __syncthreads();
  if constexpr (kCluster > 1) cluster_sync();
  const int64_t ntiles = (rows + 63) / 64;
  const int64_t npasses = (ntiles + kNwg - 1) / kNwg;
  // a cluster makes kCluster passes in step (a super-pass); its CTA of rank r takes pass kCluster * sp + r
  const int64_t nsuper = (npasses + kCluster - 1) / kCluster;
  const int64_t mine = (nsuper - 1 - blockIdx.x / kCluster) / (gridDim.x / kCluster) + 1;   // grid <= kCluster * nsuper
  const uint32_t rank = kCluster > 1 ? cluster_rank() : 0u;
  Ring ring{base + kRingSmem, base + kBarSmem, base + kCntSmem, base + kPeerBarSmem, wimg,
            static_cast<uint32_t>(mine) * kRingChunks, 0u, 0u, 0u, 0u, rank};
  if (tid == 0) ring.prime();
  unsigned char* xtile = smem + kXSmem + wg * kXTileBytes;
  const uint32_t xlo = ((base + kXSmem + wg * kXTileBytes) >> 4) | (1u << 16);
  const int t2 = 2 * (lane & 3);
  const int rin = 16 * warp + (lane >> 2);

#if FFN_PINGPONG
  if (wg == 1) turn_pass(wg);   // warpgroup 0 issues first
#endif
#pragma unroll 1
  for (int64_t sp = blockIdx.x / kCluster; sp < nsuper; sp += gridDim.x / kCluster) {
    const int64_t pass = sp * kCluster + rank;
    const int64_t row0 = (pass * kNwg + wg) * 64;
#ifdef FFN_DIAG_NO_X
    if (sp == blockIdx.x / kCluster)
#endif
    fill_x(xtile, x, rows, row0, warp, lane);
#if FFN_PREFETCH
    {  // the next pass's rows of this warpgroup into L2 (one bulk prefetch a row), for its fill
      const int64_t next = row0 + static_cast<int64_t>(gridDim.x / kCluster) * kCluster * kNwg * 64;
      const int r = (tid & 127) >> 1;   // two threads a row: the row's halves
      if (next + r < rows) {
        const float* p = x + (next + r) * kK0 + (tid & 1) * (kK0 / 2);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(static_cast<uint32_t>(kK0 * 2)) : "memory");
      }
    }
#endif
    fence_proxy_async();   // the generic stores, before wgmma (async proxy) reads the tile
    wg_sync(wg);
    float out[kN / 2];
    uint32_t h[kHC / 16][4];
    float d[kL1N / 2];
    auto layer1 = [&](uint32_t slot) {
#pragma unroll
      for (int ks = 0; ks < kK0 / 16; ++ks)
        WgmmaSS<kL1N>::run(d, wdesc(kHi128, xlo + (kstep_off(ks, 64) >> 4)),
                           wdesc(kHi128, slot + (kstep_off(ks, kL1N) >> 4)), ks);
    };
    auto layer2 = [&](uint32_t slot, bool first) {
#pragma unroll
      for (int kt = 0; kt < kHC / 16; ++kt)
        WgmmaRS<kN>::run(out, h[kt], wdesc(kHi64, slot + ((kL1Bytes + 32 * kt) >> 4)), !first || kt > 0);
    };
    auto hidden = [&]() {   // act(g) * u (or act(a)) of this thread's hidden columns as layer 2's A fragments
#pragma unroll
      for (int j = 0; j < kHC / 8; ++j) {
        uint32_t lo, hi;
#ifdef FFN_DIAG_NO_EPI
        if (true) {
          lo = pack_h2(d[4 * j], d[4 * j + 1]);
          hi = pack_h2(d[4 * j + 2], d[4 * j + 3]);
        } else
#endif
        if constexpr (kGated) {
          const int u = j + kHC / 8;
          lo = pack_h2(silu(d[4 * j]) * d[4 * u], silu(d[4 * j + 1]) * d[4 * u + 1]);
          hi = pack_h2(silu(d[4 * j + 2]) * d[4 * u + 2], silu(d[4 * j + 3]) * d[4 * u + 3]);
        } else {
          lo = o2f_h2_bits(o2f_h2_gelu(__floats2half2_rn(d[4 * j], d[4 * j + 1])));
          hi = o2f_h2_bits(o2f_h2_gelu(__floats2half2_rn(d[4 * j + 2], d[4 * j + 3])));
        }
        h[j / 2][(j % 2) * 2] = lo;
        h[j / 2][(j % 2) * 2 + 1] = hi;
      }
      fence_frag(h);
    };
#if FFN_PINGPONG
    // In turns: chunk c's layer-1 wgmmas go out together with chunk c - 1's layer-2 ones, then the other
    // warpgroup's; the first and the last chunk are peeled, so that every wgmma sequence is straight-line
    // code (a branch between them has ptxas inject warpgroup.arrive, C7519).
    uint32_t prev = ring.acquire();
    turn_wait(wg);
    wgmma_fence();
    layer1(prev);
    wgmma_commit();
    turn_pass(wg);
    wgmma_wait<0>();
    fence_acc(d);
    hidden();
#pragma unroll 1
    for (int c = 1; c < kChunks; ++c) {
      const uint32_t slot = ring.acquire();
      turn_wait(wg);
      wgmma_fence();
      layer2(prev, c == 1);
      layer1(slot);
      wgmma_commit();
      turn_pass(wg);
      wgmma_wait<0>();
      fence_acc(d);
      fence_acc(out);
      ring.release(lane);   // chunk c - 1's slot
      hidden();
      prev = slot;
    }
    turn_wait(wg);
    wgmma_fence();
    layer2(prev, kChunks == 1);
    wgmma_commit();
    turn_pass(wg);
    wgmma_wait<0>();
    fence_acc(out);
#else
    // In step: both warpgroups wait on the same ring slot, then each issues its chunk's wgmmas
#pragma unroll 1
    for (int c = 0; c < kChunks; ++c) {
      const uint32_t slot = ring.acquire();
      wgmma_fence();
      layer1(slot);
      wgmma_commit();
      wgmma_wait<0>();   // this chunk's layer-1 product, and the previous chunk's layer-2 wgmmas
      fence_acc(d);
      fence_acc(out);
      if (c > 0) ring.release(lane);   // the previous chunk's slot
      hidden();
      wgmma_fence();
      layer2(slot, c == 0);
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_acc(out);
#endif
    ring.release(lane);   // the last chunk's slot
    wg_sync(wg);          // every warp's layer-1 reads of the tile are done: the next pass refills it
    const int64_t r0 = row0 + rin;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      const int col = 8 * j + t2;
      if (r0 < rows) st2(y + r0 * kN + col, out[4 * j], out[4 * j + 1]);
      if (r0 + 8 < rows) st2(y + (r0 + 8) * kN + col, out[4 * j + 2], out[4 * j + 3]);
    }
  }
#if FFN_PINGPONG
  if (wg == 0) turn_wait(wg);   // warpgroup 1's last turn, passed to nobody
#endif
  if constexpr (kCluster > 1) cluster_sync();   // no CTA leaves while the others' copies and arrivals may target it
}
}  // namespace ffn

using namespace ffn;

static uint16_t f2h(float v) { __half h = __float2half_rn(v); uint16_t r; std::memcpy(&r, &h, 2); return r; }
static float h2f(uint16_t r) { __half h; std::memcpy(&h, &r, 2); return __half2float(h); }
static double gelu_ref(double a) { return 0.5 * a * (1 + std::erf(a / std::sqrt(2.0))); }
static double silu_ref(double a) { return a / (1 + std::exp(-a)); }
static unsigned swz(unsigned b, int atom) { return b ^ (((b >> 7) & static_cast<unsigned>(atom / 16 - 1)) << 4); }

int main(int argc, char** argv) {
  std::vector<int64_t> batches;
  for (int i = 1; i < argc; ++i) batches.push_back(std::atoll(argv[i]));
  if (batches.empty()) batches = {262144, 65536, 1048576, 1000003, 1};
  const int l1cols = kGated ? 2 * kH : kH;
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  // weights as y = x @ W (W1: K0 x l1cols, gate columns then up; W2: H x N), rounded to fp16 once
  std::vector<uint16_t> w1(static_cast<size_t>(kK0) * l1cols), w2(static_cast<size_t>(kH) * kN);
  for (auto& v : w1) v = f2h(nd(rng) / std::sqrt(float(kK0)));
  for (auto& v : w2) v = f2h(nd(rng) / std::sqrt(float(kH)));
  // the image: per chunk, layer 1's kL1N columns (K-major, 128 B swizzle), then layer 2's kHC rows (64 B)
  const size_t chunk_bytes = kL1Bytes + kL2Bytes;
  std::vector<unsigned char> img(chunk_bytes * kChunks, 0);
  for (int c = 0; c < kChunks; ++c) {
    unsigned char* ch = img.data() + c * chunk_bytes;
    for (int n = 0; n < kL1N; ++n) {
      const int src = kGated ? (n < kHC ? c * kHC + n : kH + c * kHC + n - kHC) : c * kHC + n;
      for (int k = 0; k < kK0; ++k) {
        const unsigned off = (n % 8) * 128 + (n / 8) * 1024 + (2 * k) % 128 + (2 * k / 128) * (kL1N / 8) * 1024;
        std::memcpy(ch + swz(off, 128), &w1[static_cast<size_t>(k) * l1cols + src], 2);
      }
    }
    for (int n = 0; n < kN; ++n)
      for (int kk = 0; kk < kHC; ++kk) {
        const unsigned off = (n % 8) * 64 + (n / 8) * 512 + 2 * kk;
        std::memcpy(ch + kL1Bytes + swz(off, 64), &w2[static_cast<size_t>(c * kHC + kk) * kN + n], 2);
      }
  }
  unsigned char* dimg;
  CHECK(cudaMalloc(&dimg, img.size()));
  CHECK(cudaMemcpy(dimg, img.data(), img.size(), cudaMemcpyHostToDevice));
  CHECK(cudaFuncSetAttribute(ffn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; FFN %d -> %s%d -> %d, fp32 I/O, no bias; %d-wide hidden chunks, %u ring slots of %u KB, "
              "%d KB smem\n", prop.name, sms, kK0, kGated ? "SwiGLU " : "GELU ", kH, kN, kHC, kStages, kSlotBytes / 1024,
              kSmemBytes / 1024);
  std::printf("%10s %10s %9s %9s %10s %9s %11s %11s\n", "rows", "fused ms", "TFLOP/s", "floor ms", "vs floor",
              "rel.L2", "cuBLAS ms", "(2 GEMMs)");
  bool ok = true;
  for (int64_t rows : batches) {
    std::vector<float> hx(static_cast<size_t>(rows) * kK0);
    for (auto& v : hx) v = nd(rng);
    float *dx, *dy;
    CHECK(cudaMalloc(&dx, std::max<size_t>(1, hx.size()) * 4));
    CHECK(cudaMalloc(&dy, std::max<size_t>(1, static_cast<size_t>(rows) * kN) * 4));
    CHECK(cudaMemcpy(dx, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dy, 0xFF, static_cast<size_t>(rows) * kN * 4));   // NaNs: an unwritten output shows
    const int64_t npasses = ((rows + 63) / 64 + kNwg - 1) / kNwg;
    const int64_t nsuper = (npasses + kCluster - 1) / kCluster;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(sms / kCluster * kCluster);
    int clusters = sms / kCluster;
    CHECK(cudaOccupancyMaxActiveClusters(&clusters, ffn_kernel, &cfg));
    const int grid = static_cast<int>(std::min<int64_t>(clusters, nsuper)) * kCluster;
    cfg.gridDim = dim3(grid);
    if (rows == batches[0]) std::printf("(grid %d CTAs: %d clusters of %u can be resident)\n", grid, clusters, kCluster);
    auto run = [&] { cudaLaunchKernelEx(&cfg, ffn_kernel, static_cast<const float*>(dx), dy, rows, static_cast<const unsigned char*>(dimg)); };
    run();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    // error against float64 on sampled rows (the kernel's roundings: x and the hidden values to fp16)
    std::vector<int64_t> sample;
    for (int i = 0; i < 48 && i < rows; ++i) sample.push_back(rows <= 48 ? i : (rows - 1) * i / 47);
    double num = 0, den = 0;
    std::vector<float> yrow(kN);
    std::vector<double> hid(kH);
    for (int64_t r : sample) {
      CHECK(cudaMemcpy(yrow.data(), dy + r * kN, kN * 4, cudaMemcpyDeviceToHost));
      for (int j = 0; j < kH; ++j) {
        double g = 0, u = 0;
        for (int k = 0; k < kK0; ++k) {
          const double xv = h2f(f2h(hx[r * kK0 + k]));
          g += xv * h2f(w1[static_cast<size_t>(k) * l1cols + j]);
          if (kGated) u += xv * h2f(w1[static_cast<size_t>(k) * l1cols + kH + j]);
        }
        hid[j] = h2f(f2h(static_cast<float>(kGated ? silu_ref(g) * u : gelu_ref(g))));
      }
      for (int n = 0; n < kN; ++n) {
        double acc = 0;
        for (int j = 0; j < kH; ++j) acc += hid[j] * h2f(w2[static_cast<size_t>(j) * kN + n]);
        num += (yrow[n] - acc) * (yrow[n] - acc);
        den += acc * acc;
      }
    }
    const double rel = std::sqrt(num / std::max(den, 1e-300));
    const bool good = std::isfinite(rel) && rel < 2e-3;
    ok = ok && good;
    const int bt = rows >= 65536 ? 10 : 50;
    const float ms = median_ms(run, 30, bt);
    const double flops = 2.0 * rows * (static_cast<double>(kK0) * l1cols + static_cast<double>(kH) * kN);
    const double bytes = 4.0 * rows * (kK0 + kN) + 2.0 * (static_cast<double>(kK0) * l1cols + kH * kN);
    const double floor_ms = std::max(flops / 665e12, bytes / 3.0e12) * 1e3;
    float blas = -1;
#ifdef O2F_WITH_CUBLAS
    if (rows >= 64) {
      cublasHandle_t hb;
      cublasCreate(&hb);
      __half *a16, *w1d, *w2d, *hmid, *o16;
      CHECK(cudaMalloc(&a16, static_cast<size_t>(rows) * kK0 * 2));
      CHECK(cudaMalloc(&hmid, static_cast<size_t>(rows) * l1cols * 2));
      CHECK(cudaMalloc(&o16, static_cast<size_t>(rows) * kN * 2));
      CHECK(cudaMalloc(&w1d, w1.size() * 2));
      CHECK(cudaMalloc(&w2d, w2.size() * 2));
      CHECK(cudaMemcpy(w1d, w1.data(), w1.size() * 2, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(w2d, w2.data(), w2.size() * 2, cudaMemcpyHostToDevice));
      CHECK(cudaMemset(a16, 0, static_cast<size_t>(rows) * kK0 * 2));
      const float one = 1.f, zero = 0.f;
      auto gemms = [&] {   // row-major C = A B as column-major C^T = B^T A^T
        cublasGemmEx(hb, CUBLAS_OP_N, CUBLAS_OP_N, l1cols, static_cast<int>(rows), kK0, &one, w1d, CUDA_R_16F, l1cols,
                     a16, CUDA_R_16F, kK0, &zero, hmid, CUDA_R_16F, l1cols, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        cublasGemmEx(hb, CUBLAS_OP_N, CUBLAS_OP_N, kN, static_cast<int>(rows), kH, &one, w2d, CUDA_R_16F, kN,
                     hmid, CUDA_R_16F, kH, &zero, o16, CUDA_R_16F, kN, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      };
      blas = median_ms(gemms, 30, bt);
      CHECK(cudaFree(a16)); CHECK(cudaFree(hmid)); CHECK(cudaFree(o16)); CHECK(cudaFree(w1d)); CHECK(cudaFree(w2d));
      cublasDestroy(hb);
    }
#endif
    std::printf("%10lld %10.4f %9.1f %9.4f %9.2fx %9.2e %11.4f %s\n", static_cast<long long>(rows), ms,
                flops / (ms * 1e-3) / 1e12, floor_ms, ms / floor_ms, rel, blas, good ? "" : "  <-- WRONG");
    CHECK(cudaFree(dx));
    CHECK(cudaFree(dy));
  }
  CHECK(cudaFree(dimg));
  return ok ? 0 : 1;
}
