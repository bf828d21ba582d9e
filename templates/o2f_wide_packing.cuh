// o2f_wide_packing.cuh: the wide design's weight and bias packing (n-major, padded; an fp32 copy rounded
// to tf32 for an in-place first layer). Static code included inside the generated source's namespace o2f_<chain>, after elem_t.
#pragma once
// Packing, once per session: W [K, N] fp32 (y = x @ W; rows `ldw` apart: N, or 2N for a gated layer's
// half) -> dst [NP][KP] n-major, zeros outside [N, K]. A 32 x 32 tile goes through shared memory so both
// the reads of W and the writes are coalesced.
template <typename T>
__global__ void pack_weights(const float* __restrict__ w, T* __restrict__ dst, int K, int N, int KP, int NP, int ldw) {
  __shared__ float tile[32][33];
  const int k0 = blockIdx.x * 32, n0 = blockIdx.y * 32;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {  // r: k offset, threadIdx.x: n offset
    const int k = k0 + r, n = n0 + threadIdx.x;
    tile[r][threadIdx.x] = (k < K && n < N) ? w[static_cast<int64_t>(k) * ldw + n] : 0.0f;
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {  // r: n offset, threadIdx.x: k offset
    const int n = n0 + r, k = k0 + threadIdx.x;
    if (n < NP && k < KP) dst[static_cast<int64_t>(n) * KP + k] = T(tile[threadIdx.x][r]);
  }
}

// Round to tf32 (10 mantissa bits, to nearest even) so the tensor cores, which read the top 19 bits of
// each fp32 operand, see the weights rounded rather than truncated.
__device__ __forceinline__ float round_tf32(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
  return __uint_as_float(u);
}

struct Tf32 {  // the packing kernel's output type for the fp32 copy: a float, rounded
  float v;
  __device__ explicit Tf32(float f) : v(round_tf32(f)) {}
};
static_assert(sizeof(Tf32) == sizeof(float), "Tf32 is a float");

template <typename T>
__global__ void pack_bias(const float* __restrict__ b, T* __restrict__ dst, int N, int NP) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < NP) dst[i] = T(i < N ? b[i] : 0.0f);
}

template <typename T>
cudaError_t pack_layer(const float* w, const float* b, char* ws, size_t w_off, size_t b_off, int K, int N, int KP,
                       int NP, cudaStream_t s) {
  const dim3 grid((KP + 31) / 32, (NP + 31) / 32), block(32, 8);
  pack_weights<elem_t><<<grid, block, 0, s>>>(w, reinterpret_cast<elem_t*>(ws + w_off), K, N, KP, NP, N);
  pack_bias<T><<<(NP + 255) / 256, 256, 0, s>>>(b, reinterpret_cast<T*>(ws + b_off), N, NP);
  return cudaGetLastError();
}

// A gated layer (W [K, 2N], bias [2N]: gate columns, then up) as one GEMM of 2 * NP columns: the gate
// half into packed rows [0, NP), the up half into [NP, 2NP), each padded with zeros.
template <typename T>
cudaError_t pack_gated_layer(const float* w, const float* b, char* ws, size_t w_off, size_t b_off, int K, int N,
                             int KP, int NP, cudaStream_t s) {
  const dim3 grid((KP + 31) / 32, (NP + 31) / 32), block(32, 8);
  for (int part = 0; part < 2; ++part) {
    pack_weights<elem_t><<<grid, block, 0, s>>>(w + part * N, reinterpret_cast<elem_t*>(ws + w_off) + int64_t(part) * NP * KP,
                                                K, N, KP, NP, 2 * N);
    pack_bias<T><<<(NP + 255) / 256, 256, 0, s>>>(b + part * N, reinterpret_cast<T*>(ws + b_off) + part * NP, N, NP);
  }
  return cudaGetLastError();
}
