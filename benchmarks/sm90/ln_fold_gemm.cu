// Prototype for docs/DESIGN.md's "Planned: the LayerNorm folded into the first GEMM" (issue 16, ViT-B's
// block): is the folded form as fast and as accurate on the GPU as the wide design's norm pass + GEMM?
//
//   today:  norm pass (x fp16 -> LN(x) fp16 rows), then GEMM  D = gelu(xn W + b)        (bias + GELU EVT)
//   folded: stats pass (x -> rstd, shift = -rstd * mean per row, fp32), then
//           GEMM on x itself with W' = fp16(gamma * W):  D = gelu(rstd * acc + shift * colsum(W') + b')
//           with b' = beta W + b, as a CUTLASS 3.x EVT of two per-row operands (column broadcasts) and
//           two per-column ones (row broadcasts) ahead of the activation.
// Same CUTLASS kernel configuration as the wide design's choice for these rows (Pingpong128x128, fp16
// operands, fp32 accumulation), the same activation (the packed fp16 GELU of o2f_packed_act.cuh) and, as the
// wide design's instances do, NDEBUG (a live device assert makes ptxas serialize every wgmma: C7510). Prints each path's time (CUDA events, median of 50 runs) and each output's
// relative L2 distance from a float64 reference on sampled rows. Build and run: benchmarks/sm90/ln_fold.sh.
#ifndef NDEBUG
#define NDEBUG 1
#endif
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "o2f_packed_act.cuh"
#include "sm90_proto.cuh"

using namespace cute;
namespace fus = cutlass::epilogue::fusion;
using Elem = cutlass::half_t;
using CtaTile = Shape<_128, _128, _64>;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using Cluster = Shape<_1, _1, _1>;
constexpr int kAlign = 8;
constexpr float kEps = 1e-5f;

// The wide design's GELU for an fp16 hidden layer: pairs rounded to fp16, evaluated in fp16x2.
template <typename T>
struct Gelu {
  template <int N>
  __device__ __forceinline__ cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& a) const {
    static_assert(N % 2 == 0, "pairs");
    cutlass::Array<float, N> r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
      const float2 f = __half22float2(o2f_h2_gelu(__floats2half2_rn(a[i], a[i + 1])));
      r[i] = f.x;
      r[i + 1] = f.y;
    }
    return r;
  }
};

// ---- the two epilogues ----
using Today = fus::LinCombPerColBiasEltAct<Gelu, Elem, float, Elem, Elem, float, kAlign>;
using PerRow = fus::Sm90ColBroadcast<0, CtaTile, float, float, Stride<_1, _0, int64_t>>;   // one value per output row
using PerCol = fus::Sm90RowBroadcast<0, CtaTile, float, float, Stride<_0, _1, int64_t>>;   // one value per output column
using ShiftTerm = fus::Sm90EVT<fus::Sm90Compute<cutlass::homogeneous_multiply_add, float, float, kRound>, PerRow, PerCol, PerCol>;
using Folded = fus::Sm90EVT<fus::Sm90Compute<Gelu, Elem, float, kRound>,
                            fus::Sm90EVT<fus::Sm90Compute<cutlass::homogeneous_multiply_add, float, float, kRound>, PerRow,
                                         fus::Sm90AccFetch, ShiftTerm>>;

template <class Fusion>
struct Gemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, CtaTile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, cutlass::layout::RowMajor, kAlign, Elem, cutlass::layout::RowMajor, kAlign,
      cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, cutlass::layout::RowMajor, kAlign, Elem,
      cutlass::layout::ColumnMajor, kAlign, float, CtaTile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Op = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using K = typename Op::GemmKernel;

  template <typename Stride>
  static Stride packed(int64_t ld) {
    Stride st{};
    cute::get<0>(st) = ld;
    cute::get<2>(st) = 0;
    return st;
  }

  // a: [m, k] row-major; w: k x n column-major (n rows of k); d: [m, n] row-major
  static typename Op::Arguments arguments(int m, int n, int k, const Elem* a, const Elem* w, Elem* d) {
    cutlass::KernelHardwareInfo hw;
    CHECK(cudaGetDevice(&hw.device_id));
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    return typename Op::Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {m, n, k, 1},
                                  {a, packed<typename K::StrideA>(k), w, packed<typename K::StrideB>(k)},
                                  {{}, nullptr, packed<typename K::StrideC>(n), d, packed<typename K::StrideD>(n)},
                                  hw};
  }
};

// ---- the passes (one warp a row, K % 256 == 0: 8 halves a lane per step) ----
template <int K>
__device__ __forceinline__ void row_moments(const __half* row, int lane, float (&v)[K / 32], float& mean, float& rstd) {
  float s = 0.f, q = 0.f;
#pragma unroll
  for (int i = 0; i < K / 256; ++i) {
    const uint4 u = *reinterpret_cast<const uint4*>(row + 8 * (lane + 32 * i));
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      v[8 * i + 2 * j] = f.x;
      v[8 * i + 2 * j + 1] = f.y;
      s += f.x + f.y;
      q += f.x * f.x + f.y * f.y;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    q += __shfl_xor_sync(0xffffffffu, q, o);
  }
  mean = s / K;
  rstd = 1.0f / sqrtf(q / K - mean * mean + kEps);
}

template <int K>
__global__ void norm_rows(const __half* x, const float* gamma, const float* beta, __half* xn, int m) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= m) return;
  float v[K / 32], mean, rstd;
  row_moments<K>(x + static_cast<int64_t>(row) * K, lane, v, mean, rstd);
#pragma unroll
  for (int i = 0; i < K / 256; ++i) {
    __half2 out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = 8 * (lane + 32 * i) + 2 * j;
      out[j] = __floats2half2_rn((v[8 * i + 2 * j] - mean) * rstd * gamma[c] + beta[c],
                                 (v[8 * i + 2 * j + 1] - mean) * rstd * gamma[c + 1] + beta[c + 1]);
    }
    *reinterpret_cast<uint4*>(xn + static_cast<int64_t>(row) * K + 8 * (lane + 32 * i)) = *reinterpret_cast<uint4*>(out);
  }
}

template <int K>
__global__ void row_stats(const __half* x, float* rstd_out, float* shift_out, int m) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= m) return;
  float v[K / 32], mean, rstd;
  row_moments<K>(x + static_cast<int64_t>(row) * K, lane, v, mean, rstd);
  if (lane == 0) {
    rstd_out[row] = rstd;
    shift_out[row] = -rstd * mean;
  }
}

int main(int argc, char** argv) {
  constexpr int K = 768;
  const int M = argc > 1 ? std::atoi(argv[1]) : 16384, N = argc > 2 ? std::atoi(argv[2]) : 3072;
  const double row_mean = argc > 3 ? std::atof(argv[3]) : 0.0;   // rows' mean, in units of their spread
  std::mt19937 rng(0);
  std::normal_distribution<double> g(0.0, 1.0);
  std::vector<__half> x(static_cast<size_t>(M) * K), w(static_cast<size_t>(N) * K), wf(static_cast<size_t>(N) * K);
  std::vector<float> gamma(K), beta(K), bias(N), colsum(N), bias_f(N);
  std::vector<__half> bias_h(N);
  for (auto& v : x) v = __float2half(static_cast<float>(row_mean + g(rng)));
  for (int k = 0; k < K; ++k) gamma[k] = static_cast<float>(1 + 0.1 * g(rng)), beta[k] = static_cast<float>(0.1 * g(rng));
  std::vector<double> wd(static_cast<size_t>(N) * K);   // w[n][k]: column-major K x N
  for (auto& v : wd) v = g(rng) / std::sqrt(static_cast<double>(K));
  for (int n = 0; n < N; ++n) {
    bias[n] = static_cast<float>(0.1 * g(rng));
    double cs = 0, bb = bias[n];
    for (int k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(n) * K + k;
      w[i] = __float2half(static_cast<float>(wd[i]));
      wf[i] = __float2half(static_cast<float>(gamma[k] * wd[i]));
      cs += __half2float(wf[i]);
      bb += beta[k] * wd[i];
    }
    colsum[n] = static_cast<float>(cs);
    bias_f[n] = static_cast<float>(bb);
    bias_h[n] = __float2half(bias[n]);
  }

  __half *dx, *dxn, *dw, *dwf, *dbias_h, *dy_today, *dy_fold;
  float *dgamma, *dbeta, *dcolsum, *dbias_f, *drstd, *dshift;
  CHECK(cudaMalloc(&dx, x.size() * 2));
  CHECK(cudaMalloc(&dxn, x.size() * 2));
  CHECK(cudaMalloc(&dw, w.size() * 2));
  CHECK(cudaMalloc(&dwf, wf.size() * 2));
  CHECK(cudaMalloc(&dbias_h, N * 2));
  CHECK(cudaMalloc(&dy_today, static_cast<size_t>(M) * N * 2));
  CHECK(cudaMalloc(&dy_fold, static_cast<size_t>(M) * N * 2));
  CHECK(cudaMalloc(&dgamma, K * 4));
  CHECK(cudaMalloc(&dbeta, K * 4));
  CHECK(cudaMalloc(&dcolsum, N * 4));
  CHECK(cudaMalloc(&dbias_f, N * 4));
  CHECK(cudaMalloc(&drstd, M * 4));
  CHECK(cudaMalloc(&dshift, M * 4));
  CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dwf, wf.data(), wf.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dbias_h, bias_h.data(), N * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dgamma, gamma.data(), K * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dbeta, beta.data(), K * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dcolsum, colsum.data(), N * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dbias_f, bias_f.data(), N * 4, cudaMemcpyHostToDevice));

  using GT = Gemm<Today>;
  using GF = Gemm<Folded>;
  auto at = GT::arguments(M, N, K, reinterpret_cast<Elem*>(dxn), reinterpret_cast<Elem*>(dw), reinterpret_cast<Elem*>(dy_today));
  at.epilogue.thread.bias_ptr = reinterpret_cast<Elem*>(dbias_h);
  auto af = GF::arguments(M, N, K, reinterpret_cast<Elem*>(dx), reinterpret_cast<Elem*>(dwf), reinterpret_cast<Elem*>(dy_fold));
  // Folded's arguments: {{rstd, acc, {shift, colsum, bias'}, fma}, gelu}
  af.epilogue.thread = {{{drstd}, {}, {{dshift}, {dcolsum}, {dbias_f}, {}}, {}}, {}};
  typename GT::Op today;
  typename GF::Op folded;
  if (today.can_implement(at) != cutlass::Status::kSuccess || folded.can_implement(af) != cutlass::Status::kSuccess) {
    std::fprintf(stderr, "can_implement failed\n");
    return 1;
  }
  CHECK(today.initialize(at, nullptr) == cutlass::Status::kSuccess ? cudaSuccess : cudaErrorUnknown);
  CHECK(folded.initialize(af, nullptr) == cutlass::Status::kSuccess ? cudaSuccess : cudaErrorUnknown);
  const int warps = 8, blocks = (M + warps - 1) / warps;
  auto norm = [&] { norm_rows<K><<<blocks, 32 * warps>>>(dx, dgamma, dbeta, dxn, M); };
  auto stats = [&] { row_stats<K><<<blocks, 32 * warps>>>(dx, drstd, dshift, M); };
  auto gemm_today = [&] { CHECK(today.run() == cutlass::Status::kSuccess ? cudaSuccess : cudaErrorUnknown); };
  auto gemm_folded = [&] { CHECK(folded.run() == cutlass::Status::kSuccess ? cudaSuccess : cudaErrorUnknown); };

  const float t_norm = median_ms(norm), t_gemm = median_ms(gemm_today);
  const float t_today = median_ms([&] { norm(); gemm_today(); });
  const float t_stats = median_ms(stats), t_gemm_f = median_ms(gemm_folded);
  const float t_folded = median_ms([&] { stats(); gemm_folded(); });
  CHECK(cudaDeviceSynchronize());

  // float64 reference on sampled rows (exact GELU: both paths carry the tanh form's ~5e-4 gap at most)
  std::vector<__half> yt(static_cast<size_t>(M) * N), yf(static_cast<size_t>(M) * N);
  CHECK(cudaMemcpy(yt.data(), dy_today, yt.size() * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(yf.data(), dy_fold, yf.size() * 2, cudaMemcpyDeviceToHost));
  double e_today = 0, e_fold = 0, ref_sq = 0;
  for (int r = 0; r < M; r += std::max(1, M / 64)) {
    double s = 0, q = 0;
    for (int k = 0; k < K; ++k) {
      const double v = __half2float(x[static_cast<size_t>(r) * K + k]);
      s += v;
      q += v * v;
    }
    const double mean = s / K, rs = 1 / std::sqrt(q / K - mean * mean + kEps);
    for (int n = 0; n < N; ++n) {
      double a = bias[n];
      for (int k = 0; k < K; ++k)
        a += ((__half2float(x[static_cast<size_t>(r) * K + k]) - mean) * rs * gamma[k] + beta[k]) * wd[static_cast<size_t>(n) * K + k];
      const double ref = 0.5 * a * (1 + std::erf(a / std::sqrt(2.0)));
      const size_t i = static_cast<size_t>(r) * N + n;
      e_today += std::pow(__half2float(yt[i]) - ref, 2);
      e_fold += std::pow(__half2float(yf[i]) - ref, 2);
      ref_sq += ref * ref;
    }
  }
  std::printf("M %d, K %d, N %d, row mean %.1f (in units of the rows' spread)\n", M, K, N, row_mean);
  std::printf("today : norm pass %.4f ms + GEMM (bias + GELU) %.4f ms; together %.4f ms; rel. L2 %.2e\n", t_norm, t_gemm,
              t_today, std::sqrt(e_today / ref_sq));
  std::printf("folded: stats pass %.4f ms + GEMM (folded EVT) %.4f ms; together %.4f ms; rel. L2 %.2e\n", t_stats, t_gemm_f,
              t_folded, std::sqrt(e_fold / ref_sq));
  return 0;
}
