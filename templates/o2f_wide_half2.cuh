// o2f_wide_half2.cuh: pairs of 16-bit values (fp16 or bf16) as two floats, for the wide design's
// hand-written kernels (the glu pass, the few-row weight-streaming path). Static code included inside
// the generated source's namespace o2f_<chain>.
#pragma once
#include <type_traits>

// The pair type of a raw 16-bit type: __half2 for __half, __nv_bfloat162 for __nv_bfloat16.
template <typename R>
using o2f_pair_t = std::conditional_t<std::is_same<R, __half>::value, __half2, __nv_bfloat162>;
__device__ __forceinline__ float2 o2f_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 o2f_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
