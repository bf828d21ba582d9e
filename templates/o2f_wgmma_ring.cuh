// o2f_wgmma_ring.cuh: the streamed wgmma design's weight ring (templates/cuda_wgmma.cu.j2 with stages > 0;
// plan/wgmma.py; the prototype's form, benchmarks/sm90/NOTES.md).
//
// A pass is one 64-row tile per warpgroup; every warpgroup of the CTA runs every pass and consumes the
// same chunks in the same order (layer by layer, chunk by chunk), each from the ring slot it was copied
// into. Slot s holds chunks s, s + kStages, s + 2 kStages, ... of the CTA's sequence; full[s] (an
// mbarrier, one expect_tx arrival + the bytes) completes once per fill, so a chunk's fill parity is its
// use count mod 2. Each warp, once wgmma.wait_group says its reads of a slot are done, adds one to the
// slot's counter; the warp that completes a use (kWarps arrivals) copies the chunk kStages ahead into it.
// A use's arrivals all come before the next use's (a warp releases chunk it + kStages only after its
// fill, which waits for use it's last arrival), so "last" is prev % kWarps == kWarps - 1; the counter
// never reaches 2^32 (a CTA makes far fewer than 2^32 / kWarps passes over a slot).
// Bulk copies and wgmma are both async-proxy accesses, ordered here by the mbarrier (read after write)
// and by wait_group + the counter's acq_rel (write after read): no fence.proxy.async (the prototype's
// H100 run, and CUTLASS's TMA pipelines, do the same).
//
// Clusters (kCluster > 1): the cluster's CTAs run their passes in step and hold the same chunk in the
// same slot; CTA q copies slice q (bytes [q, q + 1) / kCluster) of each chunk into that slot of every CTA
// (multicast), and every CTA arms its own full[s] for the whole chunk. A CTA may write into the others'
// slot only once all of them are done with it: the warp that completes its own CTA's count arrives on
// peer[s] of every other CTA (a remote arrival, nothing waited for), then waits for its own peer[s]
// (kCluster - 1 arrivals a use) before it arms and copies. A slice may land before its barrier is armed:
// the transaction count goes negative meanwhile, and the phase cannot complete before the arming arrival.
// The cluster synchronises after the barriers are initialised (remote copies and arrivals target them)
// and before any CTA exits (its last remote arrivals and copies).
#pragma once
__device__ __forceinline__ uint32_t atom_add_acq_rel(uint32_t addr, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;\n" : "=r"(old) : "r"(addr), "r"(v) : "memory");
  return old;
}
// An arrival on the mbarrier at shared address `bar` of the cluster's CTA `rank` (release: this CTA's reads
// of the slot come before), and the wait for a phase of one's own that other CTAs complete (acquire).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
// Bulk copy into the same shared offset of every CTA in `mask`, completing on each one's mbarrier there.
__device__ __forceinline__ void bulk_g2s_multicast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                   uint16_t mask) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster: what each wrote before is visible to all after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

struct Ring {
  uint32_t slots, bars, cnts;    // shared addresses: slot 0 (1024-aligned), full[0], counter[0]
  uint32_t peers;                // clusters: peer[0]
  const unsigned char* wimg;     // the weight image in global memory (every CTA reads it: L2-resident)
  uint32_t total;                // chunks this CTA consumes: its passes x kRingChunks
  uint32_t acq_stage, acq_phase; // the next chunk to acquire: its slot and the parity of its fill
  uint32_t rel, rel_stage;       // the next chunk to release (its index in the sequence) and its slot
  uint32_t rank;                 // this CTA's rank in its cluster (0 without one)

  // Copies chunk `it` of the sequence into slot `stage` (one thread): the whole chunk; or, in a cluster,
  // arms this CTA's barrier for the whole chunk and copies its slice into every CTA.
  __device__ __forceinline__ void fill(uint32_t it, uint32_t stage) const {
    const uint2 c = stream_chunk(it % kRingChunks);
    const uint32_t full = bars + 8 * stage;
#ifdef O2F_DIAG_NO_FILL   // a diagnostic build (kernel_check.py --diag): the slot's barrier completes, no bytes move
    if constexpr (kCluster == 1) {
      mbar_arrive(full);
      return;
    }
#endif
    mbar_expect_tx(full, c.y);
    if constexpr (kCluster == 1) {
      bulk_g2s(slots + stage * kSlotBytes, wimg + c.x, c.y, full);
    } else {
      const uint32_t part = c.y / kCluster, off = rank * part;   // chunks are multiples of 256 bytes
      bulk_g2s_multicast(slots + stage * kSlotBytes + off, wimg + c.x + off, part, full,
                         static_cast<uint16_t>((1u << kCluster) - 1u));
    }
  }
  // Called at the top of every pass where a pass's chunks are a multiple of kStages: there each chunk's slot
  // and phase would be the same constants every pass, and ptxas, scheduling the unrolled pass around them,
  // wanted more than 255 registers (a 64 -> 256 x 6 chain, 24 chunks, spilled 192 bytes with 3 slots and
  // none with 5; NeRF's 319 -> 256 x 3, 320 bytes). Made opaque here, they leave ptxas nothing to hoist:
  // no spills, 3-5 % faster (RESULTS.md, forty-fifth run). Where the slots do not repeat every pass the
  // same barrier made the NeRF trunk 4 % slower, so the template leaves it out there.
  __device__ __forceinline__ void opaque() {
    asm volatile("" : "+r"(acq_stage), "+r"(acq_phase), "+r"(rel), "+r"(rel_stage));
  }
  // The first min(kStages, total) chunks (one thread, before any acquire; clusters: after cluster_sync).
  __device__ __forceinline__ void prime() const {
    for (uint32_t i = 0; i < kStages && i < total; ++i) fill(i, i);
  }
  // The descriptor low word (start address >> 4, leading byte offset 1) of the next chunk's slot, once
  // its copy has landed.
  __device__ __forceinline__ uint32_t acquire() {
    const uint32_t stage = acq_stage;
    mbar_wait(bars + 8 * stage, acq_phase);
    if (++acq_stage == kStages) {
      acq_stage = 0;
      acq_phase ^= 1u;
    }
    return ((slots + stage * kSlotBytes) >> 4) | (1u << 16);
  }
  // This warp is done with the oldest chunk it acquired (after the wgmma.wait_group that completed it).
  __device__ __forceinline__ void release(int lane) {
    const uint32_t it = rel++, stage = rel_stage;
    if (++rel_stage == kStages) rel_stage = 0;
    __syncwarp();
    if (lane != 0) return;
    const uint32_t prev = atom_add_acq_rel(cnts + 4 * stage, 1u);
    if (prev % kWarps != kWarps - 1 || it + kStages >= total) return;   // not the last, or nothing left to copy
    if constexpr (kCluster > 1) {   // tell the other CTAs, then wait until they are done with the slot too
#pragma unroll
      for (uint32_t q = 0; q < kCluster; ++q)
        if (q != rank) mbar_arrive_cluster(peers + 8 * stage, q);
      mbar_wait_cluster(peers + 8 * stage, (it / kStages) & 1u);
    }
    fill(it + kStages, stage);
  }
};
