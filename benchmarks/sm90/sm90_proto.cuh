// sm90_proto.cuh: what the standalone sm_90a prototypes here share (fused_wgmma.cu, light_gemm.cu,
// ln_fold_gemm.cu): CUDA error checks and event timing on the host; shared-memory addresses, mbarriers
// and wgmma group control on the device (templates/o2f_sm90_ptx.cuh, the library's). Each prototype
// builds alone (its .sh script).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// The median (ms per call) of `reps` samples after 5 warm-up calls; each sample times `batch` calls of f()
// back to back with CUDA events. batch 1 includes the host's launch latency in every sample (a few us);
// a larger batch measures what the GPU spends, as a stream of launches (ORT's) sees it.
template <class F>
static float median_ms(F&& f, int reps = 50, int batch = 1) {
  for (int i = 0; i < 5; ++i) f();
  CHECK(cudaDeviceSynchronize());
  std::vector<float> t;
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    for (int j = 0; j < batch; ++j) f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / batch);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// shared-memory addresses, mbarriers, wgmma group control: the library's own (the wgmma design's and the
// light GEMM's)
#include "../../templates/o2f_sm90_ptx.cuh"

// Pins a register's value at this point of the instruction stream (CuTe's warpgroup_fence_operand):
// the compiler may not move reads of an accumulator above the wait that makes it valid, nor writes
// below the wgmma that uses it.
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_reg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
