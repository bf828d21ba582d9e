// benchmarks/ffn_unit_main.cu: the program benchmarks/ffn_unit_check.py builds around one rendered FFN unit
// (unit_name.h includes it and names its namespace FFN_UNIT_NS). Random fp32 weights and biases are packed by
// the unit's own pack(); each batch of random fp32 rows runs through its run() once and is checked on 48
// sampled rows against a float64 reference of the unrounded weights (act: REF_SILU gated, REF_GELU erf, else
// ReLU), then timed: medians of 30 samples of 10 launches (CUDA events). Usage: ffn_unit ROWS...
#include "unit_name.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace U = FFN_UNIT_NS;

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));               \
      return 2;                                                                    \
    }                                                                              \
  } while (0)

static double act_ref(double v) {
#if defined(REF_SILU)
  return v / (1.0 + std::exp(-v));
#elif defined(REF_GELU)
  return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
#else
  return v > 0 ? v : 0.0;
#endif
}

template <typename T>
static T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

int main(int argc, char** argv) {
  std::vector<long long> batches;
  for (int i = 1; i < argc; ++i) batches.push_back(std::atoll(argv[i]));
  if (batches.empty()) batches = {262144};
  constexpr int K0 = U::kK0, H = U::kH, N = U::kN, L1 = U::kGated ? 2 * H : H;
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  // y = x @ W: W0 [K0, L1] (gated: gate columns, then up), W1 [H, N]
  std::vector<float> w0(static_cast<size_t>(K0) * L1), b0(L1), w1(static_cast<size_t>(H) * N), b1(N);
  for (auto& v : w0) v = nd(rng) / std::sqrt(float(K0));
  for (auto& v : b0) v = 0.1f * nd(rng);
  for (auto& v : w1) v = nd(rng) / std::sqrt(float(H));
  for (auto& v : b1) v = 0.1f * nd(rng);
  float *dw0 = to_device(w0), *db0 = to_device(b0), *dw1 = to_device(w1), *db1 = to_device(b1);
  void* ws = nullptr;
  CHECK(cudaMalloc(&ws, U::kBiasOffset + 4 * U::kNP));
  CHECK(U::pack(dw0, db0, dw1, db1, ws, 0));
  CHECK(cudaDeviceSynchronize());
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs; FFN %d -> %s%d -> %d (the library's unit), fp32 rows\n", prop.name, sms, K0,
              U::kGated ? "gated " : "", H, N);
  std::printf("%10s %10s %9s %10s\n", "rows", "ms", "TFLOP/s", "rel.L2");
  for (long long rows : batches) {
    std::vector<float> x(static_cast<size_t>(rows) * K0), y(static_cast<size_t>(rows) * N);
    for (auto& v : x) v = nd(rng);
    float* dx = to_device(x);
    float* dy = nullptr;
    CHECK(cudaMalloc(&dy, std::max<size_t>(1, y.size()) * 4));
    CHECK(U::run(dev, sms, dx, dy, rows, ws, 0));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    std::vector<double> hid(H);
    for (int s = 0; s < 48 && s < rows; ++s) {
      const long long r = rows <= 48 ? s : (static_cast<long long>(s) * 7919 * 104729) % rows;
      const float* xr = x.data() + r * K0;
      for (int j = 0; j < H; ++j) {
        double a = b0[j], u = U::kGated ? b0[H + j] : 0.0;
        for (int k = 0; k < K0; ++k) {
          a += double(xr[k]) * w0[static_cast<size_t>(k) * L1 + j];
          if (U::kGated) u += double(xr[k]) * w0[static_cast<size_t>(k) * L1 + H + j];
        }
        hid[j] = U::kGated ? act_ref(a) * u : act_ref(a);
      }
      for (int n = 0; n < N; ++n) {
        double ref = b1[n];
        for (int j = 0; j < H; ++j) ref += hid[j] * w1[static_cast<size_t>(j) * N + n];
        const double d = y[r * N + n] - ref;
        num += d * d;
        den += ref * ref;
      }
    }
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 10; ++i) CHECK(U::run(dev, sms, dx, dy, rows, ws, 0));   // warm-up
    std::vector<float> ms;
    for (int sample = 0; sample < 30; ++sample) {
      CHECK(cudaEventRecord(a));
      for (int i = 0; i < 10; ++i) CHECK(U::run(dev, sms, dx, dy, rows, ws, 0));
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t / 10);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double flops = 2.0 * rows * (double(K0) * L1 + double(H) * N);
    std::printf("%10lld %10.4f %9.1f %10.2e\n", rows, med, flops / (med * 1e-3) / 1e12, std::sqrt(num / den));
    cudaFree(dx);
    cudaFree(dy);
  }
  return 0;
}
