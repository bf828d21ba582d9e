// o2f_wide_tune_timing.cuh: the tuning build's timing of every candidate kernel on one layer's GEMM.
// Static code included inside the generated source's namespace o2f_<chain>, after Choice, kDefault, kTf32Kernel, kCandidates and count_mismatches.
#pragma once
struct TuneBuffers {
  elem_t* a = nullptr;      // the GEMM input, kRowBlock x (widest K)
  char* d = nullptr;        // a candidate's output
  char* ref = nullptr;      // the default kernel's output
  unsigned* bad = nullptr;
};

// Mean time of `reps` calls of f() on stream s, after one warm call.
template <typename F>
cudaError_t time_reps(F f, int reps, cudaStream_t s, float* ms) {
  cudaEvent_t t0, t1;
  cudaError_t err = f();
  if (err != cudaSuccess) return err;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0, s);
  for (int r = 0; r < reps && err == cudaSuccess; ++r) err = f();
  cudaEventRecord(t1, s);
  float t = 0.0f;
  if (err == cudaSuccess) err = cudaEventSynchronize(t1);
  if (err == cudaSuccess) err = cudaEventElapsedTime(&t, t0, t1);
  *ms = t / reps;
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return err;
}

// Times every candidate on one layer's GEMM at m rows; writes the fastest that matches the default
// kernel's output (the default itself always qualifies) and its time, and every candidate's time to
// all_ms (-1: cannot run this shape, -2: wrong output).
template <typename Out, typename Launch>
cudaError_t tune_layer(Launch launch, int m, int n, const TuneBuffers& tb, int reps, cudaStream_t s,
                       int* best_index, float* best_ms, float* all_ms, bool allow_tf32) {
  cudaError_t err = launch(kDefault, reinterpret_cast<Out*>(tb.ref));
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) return err;
  *best_index = -1;
  *best_ms = 3.4e38f;
  const int64_t count = static_cast<int64_t>(m) * n;
  for (int ci = 0; ci < kNumCandidates; ++ci) {
    Out* d = reinterpret_cast<Out*>(tb.d);
    all_ms[ci] = -1.0f;
    if (kTf32Kernel[kCandidates[ci].kernel] && !allow_tf32) continue;  // tf32: a first layer's only
    if (launch(kCandidates[ci], d) != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess) {
      cudaGetLastError();  // a configuration that cannot run this shape: skip it
      continue;
    }
    unsigned bad = 0;
    cudaMemsetAsync(tb.bad, 0, sizeof(unsigned), s);
    count_mismatches<Out><<<256, 256, 0, s>>>(d, reinterpret_cast<const Out*>(tb.ref), count, tb.bad);
    cudaMemcpyAsync(&bad, tb.bad, sizeof(unsigned), cudaMemcpyDeviceToHost, s);
    all_ms[ci] = -2.0f;
    if (cudaStreamSynchronize(s) != cudaSuccess || bad != 0) continue;
    float ms = 0.0f;
    if (time_reps([&] { return launch(kCandidates[ci], d); }, reps, s, &ms) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    all_ms[ci] = ms;
    if (ms < *best_ms) {
      *best_ms = ms;
      *best_index = ci;
    }
  }
  return cudaGetLastError();
}
