// o2f_pool.cuh: a chain's pool over the rows of each group (MLPSpec.pool: PointNet's max over its points,
// Deep Sets' sum, a mean). The entries are raised (max) or added to (sum, mean) in float whatever the op's
// I/O type: in y itself for float32 I/O, in a float scratch buffer [groups, N] for float16 I/O (the plugin
// takes it from ONNX Runtime's allocator), which pool_finish then rounds into y. Every entry starts at the
// pool's identity (pool_start: -inf, or 0) and each kernel raises or adds to it with one fire-and-forget
// atomic (o2f_pool_raise); a mean's 1 / rows multiplies the sums at the end (pool_finish), as ReduceMean
// divides its sum. Rounding a max to half afterwards is exact, since it is monotonic (the rounded max is
// the max of the rounded values). NaN wins (as ONNX Runtime's CUDA ReduceMax propagates it; a sum
// propagates it anyway). The sums' order is the atomics', so a sum may differ from run to run in its last
// bits. Static device code included inside the generated kernel's anonymous namespace, after io_t and the
// unit's kPoolOp (0 max, 1 sum, 2 mean: spec.POOL_OPS).
#pragma once

// A pooled kernel's output: the float entries it raises.
using pool_t = float;
constexpr bool kPoolSum = kPoolOp != 0;   // sum and mean add (the mean scaled at the end), max raises
constexpr float kPoolStart = kPoolSum ? 0.0f : -INFINITY;   // the pool of no values: where every entry starts

// max with NaN winning: one instruction where the GPU has it (max.NaN.f32, FMNMX.NAN: sm_80 and newer).
__device__ __forceinline__ float o2f_fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return b > a || (b != b && a == a) ? b : a;
#endif
}

// Two partial pools into one: the max (NaN winning) or the sum.
__device__ __forceinline__ float o2f_pool_combine(float a, float b) { return kPoolSum ? a + b : o2f_fmax_nan(a, b); }

// One halving exchange over lane bit `mask` (4, 8 or 16: a bit of the row index g = lane / 4 of an MMA
// fragment): of v[0, 2H) the lane keeps the half its bit selects and takes the max with its partner's copy
// of that half, into v[0, H) (o2f_pool_combine: the max or the sum). Three of them (masks 16, 8, 4) reduce V values a lane over the 8 lanes that
// hold the same columns (lane % 4) with 7V/8 shuffles, where three butterfly shuffles a value take 3V, and
// leave lane (g, t) the maxima of the values first at [g V/8, (g + 1) V/8).
template <int H, int V>
__device__ __forceinline__ void pool_halve(float (&v)[V], int lane, int mask) {
  static_assert(2 * H <= V, "halving past the values");
  const bool hi = lane & mask;
#pragma unroll
  for (int i = 0; i < H; ++i) {
    const float send = hi ? v[i] : v[i + H], keep = hi ? v[i + H] : v[i];
    v[i] = o2f_pool_combine(keep, __shfl_xor_sync(0xffffffffu, send, mask));
  }
}

// A float's bits order like the float as a signed int where it is positive, and in reverse as an unsigned
// int where it is negative (sign bit set): one fire-and-forget atomic (RED.MAX / RED.MIN, no value waited
// for; global or shared memory) raises the entry from any start, -inf included. NaN goes in as the positive quiet NaN, which then
// beats every number either way. (Half entries took a compare-and-swap loop, each warp waiting for its
// reads and swaps: the float16 PointNet's kernel 1.6x the float one's; the float scratch avoids it.)
__device__ __forceinline__ void o2f_atomic_max(float* p, float v) {
  if (v != v) v = __uint_as_float(0x7fc00000u);
  if (!signbit(v)) atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
  else atomicMin(reinterpret_cast<unsigned*>(p), __float_as_uint(v));
}

// An entry (global or shared) raised to v, or v added to it: one fire-and-forget atomic (RED.ADD.F32 where
// the result goes unused).
__device__ __forceinline__ void o2f_pool_raise(float* p, float v) {
  if (kPoolSum) atomicAdd(p, v);
  else o2f_atomic_max(p, v);
}

// p[0, n) = kPoolStart: the pool of no rows (ONNX's ReduceMax of an empty axis is -inf, ReduceSum's and
// ORT's ReduceMean's 0), and where every pool starts.
__global__ void pool_fill(float* __restrict__ p, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = kPoolStart;
}

// y[0, n) = p[0, n) * scale in the I/O type (y may be p: a float32 mean's scaling in place).
__global__ void pool_round(const float* p, io_t* y, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = static_cast<io_t>(p[i] * scale);   // (round to nearest even: __half's conversion from float)
}

inline int pool_blocks(int64_t n) { return static_cast<int>((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024); }

// Where the run raises its entries: y itself (float32 I/O) or the float scratch (float16 I/O).
inline pool_t* pool_entries(void* y, void* scratch) {
  return sizeof(io_t) == sizeof(pool_t) ? static_cast<pool_t*>(y) : static_cast<pool_t*>(scratch);
}

inline cudaError_t pool_start(pool_t* p, int64_t n, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  if (p == nullptr) return cudaErrorInvalidValue;   // float16 I/O without its scratch
  pool_fill<<<pool_blocks(n), 256, 0, s>>>(p, n);
  return cudaGetLastError();
}

// A pooled run's last step, after its kernel's launch: that launch's error, or the entries rounded into y
// (float16 I/O) and a mean's sums times 1 / group_rows (none for a group of no rows: its sum is 0).
inline cudaError_t pool_finish(const pool_t* p, void* y, int64_t n, int64_t group_rows, cudaStream_t s) {
  const cudaError_t err = cudaGetLastError();
  const float scale = kPoolOp == 2 && group_rows > 0 ? 1.0f / static_cast<float>(group_rows) : 1.0f;
  if (err != cudaSuccess || n <= 0 || (sizeof(io_t) == sizeof(pool_t) && scale == 1.0f)) return err;
  pool_round<<<pool_blocks(n), 256, 0, s>>>(p, static_cast<io_t*>(y), n, scale);
  return cudaGetLastError();
}

// A pooled run's start: its n entries at kPoolStart and, where there are no rows to pool (or no groups), its
// end too (y = the pool of nothing). Whether the kernel has rows to raise; else the run returns `*err`.
inline bool pool_begin(pool_t* p, void* y, int64_t n, int64_t rows, int64_t groups, cudaStream_t s, cudaError_t* err) {
  *err = pool_start(p, n, s);
  if (*err == cudaSuccess && (rows <= 0 || groups <= 0)) *err = pool_finish(p, y, n, 0, s);
  return *err == cudaSuccess && rows > 0 && groups > 0;
}
