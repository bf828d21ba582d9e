// o2f_wide_tune_fill.cuh: the tuning build's pseudo-random fill and its output comparison kernels.
// Static device code included inside the generated source's namespace o2f_<chain>.
#pragma once
// Deterministic pseudo-random fill in [-scale, scale): weights, biases and inputs of the timed GEMMs.
template <typename T>
__global__ void fill_uniform(T* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    p[i] = T((static_cast<float>(h >> 8) * (1.0f / 8388608.0f) - 1.0f) * scale);
  }
}

// Counts the outputs of a candidate that differ from the default kernel's by more than a split-K
// reordering of fp32 sums can explain once rounded to the output type (NaN counts as different): ~5 ulps
// of bf16 (a gated layer's act(g) * u compounds the roundings of g, u and the product: 1 ulp of each is
// ~1.2 % of a bf16 result), 1 % otherwise.
template <typename T>
__global__ void count_mismatches(const T* d, const T* ref, int64_t n, unsigned* bad) {
  constexpr float kTol = std::is_same<T, cutlass::bfloat16_t>::value ? 4e-2f : 1e-2f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float a = static_cast<float>(d[i]), r = static_cast<float>(ref[i]);
    if (!(fabsf(a - r) <= kTol * (1.0f + fabsf(r)))) atomicAdd(bad, 1u);
  }
}
