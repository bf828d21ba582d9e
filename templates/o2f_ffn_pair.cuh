// o2f_ffn_pair.cuh: a two-layer FFN in one Hopper kernel, the hidden layer never leaving the SM
// (plan/ffn.py; templates/cuda_wide_ffn.cu.j2 renders the unit that includes this; the prototype and its
// measurements: benchmarks/sm90/ffn_wgmma.cu, docs/DESIGN.md "The FFN in one kernel").
//
//   y = act1(h W2 + b2),  h = round16(act0(g) * u) (gated: g, u = x W0 + b0 halves; with a packed glu
//                         g and u rounded to fp16 first, the rest in fp16x2 arithmetic)
//                         or round16(act0(x W0 + b0)),  round16: to the operand type (fp16 or bf16)
//
//  * A CTA is 2 warpgroups, persistent; a pass is one 64-row tile per warpgroup, and both run every pass.
//  * A tile's rows are converted once to fp16 (bf16) into a 128-byte-swizzled shared-memory tile: layer 0's A
//    operand, its first k-steps loaded once a pass into registers (RS wgmma) as far as the registers beside
//    the output's accumulators allow, the rest by descriptor (SS wgmma).
//  * The hidden width runs in chunks of kHC features (kHC gate + kHC up columns when gated): one
//    m64n{kL1N}k16 wgmma per k-step of K0 into the chunk's accumulators; the epilogue's hidden values,
//    rounded to the operand type, are in registers the A operand of layer 1's kHC rows (RS wgmma m64n{kNP}k16),
//    which accumulate into the tile's 64 x kNP outputs (kNP/2 registers a thread) across all chunks.
//  * A ring slot holds one chunk's weights (layer 0's columns, then layer 1's rows, then layer 0's bias of
//    the chunk's columns, fp32, the start of its accumulators: no bias array limits the hidden width), copied by
//    cp.async.bulk through the streamed wgmma design's ring (o2f_wgmma_ring.cuh).
//  * The two warpgroups issue their wgmmas in turns, so that each one's activation overlaps the other's
//    wgmmas (below, at the chunk loop).
//
// Static device code (sm_90a), included inside the unit's namespace after: io_t, kBf16, the shape constants
// (kK0, kKP0, kHP, kN, kNP, kGated, kHC, kL1N, kL1Bytes, kL2Bytes, kChunkBytes, kChunks, kStages, kSlotBytes, kRingChunks,
// kWarps, kCluster, stream_chunk), and o2f_sm90_ptx.cuh, o2f_wgmma_ring.cuh and o2f_ffn_wgmma.cuh (the wgmma
// wrappers WgmmaSS, WgmmaRS, the descriptors and small PTX helpers).
#pragma once

namespace o2f_ffn {
constexpr int kNwg = 2;
constexpr int kThreads = 128 * kNwg;
constexpr int kXTileBytes = 64 * kKP0 * 2;       // a warpgroup's input tile, 16-bit, K-major, 128 B swizzle
constexpr int kRingSmem = 0;
constexpr int kXSmem = kStages * kSlotBytes;
constexpr int kB1Smem = kXSmem + kNwg * kXTileBytes;        // layer 1's bias (fp32, kNP values); layer 0's
                                                             // comes with each chunk, in its ring slot
constexpr int kBarSmem = kB1Smem + 4 * kNP;
constexpr int kCntSmem = kBarSmem + 8 * kStages;
constexpr int kSmemBytes = kCntSmem + 4 * kStages + 1024;   // + the alignment slack
static_assert(kKP0 % 64 == 0 && kKP0 <= 256 && kK0 % 8 == 0 && kK0 <= kKP0, "K0: 8-column units, whole atoms");
static_assert(kHP % kHC == 0 && kNP % 64 == 0 && kNP <= 256 && kN <= kNP && kN % 2 == 0,
              "hidden and output widths (outputs stored in pairs)");
static_assert(kB1Smem % 16 == 0 && kBarSmem % 8 == 0 && kChunkBytes % 16 == 0, "alignment");
// A slot is refilled only once both warpgroups released it, and a warpgroup acquires the next chunk before it
// waits for its turn: with one slot, each would wait for the other (a deadlock from 2 chunks).
static_assert(kStages >= 2, "the ring needs 2 slots or more");
// Each chunk's layer-0 accumulators start as its bias (loaded from the ring slot before the warpgroup waits
// for its turn, scale-d 1 on every k-step): the activation then adds none, and the bias loads' latency, long
// while the other warpgroup's wgmmas keep shared memory busy, leaves its path. `O2F_DIAG_BIAS_EPI`
// (ffn_unit_check.py --diag NAME=CASE:bias_epi) adds the bias in the activation instead, as before.
#ifdef O2F_DIAG_BIAS_EPI
constexpr bool kBiasInAcc = false;
#else
constexpr bool kBiasInAcc = true;
#endif

__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Two fp32 values as one register of the operand type (elem_t: fp16 or bf16), the first in the low half.
__device__ __forceinline__ uint32_t pack_elem2(float lo, float hi) {
  if constexpr (kBf16) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  } else {
    return pack_h2(lo, hi);
  }
}
__device__ __forceinline__ uint32_t h2_to_elem2(uint32_t h) {   // fp16 pair -> the operand type's
  if constexpr (kBf16) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack_elem2(f.x, f.y);
  } else {
    return h;
  }
}
__device__ __forceinline__ void st_out2(float* p, float a, float b) {
  asm volatile("st.global.cs.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void st_out2(__half* p, float a, float b) {
  asm volatile("st.global.cs.b32 [%0], %1;\n" ::"l"(p), "r"(pack_h2(a, b)) : "memory");
}

// 8 input values of a row (16 or 32 bytes at p) as 8 operand values (one 16-byte unit of the tile).
__device__ __forceinline__ uint4 load_unit(const float* p) {
  const uint4 a = ld16(p), b = ld16(p + 4);
  return make_uint4(pack_elem2(__uint_as_float(a.x), __uint_as_float(a.y)), pack_elem2(__uint_as_float(a.z), __uint_as_float(a.w)),
                    pack_elem2(__uint_as_float(b.x), __uint_as_float(b.y)), pack_elem2(__uint_as_float(b.z), __uint_as_float(b.w)));
}
__device__ __forceinline__ uint4 load_unit(const __half* p) {
  const uint4 v = ld16(p);
  return make_uint4(h2_to_elem2(v.x), h2_to_elem2(v.y), h2_to_elem2(v.z), h2_to_elem2(v.w));
}

// Byte offset of row r's 16-byte unit `unit` (8 features) of K atom `atom` (64 features) in a warpgroup's
// input tile: K-major, 128-byte swizzle, 64 rows an atom (fill_x writes it, load_xfrag and the SS wgmmas read it).
__device__ __forceinline__ int xtile_off(int r, int atom, int unit) { return atom * 64 * 128 + r * 128 + ((unit ^ (r & 7)) * 16); }

// A warpgroup's 64 rows from `row0` into its 16-bit tile, zeros past the batch and in the padded columns:
// warp w converts rows w, w + 4, ...; lane l holds columns 8l..8l+7 (one 16-byte unit of the tile).
// kFillRows rows' loads are issued before their stores (all 16 of a warp, one trip to memory, measured no
// faster and took 4 registers more: RESULTS.md, thirtieth run).
constexpr int kFillRows = 4;
static_assert(16 % kFillRows == 0, "a warp's 16 rows in whole batches");
__device__ __forceinline__ void fill_x(unsigned char* tile, const io_t* __restrict__ x, int64_t rows, int64_t row0,
                                       int warp, int lane) {
  if (lane >= kKP0 / 8) return;
  const bool real = 8 * lane < kK0;
  const int atom = lane / 8, unit = lane % 8;
#pragma unroll
  for (int rb = 0; rb < 16; rb += kFillRows) {
    uint4 v[kFillRows];
#pragma unroll
    for (int i = 0; i < kFillRows; ++i) {
      const int64_t g = row0 + warp + 4 * (rb + i);
      v[i] = real && g < rows ? load_unit(x + g * kK0 + 8 * lane) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kFillRows; ++i) {
      const int r = warp + 4 * (rb + i);
      *reinterpret_cast<uint4*>(tile + xtile_off(r, atom, unit)) = v[i];
    }
  }
}

// Layer 0's first kXRegSteps k-steps (the unit's kXRegStepsPlanned, plan/ffn.py: as many as the registers
// hold beside the accumulators) take the input tile's A fragments from registers (RS wgmma), loaded once a
// pass; the rest read them from shared memory (SS) for every chunk. Each register k-step takes 2 KB of
// operand reads a chunk and warpgroup off shared memory for 4 registers a thread: SwiGLU 256 -> 1024 -> 256
// 3 % faster with 12 of 16, the GELU pair 256 -> 4096 -> 256 6 % with all 16 (RESULTS.md, thirty-first
// run). O2F_DIAG_X_SMEM: all from shared memory, as before (ffn_unit_check.py --diag NAME=CASE:x_smem).
#ifdef O2F_DIAG_X_SMEM
constexpr int kXRegSteps = 0;
#else
constexpr int kXRegSteps = kXRegStepsPlanned;
#endif
static_assert(kXRegSteps >= 0 && kXRegSteps <= kKP0 / 16, "k-steps of layer 0");
// The A fragments of k-steps [0, kXRegSteps) of a warpgroup's tile (ldmatrix x4 per k-step: lane l gives the
// address of row 16 warp + l % 16, columns 16 ks + 8 (l / 16)).
__device__ __forceinline__ void load_xfrag(uint32_t (&xa)[kXRegSteps > 0 ? kXRegSteps : 1][4], uint32_t tile, int warp,
                                           int lane) {
  const int r = 16 * warp + (lane & 15);
#pragma unroll
  for (int ks = 0; ks < kXRegSteps; ++ks) {
    const int k = 16 * ks + 8 * (lane >> 4), atom = k / 64, unit = (k % 64) / 8;
    const uint32_t addr = tile + xtile_off(r, atom, unit);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(xa[ks][0]), "=r"(xa[ks][1]), "=r"(xa[ks][2]), "=r"(xa[ks][3]) : "r"(addr) : "memory");
  }
}

// Epi: the unit's epilogue arithmetic, Epi::gated_pair(g0, u0, g1, u1, col) (gated) or Epi::pair(a, b, col)
// -> one packed 16-bit pair A register of hidden features col, col + 1; Epi::out(v, col) the output's activation.
template <class Epi>
__global__ void __launch_bounds__(kThreads, 1)
ffn_kernel(const io_t* __restrict__ x, io_t* __restrict__ y, int64_t rows, const unsigned char* __restrict__ wimg,
           const float* __restrict__ bias) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;   // swizzle atoms repeat on 1024-byte boundaries
  unsigned char* smem = smem_raw + (base - raw);
  const float* sb1 = reinterpret_cast<const float*>(smem + kB1Smem);
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  if (tid == 0) {
    for (uint32_t s = 0; s < kStages; ++s) mbar_init(base + kBarSmem + 8 * s, 1);
    mbar_init_fence();
  }
  for (uint32_t i = tid; i < kStages; i += kThreads) reinterpret_cast<uint32_t*>(smem + kCntSmem)[i] = 0u;
  for (int i = tid; i < kNP; i += kThreads) reinterpret_cast<float*>(smem + kB1Smem)[i] = bias[i];
  __syncthreads();   // barriers, counters and bias in place
  const int64_t ntiles = (rows + 63) / 64;
  const int64_t npasses = (ntiles + kNwg - 1) / kNwg;
  const int64_t mine = (npasses - 1 - blockIdx.x) / gridDim.x + 1;   // >= 1: the grid is at most npasses
  Ring ring{base + kRingSmem, base + kBarSmem, base + kCntSmem, 0u, wimg, static_cast<uint32_t>(mine) * kRingChunks,
            0u, 0u, 0u, 0u, 0u};
  if (tid == 0) ring.prime();
  unsigned char* xtile = smem + kXSmem + wg * kXTileBytes;
  const uint32_t xaddr = base + kXSmem + wg * kXTileBytes;   // its shared address
  const uint32_t xlo = (xaddr >> 4) | (1u << 16);            // descriptor low word, LBO 1
  const int t2 = 2 * (lane & 3);             // this thread's first column in every n8 block
  const int rin = 16 * warp + (lane >> 2);   // its first row in the tile (the second: + 8)

  if (wg == 1) turn_pass(wg);   // warpgroup 0 issues first
#pragma unroll 1
  for (int64_t pass = blockIdx.x; pass < npasses; pass += gridDim.x) {
    const int64_t row0 = (pass * kNwg + wg) * 64;
#ifdef O2F_DIAG_NO_X   // a diagnostic build: the input tile converted on the first pass only (results wrong)
    if (pass == blockIdx.x)
#endif
    fill_x(xtile, x, rows, row0, warp, lane);
    fence_proxy_async();
    wg_sync(wg);   // the whole tile stored
    uint32_t xa[kXRegSteps > 0 ? kXRegSteps : 1][4];
    if constexpr (kXRegSteps > 0) {
      load_xfrag(xa, xaddr, warp, lane);
      fence_frag(xa);
    }
    float out[kNP / 2];
    uint32_t h[kHC / 16][4];
    float d[kL1N / 2];
    auto layer0 = [&](uint32_t slot) {   // a chunk's layer-0 products into d (onto its bias: kBiasInAcc)
#pragma unroll
      for (int ks = 0; ks < kKP0 / 16; ++ks) {
        if (ks < kXRegSteps)   // (the index clamped: it compiles for every ks, the branch is resolved statically)
          WgmmaRS<kL1N>::run(d, xa[ks < kXRegSteps ? ks : 0], wdesc(kHi128, slot + (kstep_off(ks, kL1N) >> 4)),
                             kBiasInAcc || ks > 0);
        else
          WgmmaSS<kL1N>::run(d, wdesc(kHi128, xlo + (kstep_off(ks, 64) >> 4)),
                             wdesc(kHi128, slot + (kstep_off(ks, kL1N) >> 4)), kBiasInAcc || ks > 0);
      }
    };
    auto layer1 = [&](uint32_t slot, bool first) {   // a chunk's hidden values (h) into the outputs
#pragma unroll
      for (int kt = 0; kt < kHC / 16; ++kt)
        WgmmaRS<kNP>::run(out, h[kt], wdesc(kHi64, slot + ((kL1Bytes + 32 * kt) >> 4)), !first || kt > 0);
    };
    // a chunk's layer-0 bias, after its weights in the slot (gate values, then up): the slot's shared
    // address is the descriptor's start field (bits 0-13, address >> 4)
    auto chunk_bias = [&](uint32_t slot) { return reinterpret_cast<const float*>(smem_raw + (((slot & 0x3FFFu) << 4) - raw) + kL1Bytes + kL2Bytes); };
    auto bias_init = [&](uint32_t slot) {   // kBiasInAcc: d = the chunk's bias (n8 block j: columns 8j..8j+7)
      if constexpr (kBiasInAcc) {
        const float* sb0 = chunk_bias(slot);
#pragma unroll
        for (int j = 0; j < kL1N / 8; ++j) {
          const float2 b = *reinterpret_cast<const float2*>(sb0 + 8 * j + t2);
          d[4 * j] = d[4 * j + 2] = b.x;   // rows r and r + 8
          d[4 * j + 1] = d[4 * j + 3] = b.y;
        }
        fence_acc(d);   // the moves stay before the turn's wgmma fence (else ptxas injects one, C7519)
      }
    };
    // accumulator k of n8 block j with the bias the activation still adds (none: kBiasInAcc; spelled out,
    // as x + 0.0f is not x for x = -0 and would keep its FADD)
    auto pre = [&](const float* sb0, int j, int k) {
      if constexpr (kBiasInAcc) return d[4 * j + k];
      else return d[4 * j + k] + sb0[8 * j + t2 + (k & 1)];
    };
    auto hidden = [&](int c, uint32_t slot) {   // chunk c's act(g) * u (or act(a)) as layer 1's A fragments
      const float* sb0 = chunk_bias(slot);
      // the hidden values of this thread's columns as layer 1's A fragments: n8 block j of the chunk is
      // k-step j / 2, registers 0/1 (rows r, r + 8) for even j, 2/3 for odd j
#pragma unroll
      for (int j = 0; j < kHC / 8; ++j) {
        const int col = c * kHC + 8 * j + t2;   // hidden feature
        uint32_t lo, hi;
        if constexpr (kGated) {
          const int u = j + kHC / 8;   // the up block of the same features
          lo = Epi::gated_pair(pre(sb0, j, 0), pre(sb0, u, 0), pre(sb0, j, 1), pre(sb0, u, 1), col);
          hi = Epi::gated_pair(pre(sb0, j, 2), pre(sb0, u, 2), pre(sb0, j, 3), pre(sb0, u, 3), col);
        } else {
          lo = Epi::pair(pre(sb0, j, 0), pre(sb0, j, 1), col);
          hi = Epi::pair(pre(sb0, j, 2), pre(sb0, j, 3), col);
        }
        h[j / 2][(j % 2) * 2] = lo;
        h[j / 2][(j % 2) * 2 + 1] = hi;
      }
      fence_frag(h);
    };
    // The two warpgroups issue their wgmmas in turns (turn_wait / turn_pass): chunk c's layer-0 wgmmas go
    // out with chunk c - 1's layer-1 ones, then the other warpgroup's, so that one warpgroup's activation
    // (and, between passes, its output stores and input conversion) runs while the other's wgmmas keep the
    // tensor cores busy. Without turns both wait on the same ring slot and work in step: the tensor cores
    // idle through both activations (SwiGLU 256 -> 1024 -> 256: 0.88 -> 0.78 ms; docs/DESIGN.md). The
    // first and the last chunk are peeled so that every wgmma sequence is straight-line code (a branch
    // between them has ptxas inject warpgroup.arrive, C7519).
    uint32_t prev = ring.acquire();
    bias_init(prev);
    turn_wait(wg);
    wgmma_fence();
    layer0(prev);
    wgmma_commit();
    turn_pass(wg);
    wgmma_wait<0>();
    fence_acc(d);
    hidden(0, prev);
#pragma unroll 1
    for (int c = 1; c < kChunks; ++c) {
      const uint32_t slot = ring.acquire();   // this chunk's weights have landed
      bias_init(slot);
      turn_wait(wg);
      wgmma_fence();
      layer1(prev, c == 1);
      layer0(slot);
      wgmma_commit();
      turn_pass(wg);
      wgmma_wait<0>();   // this chunk's layer-0 product and the previous chunk's layer-1 wgmmas
      fence_acc(d);
      fence_acc(out);
      ring.release(lane);   // the previous chunk's slot
      hidden(c, slot);
      prev = slot;
    }
    turn_wait(wg);
    wgmma_fence();
    layer1(prev, kChunks == 1);
    wgmma_commit();
    turn_pass(wg);
    wgmma_wait<0>();
    fence_acc(out);
    ring.release(lane);   // the last chunk's slot
    wg_sync(wg);          // every warp's reads of the tile are done: the next pass refills it
    const int64_t r0 = row0 + rin;
#pragma unroll
    for (int j = 0; j < kNP / 8; ++j) {
      const int col = 8 * j + t2;
      if (col >= kN) continue;
      const float2 b = *reinterpret_cast<const float2*>(sb1 + col);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t r = r0 + 8 * half;
        if (r >= rows) continue;
        const float v0 = Epi::out(out[4 * j + 2 * half] + b.x, col), v1 = Epi::out(out[4 * j + 2 * half + 1] + b.y, col + 1);
#ifdef O2F_DIAG_NO_STORE   // a diagnostic build: the outputs computed, stored only if a NaN (never: results wrong)
        if (v0 != v0)
#endif
        st_out2(y + r * kN + col, v0, v1);
      }
    }
  }
  if (wg == 0) turn_wait(wg);   // warpgroup 1's last turn, passed to nobody
}
}  // namespace o2f_ffn
