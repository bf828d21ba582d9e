// o2f_sm90_ptx.cuh: the sm_90a PTX both Hopper designs use: shared-memory addresses, mbarriers (init,
// expected bytes, arrival, phase wait), bulk copies, wgmma group control (fence, commit, wait, accumulator
// and fragment pins) and descriptors.
// Static device code, included by o2f_wgmma.cuh (the wgmma design) and o2f_light_gemm.cuh (the wide
// design's GEMM without CUTLASS) inside their units' namespaces.
#pragma once
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barrier visible to the async proxy (the bulk copies complete on it).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` has completed (on a fresh barrier, parity 1 passes at once).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pins registers at this point of the instruction stream (CuTe's warpgroup_fence_operand): reads of an
// accumulator stay below the wait that makes it valid, writes of an operand above the wgmma that reads it.
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for RS wgmmas' A fragments (4 registers a k-step): their writes stay above the wgmma that reads
// them, and their registers are not reused before it completes.
template <int KT>
__device__ __forceinline__ void fence_frag(uint32_t (&a)[KT][4]) {
#pragma unroll
  for (int k = 0; k < KT; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[k][i])::"memory");
}
// A shared-memory matrix descriptor from its high word (stride byte offset, swizzle mode) and low word
// (start address >> 4, leading byte offset 1).
__device__ __forceinline__ uint64_t wdesc(uint32_t hi, uint32_t lo) { return (static_cast<uint64_t>(hi) << 32) | lo; }
// Bulk global -> shared copy (the async proxy, like TMA; no tensor map for a contiguous block), completing
// on an mbarrier (the weight rings' refills: o2f_wgmma_ring.cuh).
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
