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
// Static device code for sm_90a only; needs kStages, kSlotBytes, kRingChunks, kWarps and
// stream_chunk(p) (image offset and bytes of chunk p of a pass) from the generated source.
#pragma once
__device__ __forceinline__ uint32_t atom_add_acq_rel(uint32_t addr, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;\n" : "=r"(old) : "r"(addr), "r"(v) : "memory");
  return old;
}

struct Ring {
  uint32_t slots, bars, cnts;    // shared addresses: slot 0 (1024-aligned), full[0], counter[0]
  const unsigned char* wimg;     // the weight image in global memory (every CTA reads it: L2-resident)
  uint32_t total;                // chunks this CTA consumes: its passes x kRingChunks
  uint32_t acq_stage, acq_phase; // the next chunk to acquire: its slot and the parity of its fill
  uint32_t rel, rel_stage;       // the next chunk to release (its index in the sequence) and its slot

  // Copies chunk `it` of the sequence into slot `stage` (one thread).
  __device__ __forceinline__ void fill(uint32_t it, uint32_t stage) const {
    const uint2 c = stream_chunk(it % kRingChunks);
    const uint32_t full = bars + 8 * stage;
    mbar_expect_tx(full, c.y);
    bulk_g2s(slots + stage * kSlotBytes, wimg + c.x, c.y, full);
  }
  // The first min(kStages, total) chunks (one thread, before any acquire).
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
    if (lane == 0) {
      const uint32_t prev = atom_add_acq_rel(cnts + 4 * stage, 1u);
      if (prev % kWarps == kWarps - 1 && it + kStages < total) fill(it + kStages, stage);
    }
  }
};
