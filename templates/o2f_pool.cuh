// o2f_pool.cuh: a chain's max pool over the rows of each group (MLPSpec.pool "max": PointNet's max over its
// points). The op's output y [groups, N] starts at -inf (pool_fill) and each kernel raises its entries with
// o2f_atomic_max: float entries by one integer atomic; half entries by a compare-and-swap that leaves as soon
// as the entry is already at least the value. NaN wins (as ONNX Runtime's CUDA ReduceMax propagates it).
// Static device code included inside the generated kernel's anonymous namespace, after io_t.
#pragma once

__device__ __forceinline__ bool o2f_raises(float v, float old) { return v > old || (v != v && old == old); }

// A float's bits order like the float as a signed int where it is positive, and in reverse as an unsigned
// int where it is negative (sign bit set): one fire-and-forget atomic (RED.MAX / RED.MIN, no value waited
// for) raises the entry from any start, -inf included. NaN goes in as the positive quiet NaN, which then
// beats every number either way.
__device__ __forceinline__ void o2f_atomic_max(float* p, float v) {
  if (v != v) v = __uint_as_float(0x7fc00000u);
  if (!signbit(v)) atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMin(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}

__device__ __forceinline__ void o2f_atomic_max(__half* p, float vf) {
  const __half v = __float2half_rn(vf);   // rounding is monotonic: the max of the rounded values
  const float vr = __half2float(v);
  unsigned short* a = reinterpret_cast<unsigned short*>(p);
  unsigned short old = *reinterpret_cast<volatile unsigned short*>(a);
  while (o2f_raises(vr, __half2float(__ushort_as_half(old)))) {
    const unsigned short seen = atomicCAS(a, old, __half_as_ushort(v));
    if (seen == old) return;
    old = seen;
  }
}

// Two adjacent half entries (p 4-byte aligned: p[0] the word's low 16 bits) raised to (a, b) by one 32-bit
// compare-and-swap on the pair, starting from `seen`, the word as read before (a stale read errs low). The
// caller reads every pair it raises first, so those reads are in flight together rather than one after
// another, and most pairs then need no atomic at all.
__device__ __forceinline__ void o2f_atomic_max2(__half* p, float a, float b, unsigned seen) {
  const __half ha = __float2half_rn(a), hb = __float2half_rn(b);
  unsigned* w = reinterpret_cast<unsigned*>(p);
  unsigned old = seen;
  while (true) {
    const bool ra = o2f_raises(__half2float(ha), __half2float(__ushort_as_half(static_cast<unsigned short>(old & 0xffffu))));
    const bool rb = o2f_raises(__half2float(hb), __half2float(__ushort_as_half(static_cast<unsigned short>(old >> 16))));
    if (!ra && !rb) return;
    const unsigned want = ((rb ? static_cast<unsigned>(__half_as_ushort(hb)) : (old >> 16)) << 16)
                          | (ra ? static_cast<unsigned>(__half_as_ushort(ha)) : (old & 0xffffu));
    const unsigned got = atomicCAS(w, old, want);
    if (got == old) return;
    old = got;
  }
}

__device__ __forceinline__ float o2f_max_nan(float a, float b) { return o2f_raises(b, a) ? b : a; }

// y[0, n) = -inf: the max of no rows (ONNX's ReduceMax of an empty axis), and where every pool starts.
__global__ void pool_fill(io_t* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    o2f_store(y + i, -INFINITY);
}

inline cudaError_t pool_start(io_t* y, int64_t n, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  const int64_t blocks = (n + 255) / 256;
  pool_fill<<<static_cast<int>(blocks < 1024 ? blocks : 1024), 256, 0, s>>>(y, n);
  return cudaGetLastError();
}
