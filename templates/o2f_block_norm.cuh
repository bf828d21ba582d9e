// o2f_block_norm.cuh: a transformer block's prologue in the tensor-core fused kernels (resident, streamed):
// each input row normalised in fp32 while it is loaded and converted to the operand type. Static device
// code included inside the generated kernel's anonymous namespace, only by chains with a norm in front,
// after elem_t, to_elem, store2, the o2f_fused_io helpers and the norm's constants kNormK0 (true features),
// kNormKP0 (padded), kNormEps, kNormLayer, kNormBias, kNormRoundHalf and kNormBiasOffset.
//
// The arithmetic is the CPU kernel's (templates/cpu_kernel.cc.j2, normalise_rows), ONNX Runtime's CPU one,
// except that a layer norm multiplies by the row's 1 / sqrt(...) where the CPU divides by sqrt(...), as
// ONNX Runtime's CUDA kernel does:
//   layer norm: (x - mean) * (1 / sqrt(mean((x - mean)^2) + eps)) * scale + bias   (LayerNormalization)
//   RMS norm:   x * (1 / sqrt(mean(x^2) + eps)) * scale                           (the exporters' RMSNorm ops)
// in fp32 with IEEE-rounded operations (no contraction into FMAs), so each value differs from the CPU
// kernel's by the order of the row's sums and, for a layer norm, at most an ulp or so of fp32 before its
// rounding to 16 bits. A layer norm's variance is that of the deviations from the mean (two passes over a
// row held in registers; a wider row, read again for the writes, sums x - s in one, s its first value):
// mean(x^2) - mean^2 cancelled in fp32 where a row's mean is large next to its spread (a mean of 300 and a
// spread of 0.1 gave NaN from a negative variance). (An IEEE division per value was most of the norm pass's instructions: on the H100
// the pass took nearly as long with fp16 rows as with fp32 ones, RESULTS.md.) Only the K0 true features enter the
// sums and the mean; the padded features [K0, KP0) are written as zeros, and rows past the batch as zeros too.
#pragma once

// A row is read by a group of kNormLanes lanes (a power of two, at most a warp) in 4-element pieces: one
// 16-byte load of fp32 rows (8 bytes of fp16 ones) when K0 % 4 == 0, and about one piece a lane, so a
// narrow row keeps every lane busy and its sums need only log2(kNormLanes) shuffles.
constexpr int kNormPieces = (kNormK0 + 3) / 4;
constexpr int kNormLanes = kNormPieces >= 32 ? 32 : kNormPieces >= 16 ? 16 : kNormPieces >= 8 ? 8
                         : kNormPieces >= 4 ? 4 : kNormPieces >= 2 ? 2 : 1;
constexpr int kNormPer = (kNormPieces + kNormLanes - 1) / kNormLanes;   // pieces a lane reads of its row
// Up to 8 pieces (32 registers) stay in registers between the sums and the writes; wider rows are read
// again for the writes (from L1: the group read them a moment before).
constexpr bool kNormHold = kNormPer <= 8;
static_assert(kNormKP0 >= 4 * kNormPieces, "the padded width holds every piece");

__device__ __forceinline__ float4 o2f_load4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 o2f_load4(const __half* p) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// Features [4q, 4q + 4) of the row at `src` as floats, zeros past K0. `vec`: K0 % 4 == 0 and x aligned to
// 4 elements, so every piece is one vector load.
__device__ __forceinline__ float4 norm_piece(const io_t* __restrict__ src, int q, bool vec) {
  const int c = 4 * q;
  if (kNormK0 % 4 == 0 && vec) return o2f_load4(src + c);
  return make_float4(o2f_load(src + c), c + 1 < kNormK0 ? o2f_load(src + c + 1) : 0.0f,
                     c + 2 < kNormK0 ? o2f_load(src + c + 2) : 0.0f, c + 3 < kNormK0 ? o2f_load(src + c + 3) : 0.0f);
}

// A piece as a row's lanes hold it between the sums and the writes: fp16 rows' own 8 bytes (two registers
// where four floats take four, so more warps fit an SM: the pass is bound by the loads its warps keep
// waiting), fp32 rows' four floats.
template <typename IO> struct NormHeld { using type = float4; };
template <> struct NormHeld<__half> { using type = uint2; };
using norm_held_t = typename NormHeld<io_t>::type;
__device__ __forceinline__ float4 norm_unhold(const float4& e) { return e; }
__device__ __forceinline__ float4 norm_unhold(const uint2& u) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// Features [4q, 4q + 4) of the row at `src` as held (zeros past K0): one vector load where `vec` (as
// norm_piece), the fp16 bytes as they are.
// (A template, so that only the io type's branch is compiled.)
template <typename IO>
__device__ __forceinline__ typename NormHeld<IO>::type norm_load_held(const IO* src, int q, bool vec) {
  if constexpr (sizeof(IO) == 2) {
    if (kNormK0 % 4 == 0 && vec) return __ldg(reinterpret_cast<const uint2*>(src + 4 * q));
    const float4 e = norm_piece(src, q, vec);   // fp16 values and zeros: exact in fp16 again
    const __half2 lo = __floats2half2_rn(e.x, e.y), hi = __floats2half2_rn(e.z, e.w);
    return make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
  } else {
    return norm_piece(src, q, vec);
  }
}

// The norm's scale (or bias) of features [c, c + 4): one 16-byte load where `vec` (the parameters 16-byte
// aligned), else four. Past K0 it reads the NORM_ALIGN padding (plan/padding.py), whose products are
// never kept. (Four scalar loads a piece were two thirds of the norm pass's loads: on the H100 its warps
// waited on L1 most of the time.)
static_assert(kNormBiasOffset % 4 == 0, "the norm's bias starts at a multiple of 4 floats (NORM_ALIGN)");
__device__ __forceinline__ float4 norm_params4(const float* p, int c, bool vec) {
  if (vec) return *reinterpret_cast<const float4*>(p + c);
  return make_float4(p[c], p[c + 1], p[c + 2], p[c + 3]);
}

// Features [c, c + 4) of a piece as their differences from the row's shift `s` (layer norm; 0 for an RMS
// norm), zero past K0 and in rows past the batch: what the row's two sums add.
__device__ __forceinline__ float4 norm_shifted(const float4& e, float s, bool live, int c) {
  return make_float4(live && c < kNormK0 ? __fsub_rn(e.x, s) : 0.0f, live && c + 1 < kNormK0 ? __fsub_rn(e.y, s) : 0.0f,
                     live && c + 2 < kNormK0 ? __fsub_rn(e.z, s) : 0.0f, live && c + 3 < kNormK0 ? __fsub_rn(e.w, s) : 0.0f);
}

// e.x^2 + e.y^2 + e.z^2 + e.w^2, rounded as written.
__device__ __forceinline__ float norm_sq4(const float4& e) {
  return __fadd_rn(__fadd_rn(__fmul_rn(e.x, e.x), __fmul_rn(e.y, e.y)), __fadd_rn(__fmul_rn(e.z, e.z), __fmul_rn(e.w, e.w)));
}

// The sum of v over a row's group of G lanes (xor butterfly: every lane gets the same bits).
template <int G>
__device__ __forceinline__ float norm_group_sum(float v) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

#include "o2f_norm_value.cuh"

// Two values as one 32-bit word of 16-bit operands (the first in the low half, as store2 writes them).
__device__ __forceinline__ uint32_t norm_pack2(const __half*, float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t norm_pack2(const __nv_bfloat16*, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Four normalised values at p as the compute type: one 8-byte store where p allows it (a warp's lanes then
// write 256 consecutive bytes in one instruction), else two of the includer's store2. The vector store is
// written in PTX (generic address: p is global memory in the wide design's pass, shared memory in the fused
// kernels): as C++, the compiler merged it with the unaligned branch's two stores into two 4-byte ones.
// (A template, so that norm_pack2 is looked up only for the 16-bit types.)
template <typename E>
__device__ __forceinline__ void norm_store4(E* p, float v0, float v1, float v2, float v3) {
  if constexpr (sizeof(E) == 2) {
    if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) {
      asm volatile("st.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(norm_pack2(p, v0, v1)), "r"(norm_pack2(p, v2, v3))
                   : "memory");
      return;
    }
  }
  store2(p, v0, v1);
  store2(p + 2, v2, v3);
}

// Features [c, c + 4) of a row (e, as read) normalised (`a`, `b`: norm_value's) into p = the row's d + c; zeros
// past K0, and everywhere in a row past the batch (`live` false).
__device__ __forceinline__ void norm_write4(elem_t* p, int c, const float4& e, float a, float b, const float* params,
                                            bool pvec, bool live) {
  const float4 sc = norm_params4(params, c, pvec);
  const float4 nb = kNormBias ? norm_params4(params + kNormBiasOffset, c, pvec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float v0 = live ? norm_value(e.x, a, b, sc.x, nb.x) : 0.0f;
  const float v1 = live && c + 1 < kNormK0 ? norm_value(e.y, a, b, sc.y, nb.y) : 0.0f;
  const float v2 = live && c + 2 < kNormK0 ? norm_value(e.z, a, b, sc.z, nb.z) : 0.0f;
  const float v3 = live && c + 3 < kNormK0 ? norm_value(e.w, a, b, sc.w, nb.w) : 0.0f;
  norm_store4(p, v0, v1, v2, v3);
}

// What norm_rows shows each piece it read besides normalising it: nothing by default; the wide design's
// norm pass writes the residual's y = x + b from it (cuda_wide.cu.j2), so x is read once.
struct NormNoVisit {
  __device__ __forceinline__ void operator()(int64_t, int, const float4&) const {}
};

// load_rows with the norm: rows [row0, row0 + R) of x, normalised, into `dst` (row stride ldd) as the
// compute type, by threads `tid` of `nthreads` (whole warps); `params`: the norm's scale and bias (shared
// memory). Groups of kNormLanes lanes take a row each, as many rows at a time as there are groups.
// visit(row, c, e): features [c, c + 4) of each live row as read (zeros past K0).
template <int R, class Visit = NormNoVisit>
__device__ __forceinline__ void norm_rows(const io_t* __restrict__ x, int64_t rows, int64_t row0, elem_t* dst, int ldd,
                                          int tid, int nthreads, const float* params, Visit visit = Visit()) {
  constexpr int G = kNormLanes;
  const int lane_in_row = tid % G, groups = nthreads / G;
  const bool vec = kNormK0 % 4 == 0 && (reinterpret_cast<uintptr_t>(x) % (4 * sizeof(io_t))) == 0;
  const bool pvec = (reinterpret_cast<uintptr_t>(params) & 15) == 0;
  for (int base = 0; base < R; base += groups) {   // one trip count for every lane: the shuffles are warp-wide
    const int r = base + tid / G;
    const bool live = r < R && row0 + r < rows;
    const io_t* src = x + (row0 + r) * kNormK0;
    norm_held_t held[kNormHold ? kNormPer : 1];
    // A layer norm whose row stays in registers takes two passes (the mean, then the squared deviations
    // from it, as the CPU kernel); one read again for the writes sums x - s in one pass, s the row's first
    // value (every lane of the group reads it).
    constexpr bool kTwoPass = kNormLayer && kNormHold;
    const float s = kNormLayer && !kTwoPass && live ? o2f_load(src) : 0.0f;
    float sum = 0.0f, sumsq = 0.0f;   // of x - s (sumsq: not in the first of two passes)
#pragma unroll
    for (int p = 0; p < kNormPer; ++p) {
      const int q = lane_in_row + p * G;
      const norm_held_t h = live && q < kNormPieces ? norm_load_held(src, q, vec) : norm_held_t{};
      const float4 e = norm_shifted(norm_unhold(h), s, live && q < kNormPieces, 4 * q);
      sum = __fadd_rn(sum, __fadd_rn(__fadd_rn(e.x, e.y), __fadd_rn(e.z, e.w)));
      if (!kTwoPass) sumsq = __fadd_rn(sumsq, norm_sq4(e));
      if (kNormHold) held[kNormHold ? p : 0] = h;
    }
    sum = norm_group_sum<G>(sum);
    const float md = kNormLayer ? __fdiv_rn(sum, static_cast<float>(kNormK0)) : 0.0f;   // mean(x - s)
    if (kTwoPass) {   // the squared deviations from the mean, over the held row
#pragma unroll
      for (int p = 0; p < kNormPer; ++p) {
        const int q = lane_in_row + p * G;
        sumsq = __fadd_rn(sumsq, norm_sq4(norm_shifted(norm_unhold(held[kNormHold ? p : 0]), md,
                                                       live && q < kNormPieces, 4 * q)));
      }
    }
    sumsq = norm_group_sum<G>(sumsq);   // warp-uniform: before any lane leaves
    if (r >= R) continue;
    const float a = kNormLayer ? __fadd_rn(s, md) : 0.0f;
    // (x - s)'s variance; a NaN (a row holding an Inf) stays NaN, where fmaxf would make it 0
    const float dv = kTwoPass ? __fdiv_rn(sumsq, static_cast<float>(kNormK0))
                   : kNormLayer ? __fsub_rn(__fdiv_rn(sumsq, static_cast<float>(kNormK0)), __fmul_rn(md, md))
                                : __fdiv_rn(sumsq, static_cast<float>(kNormK0));
    const float var = dv < 0.0f ? 0.0f : dv;
    const float b = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, kNormEps)));
    elem_t* d = dst + r * ldd;
#pragma unroll
    for (int p = 0; p < kNormPer; ++p) {
      const int q = lane_in_row + p * G;
      if (q >= kNormPieces) break;
      const float4 e = kNormHold ? norm_unhold(held[kNormHold ? p : 0])
                                 : (live ? norm_piece(src, q, vec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f));
      const int c = 4 * q;
      if (live) visit(row0 + r, c, e);
      norm_write4(d + c, c, e, a, b, params, pvec, live);
    }
  }
  // the padded features past the last piece: zeros (P: at least 1, so the division below is never by 0)
  constexpr int P0 = 4 * kNormPieces, P = kNormKP0 > P0 ? kNormKP0 - P0 : 1;
  if (kNormKP0 > P0) {
    for (int i = tid; i < R * P; i += nthreads) {
      const int r = i / P, c = P0 + (i - r * P);
      dst[r * ldd + c] = to_elem(0.0f);
    }
  }
}

// The wide design's norm pass for rows wider than a warp holds (norm_rows' lanes would each read more than
// 8 pieces, K0 > 1024: LLaMA's 4096): a block of T threads per row, every piece held in registers (at most
// 8 a thread up to K0 = 32768), the sums over the block through `red` (shared memory, 2 T / 32 floats).
// One warp per row read each piece twice, one after another (the second time from L1 for the writes), and
// left most of the GPU idle at a few hundred rows: 27.7 us for 256 rows of 4096 on an H200, against
// ORT's 5.7 us for the same RMSNorm (RESULTS.md, thirty-eighth run). The arithmetic is norm_rows' with
// its two passes over the held row; only the order of the row's sums differs.
template <int T>
__device__ __forceinline__ float norm_block_sum(float v, float* red) {
  constexpr int W = T / 32;
  v = norm_group_sum<32>(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.0f;   // every thread adds the warps' sums in the same order: the same bits everywhere
#pragma unroll
  for (int w = 0; w < W; ++w) t = __fadd_rn(t, red[w]);
  return t;
}

template <int T, class Visit = NormNoVisit>
__device__ __forceinline__ void norm_row_block(const io_t* __restrict__ x, int64_t row, elem_t* d, const float* params,
                                               float* red, Visit visit = Visit()) {
  constexpr int PER = (kNormPieces + T - 1) / T;
  const int tid = threadIdx.x;
  const bool vec = kNormK0 % 4 == 0 && (reinterpret_cast<uintptr_t>(x) % (4 * sizeof(io_t))) == 0;
  const bool pvec = (reinterpret_cast<uintptr_t>(params) & 15) == 0;
  const io_t* src = x + row * kNormK0;
  norm_held_t held[PER];
  float sum = 0.0f, sumsq = 0.0f;
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int q = tid + p * T;
    held[p] = q < kNormPieces ? norm_load_held(src, q, vec) : norm_held_t{};
    const float4 e = norm_shifted(norm_unhold(held[p]), 0.0f, q < kNormPieces, 4 * q);
    sum = __fadd_rn(sum, __fadd_rn(__fadd_rn(e.x, e.y), __fadd_rn(e.z, e.w)));
  }
  const float md = kNormLayer ? __fdiv_rn(norm_block_sum<T>(sum, red), static_cast<float>(kNormK0)) : 0.0f;
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int q = tid + p * T;
    sumsq = __fadd_rn(sumsq, norm_sq4(norm_shifted(norm_unhold(held[p]), md, q < kNormPieces, 4 * q)));
  }
  const float dv = __fdiv_rn(norm_block_sum<T>(sumsq, red + T / 32), static_cast<float>(kNormK0));
  const float var = dv < 0.0f ? 0.0f : dv;
  const float b = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, kNormEps)));
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int q = tid + p * T;
    if (q >= kNormPieces) break;
    const float4 e = norm_unhold(held[p]);
    const int c = 4 * q;
    visit(row, c, e);
    norm_write4(d + c, c, e, md, b, params, pvec, true);
  }
  constexpr int P0 = 4 * kNormPieces;   // the padded features past the last piece: zeros
  for (int c = P0 + tid; c < kNormKP0; c += T) d[c] = to_elem(0.0f);
}
