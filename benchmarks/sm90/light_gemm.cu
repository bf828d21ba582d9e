// The wide design's own Hopper GEMM (templates/o2f_light_gemm.cuh, plan.sm90's Light128x128) run alone,
// outside ORT: D = gelu(A W^T + b) as a hidden fp16 layer computes it (the packed fp16x2 GELU of
// o2f_packed_act.cuh), fp16 operands, bias and output, fp32 accumulation; time, TFLOP/s and error against
// float64 on sampled rows, beside cuBLAS's GEMM alone (no bias, no GELU) on the same operands.
// docs/DESIGN.md, "A Hopper GEMM of our own"; benchmarks/RESULTS.md, eighteenth run (where this file also
// measured the steps that led to the kernel, and a variant with clusters of two that was not kept, at
// commit 206a83e).
//
// Build and run: benchmarks/sm90/light_gemm.sh (gpu_host.sh lightgemm). No arguments: every case.
// `light_gemm M K N [RASTER]`: that fp16 case only (for a profiler). `light_gemm sweep`: GELU against no
// activation and K from 768 to 3072 (where the time goes). The kernel needs no CUTLASS and no cuBLAS; the host
// links cuBLAS, where the toolkit has it, for the reference only.
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define O2F_WITH_CUBLAS 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "o2f_packed_act.cuh"
#include "o2f_wide_launch.cuh"
#include "sm90_proto.cuh"

namespace bench {
// A hidden fp16 layer's epilogue activation, as cuda_wide_light.cu.j2 renders it for GELU.
struct PairAct {
  __device__ __forceinline__ float2 operator()(float a, float b) const {
    return __half22float2(o2f_h2_gelu(__floats2half2_rn(a, b)));
  }
  __device__ __forceinline__ uint32_t packed(float a, float b) const {
    const __half2 h = o2f_h2_gelu(__floats2half2_rn(a, b));
    return *reinterpret_cast<const uint32_t*>(&h);
  }
};
// The same GELU without the packed store (the epilogue before it: the result back to fp32, then fp16).
struct RoundTripAct {
  __device__ __forceinline__ float2 operator()(float a, float b) const {
    return __half22float2(o2f_h2_gelu(__floats2half2_rn(a, b)));
  }
};
// No activation: what the epilogue's GELU costs (the sweep mode).
struct IdentityAct {
  __device__ __forceinline__ float2 operator()(float a, float b) const { return make_float2(a, b); }
};
#include "o2f_light_gemm.cuh"
}  // namespace bench

static double gelu_ref(double a) { return 0.5 * a * (1 + std::erf(a / std::sqrt(2.0))); }

// One case: the library's launcher, medians of 20 samples of 10 launches; raster as plan.sm90.RASTERS
// (0: the order by operand size, the default; 1 down the rows; 2 across the columns). Elem: __half, or
// float (the tf32 form, a first layer reading fp32 rows in place; its weights rounded to tf32 on the host
// as the library's fp32 copy is, its input read as it is: the tensor cores take the top 19 bits).
// Act: the epilogue's activation (PairAct: GELU, stored packed); Out: D's type (__half or float).
template <typename Elem, class Act = bench::PairAct, typename Out = __half>
static void run_case(int m, int k, int n, const o2f_wide::DeviceInfo& dev, int raster = 0) {
  constexpr bool kTf32 = std::is_same_v<Elem, float>;
  auto to_elem = [](float v) { if constexpr (kTf32) return v; else return __float2half(v); };
  auto to_float = [](Elem v) { if constexpr (kTf32) return v; else return __half2float(v); };
  auto tf32_round = [](float v) {   // to nearest, ties away (the library's copy: ties to even)
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = (u + 0x1000u) & ~0x1FFFu;
    std::memcpy(&v, &u, 4);
    return v;
  };
  auto tf32_trunc = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u &= ~0x1FFFu;
    std::memcpy(&v, &u, 4);
    return v;
  };
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<Elem> a(static_cast<size_t>(m) * k), w(static_cast<size_t>(n) * k);
  constexpr bool kOut32 = std::is_same_v<Out, float>;
  auto to_out = [](float v) { if constexpr (kOut32) return v; else return __float2half(v); };
  auto out_float = [](Out v) { if constexpr (kOut32) return v; else return __half2float(v); };
  std::vector<Out> bias(n);
  for (auto& v : a) v = to_elem(g(rng));
  for (auto& v : w) v = to_elem(kTf32 ? tf32_round(g(rng) / std::sqrt(static_cast<float>(k))) : g(rng) / std::sqrt(static_cast<float>(k)));
  for (auto& v : bias) v = to_out(0.1f * g(rng));
  Elem *da, *dw;
  Out *dd, *db;
  CHECK(cudaMalloc(&da, a.size() * sizeof(Elem)));
  CHECK(cudaMalloc(&dw, w.size() * sizeof(Elem)));
  CHECK(cudaMalloc(&dd, static_cast<size_t>(m) * n * sizeof(Out)));
  CHECK(cudaMalloc(&db, n * sizeof(Out)));
  CHECK(cudaMemcpy(da, a.data(), a.size() * sizeof(Elem), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dw, w.data(), w.size() * sizeof(Elem), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, bias.data(), n * sizeof(Out), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dd, 0xff, static_cast<size_t>(m) * n * sizeof(Out)));   // NaN: an unwritten element shows
  const o2f_wide::Choice choice{0, 0, 1, 1, raster};
  auto launch = [&] {
    const cudaError_t e = bench::o2f_light::run<Elem, Out, Act, false>(dev, choice, m, n, k, da, dw,
                                                                                           db, nullptr, dd, n, nullptr);
    CHECK(e);
  };
  launch();
  CHECK(cudaDeviceSynchronize());
  std::vector<Out> out(static_cast<size_t>(m) * n);
  CHECK(cudaMemcpy(out.data(), dd, out.size() * sizeof(Out), cudaMemcpyDeviceToHost));
  double err = 0, ref_sq = 0, worst = 0;
  int nan = 0, worst_r = -1, worst_c = -1;
  float worst_got = 0.f, worst_ref = 0.f;
  std::vector<int> rows;   // 64 rows spread over the batch, the last one among them
  for (int r = 0; r < m; r += std::max(1, m / 64)) rows.push_back(r);
  if (rows.back() != m - 1) rows.push_back(m - 1);
  for (int r : rows) {
    for (int j = 0; j < n; ++j) {
      double acc = out_float(bias[j]);
      for (int q = 0; q < k; ++q) {
        const float x = to_float(a[static_cast<size_t>(r) * k + q]);
        acc += static_cast<double>(kTf32 ? tf32_trunc(x) : x) * to_float(w[static_cast<size_t>(j) * k + q]);
      }
      constexpr bool kGelu = !std::is_same_v<Act, bench::IdentityAct>;
      const double ref = kGelu ? gelu_ref(acc) : static_cast<double>(out_float(to_out(static_cast<float>(acc))));
      const double got = out_float(out[static_cast<size_t>(r) * n + j]);
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
  const cudaDataType_t ab = kTf32 ? CUDA_R_32F : CUDA_R_16F;
  // fp32 operands take an fp32 D in cuBLAS (it refuses fp32 x fp32 -> fp16, at once, which once read as
  // a 0.1 us GEMM): a buffer of its own there
  const bool d32 = kOut32 || kTf32;
  void* dblas = dd;
  if (d32 && !kOut32) CHECK(cudaMalloc(&dblas, static_cast<size_t>(m) * n * 4));
  auto blas_call = [&] {
    return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, dw, ab, k, da, ab, k, &zero, dblas,
                        d32 ? CUDA_R_32F : CUDA_R_16F, n, kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
  };
  if (blas_call() == CUBLAS_STATUS_SUCCESS) ms_blas = median_ms([&] { blas_call(); }, 20, 10);
  if (dblas != dd) CHECK(cudaFree(dblas));
  cublasDestroy(h);
#endif
  auto tflops = [&](double t) { return 2.0 * m * k * n / (t * 1e-3) / 1e12; };
  std::printf("%s%s%s M %d, K %d, N %d, raster %d: %.4f ms, %.0f TFLOP/s (cuBLAS GEMM alone %.4f ms, %.0f TFLOP/s), rel. L2 "
              "%.2e, NaN %d (sampled rows); furthest off: (%d, %d) %.5f against %.5f\n", kTf32 ? "tf32" : "fp16", kOut32 ? " fp32-out" : "",
              std::is_same_v<Act, bench::PairAct> ? "" : std::is_same_v<Act, bench::IdentityAct> ? " identity" : " round-trip", m, k, n, raster, ms, tflops(ms), ms_blas,
              tflops(ms_blas), std::sqrt(err / ref_sq), nan, worst_r, worst_c, worst_got, worst_ref);
  CHECK(cudaFree(da));
  CHECK(cudaFree(dw));
  CHECK(cudaFree(dd));
  CHECK(cudaFree(db));
}

int main(int argc, char** argv) {
  o2f_wide::DeviceInfo dev;
  CHECK(cudaGetDevice(&dev.id));
  CHECK(cudaDeviceGetAttribute(&dev.sms, cudaDevAttrMultiProcessorCount, dev.id));
  dev.sm90 = true;
  if (argc == 2 && std::strcmp(argv[1], "sweep") == 0) {
    // where the time of ViT-B's GEMMs goes: the epilogue's GELU (identity beside it) and the mainloop's
    // length (K from 768 to 3072 at ViT-B's 3072 columns), every case beside cuBLAS
    for (int k : {768, 1536, 3072}) {
      run_case<__half>(16384, k, 3072, dev);
      run_case<__half, bench::RoundTripAct>(16384, k, 3072, dev);
      run_case<__half, bench::IdentityAct>(16384, k, 3072, dev);
    }
    run_case<__half, bench::IdentityAct>(16384, 3072, 768, dev);
    run_case<__half, bench::IdentityAct, float>(16384, 3072, 768, dev);
    return 0;
  }
  if (argc == 4 || argc == 5) {
    run_case<__half>(std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3]), dev, argc == 5 ? std::atoi(argv[4]) : 0);
    return 0;
  }
  run_case<__half>(128, 64, 128, dev);       // one tile, one k-block: the swizzle, the descriptors, the fragment layout
  run_case<__half>(256, 320, 384, dev);      // six tiles of five k-blocks through five slots (the ring wraps), both consumers
  run_case<__half>(16384, 768, 3072, dev);   // ViT-B's first GEMM (CUTLASS Pingpong128x128: 131.1 us, seventeenth run)
  run_case<__half>(16384, 3072, 768, dev);   // its second (without the residual)
  run_case<__half>(4096, 784, 512, dev);     // mnist's first layer
  run_case<__half>(1000, 776, 520, dev);     // tails in every dimension (K % 64, M % 128, N % 128)
  // fp32 D (a last layer's output, staged one m64 half at a time): the tails, then the FFN case's second
  // GEMM, 16384 x 3072 -> 768 (its direct float2 stores made it 18% slower than CUTLASS through ORT)
  run_case<__half, bench::PairAct, float>(1000, 776, 520, dev);
  run_case<__half, bench::IdentityAct, float>(16384, 3072, 768, dev);
  // the tf32 form (not in the library's kernel list yet): one tile, the ring wrapping with tails, mnist's
  // first layer and DLRM's (512 -> 256 at 65536 rows, where the library reads fp32 in place today)
  run_case<float>(128, 32, 128, dev);
  run_case<float>(1000, 780, 520, dev);
  run_case<float>(4096, 784, 512, dev);
  run_case<float>(65536, 512, 256, dev);
  return 0;
}
