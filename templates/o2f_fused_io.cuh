// o2f_fused_io.cuh: loads and stores of the input/output element type (float or __half), as floats.
// Static device code of the generated fused kernels (cuda_resident, cuda_streamed, cuda_fp32 templates),
// included inside the generated source's anonymous namespace.
#pragma once
__device__ __forceinline__ float o2f_load(const float* p) { return __ldg(p); }
__device__ __forceinline__ float o2f_load(const __half* p) { return __half2float(__ldg(p)); }
__device__ __forceinline__ float o2f_value(float v) { return v; }
__device__ __forceinline__ float o2f_value(__half v) { return __half2float(v); }
__device__ __forceinline__ void o2f_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void o2f_store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void o2f_store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void o2f_store2(__half* p, float a, float b) { *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b); }
