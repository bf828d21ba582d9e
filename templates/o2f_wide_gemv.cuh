// o2f_wide_gemv.cuh: the wide design's GEMV path (plan/wide.py): a pass of at most kGemvRows rows runs
// each layer as one weight-streaming kernel instead of a CUTLASS GEMM, whose 128-row tiles would be mostly
// padding while the pass's cost is reading every weight once anyway. Static code included inside the
// generated source's namespace o2f_<chain>, after elem_t, elem_raw, io_t, DeviceInfo and kGemvRows.
//
// One warp per output column (a gated layer: per gate and up column pair): the column's KP weights are
// contiguous (n-major packing), so the lanes stream them as 16-byte vectors, 32 lanes apart, kGemvUnroll
// vectors in flight per lane, bypassing L1 (each weight is read once); the pass's m activation rows are
// re-read for every column and stay in L1/L2. Each lane accumulates its share of the m dot products in fp32,
// a butterfly shuffle sums them over the warp, and lane r applies bias and activation to row r and stores
// it. The roundings are the GEMM path's: the first layer's input to the compute type (the conversion pass),
// a gated layer's gate and up products to 16 bits before act(gate) * up (its GEMM writes them to the gate
// buffer), each output once.
#pragma once
#include <type_traits>
#include "o2f_wide_half2.cuh"

constexpr int kGemvWarps = 8;                  // warps (output columns at a time) per block
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvUnroll = 4;                 // weight vectors in flight per lane and column
constexpr int kGemvBlocksPerSm = 16;           // grid cap: a few waves of resident blocks, then grid-stride
static_assert(kGemvRows >= 1 && kGemvRows <= 32, "lane r stores row r of the pass");

// The raw 16-bit type of a CUTLASS element type (same bits), for the vector unpacking.
template <typename T> struct GemvRaw;
template <> struct GemvRaw<cutlass::half_t> { using type = __half; };
template <> struct GemvRaw<cutlass::bfloat16_t> { using type = __nv_bfloat16; };

// Eight 16-bit values (one 16-byte vector) of raw type R as floats.
template <typename R>
__device__ __forceinline__ void gemv_unpack8(const uint4& q, float (&v)[8]) {
  const o2f_pair_t<R>* p = reinterpret_cast<const o2f_pair_t<R>*>(&q);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = o2f_float2(p[j]);
    v[2 * j] = f.x;
    v[2 * j + 1] = f.y;
  }
}

// v rounded to the compute type (round to nearest even), as a float: what the conversion pass writes, and
// what a 16-bit tensor of the GEMM path holds.
__device__ __forceinline__ float gemv_round(float v) {
  if constexpr (std::is_same<elem_raw, __half>::value) return __half2float(__float2half_rn(v));
  else return __bfloat162float(__float2bfloat16_rn(v));
}

// A weight vector, read once: no L1 allocation, so the activation rows keep L1.
__device__ __forceinline__ uint4 gemv_load_weights(const uint4* p) {
  uint4 q;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w) : "l"(p));
  return q;
}

// Activations [k, k + 8) of one input row as floats, rounded to the compute type as the GEMM path's operand
// is. kVec: one 16-byte load (two for fp32) at a 16-byte aligned k of a row of at least k + 8 columns;
// else scalar loads, zero from column k_true on (an input row of K0 columns, K0 not a multiple of 8).
template <typename In, bool kVec>
__device__ __forceinline__ void gemv_load8(const In* __restrict__ row, int k, int k_true, float (&v)[8]) {
  constexpr bool kExact = std::is_same<In, elem_t>::value;  // already the compute type: no rounding
  if constexpr (kVec && std::is_same<In, float>::value) {
    const float4 lo = __ldg(reinterpret_cast<const float4*>(row + k));
    const float4 hi = __ldg(reinterpret_cast<const float4*>(row + k) + 1);
    v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w; v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
  } else if constexpr (kVec) {
    gemv_unpack8<typename GemvRaw<In>::type>(__ldg(reinterpret_cast<const uint4*>(row + k)), v);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = k + j < k_true ? static_cast<float>(row[k + j]) : 0.0f;
  }
  if constexpr (!kExact) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = gemv_round(v[j]);
  }
}

// One layer on m <= kGemvRows rows: a (m rows of lda, K columns of which k_true are real), w [*][kp]
// n-major. kCols = 1: out[r][c] = act(a[r] . w[c] + bias[c]) for c < columns. kCols = 2 (gated, second =
// NP): out[r][c] = act(g) * u, g = a[r] . w[c] + bias[c], u = a[r] . w[second + c] + bias[second + c],
// each rounded to the compute type. d rows are ldd apart.
template <template <typename> class Act, int kCols, typename In, bool kVec, typename Out>
__global__ void __launch_bounds__(kGemvThreads)
gemv_layer(const In* __restrict__ a, int lda, int k_true, const elem_t* __restrict__ w, int kp, int second,
           const Out* __restrict__ bias, Out* __restrict__ d, int ldd, int columns, int m) {
  static_assert(kCols == 1 || kCols == 2, "a column, or a gate and up column pair");
  const int lane = threadIdx.x & 31;
  const int vecs = kp / 8;  // kp is a multiple of 8 (ALIGN)
  const Act<float> act;
  for (int col = blockIdx.x * kGemvWarps + threadIdx.x / 32; col < columns; col += gridDim.x * kGemvWarps) {
    const uint4* wrow[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      wrow[c] = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(col + c * second) * kp);
    float acc[kCols][kGemvRows];
#pragma unroll
    for (int c = 0; c < kCols; ++c)
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) acc[c][r] = 0.0f;

    for (int v0 = lane; v0 < vecs; v0 += 32 * kGemvUnroll) {
      uint4 wq[kGemvUnroll][kCols];  // all loads first: kGemvUnroll * kCols vectors in flight
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u)
#pragma unroll
        for (int c = 0; c < kCols; ++c)
          wq[u][c] = v0 + 32 * u < vecs ? gemv_load_weights(wrow[c] + v0 + 32 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u) {
        const int v = v0 + 32 * u;
        if (v >= vecs) break;
        float wf[kCols][8];
#pragma unroll
        for (int c = 0; c < kCols; ++c) gemv_unpack8<elem_raw>(wq[u][c], wf[c]);
#pragma unroll
        for (int r = 0; r < kGemvRows; ++r) {
          if (r >= m) break;  // uniform over the warp
          float x[8];
          gemv_load8<In, kVec>(a + static_cast<int64_t>(r) * lda, 8 * v, k_true, x);
#pragma unroll
          for (int c = 0; c < kCols; ++c)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[c][r] = fmaf(x[j], wf[c][j], acc[c][r]);
        }
      }
    }

    // Butterfly: every lane ends with the warp's sums (all lanes take part: m and col are warp-uniform).
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      if (r >= m) break;
#pragma unroll
      for (int c = 0; c < kCols; ++c)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[c][r] += __shfl_xor_sync(0xffffffffu, acc[c][r], off);
    }
    // Lane r stores row r: the m stores go out in one instruction, not m of lane 0's.
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      if (r < m && lane == r) {
        Out* out = d + static_cast<int64_t>(r) * ldd + col;
        if constexpr (kCols == 1) {
          *out = Out(act(acc[0][r] + static_cast<float>(bias[col])));
        } else {
          const float g = gemv_round(acc[0][r] + static_cast<float>(bias[col]));
          const float up = gemv_round(acc[1][r] + static_cast<float>(bias[second + col]));
          *out = Out(__fmul_rn(act(g), up));
        }
      }
    }
  }
}

// Launches one layer: a warp per output column (`columns`: NP, or a gated layer's NP pairs). The 16-byte
// activation loads where the rows allow them: every column of [0, kp) real (k_true == kp) and rows 16-byte
// aligned (always for the hidden buffers; the caller's x when K0 is a multiple of 8 and its base is
// aligned), else the scalar ones.
template <template <typename> class Act, int kCols, typename In, typename Out>
cudaError_t gemv(const DeviceInfo& dev, int m, const In* a, int lda, int k_true, const elem_t* w, int kp, int second,
                 const Out* bias, Out* d, int ldd, int columns, cudaStream_t s) {
  const int want = (columns + kGemvWarps - 1) / kGemvWarps;
  const int blocks = want < kGemvBlocksPerSm * dev.sms ? want : kGemvBlocksPerSm * dev.sms;
  const bool vec = k_true == kp && lda % 8 == 0 && (reinterpret_cast<uintptr_t>(a) & 15u) == 0;
  if (vec)
    gemv_layer<Act, kCols, In, true, Out><<<blocks, kGemvThreads, 0, s>>>(a, lda, k_true, w, kp, second, bias, d,
                                                                        ldd, columns, m);
  else
    gemv_layer<Act, kCols, In, false, Out><<<blocks, kGemvThreads, 0, s>>>(a, lda, k_true, w, kp, second, bias, d,
                                                                         ldd, columns, m);
  return cudaGetLastError();
}
