// o2f_norm_value.cuh: one value of a transformer block's normalised input row, as every CUDA kernel with a
// norm computes it (o2f_block_norm.cuh: the mma.sync kernels and the wide design's norm pass;
// o2f_wgmma_norm.cuh: the wgmma kernel), after the includer's kNormLayer, kNormBias and kNormRoundHalf.
#pragma once

// `a`, `b` are the row's mean and 1 / sqrt(var + eps) (layer norm) or 0 and 1 / sqrt(mean(x^2) + eps) (RMS
// norm); `scale` and `bias` the norm's parameters of the value's feature. IEEE-rounded operations, no FMAs.
__device__ __forceinline__ float norm_value(float v, float a, float b, float scale, float bias) {
  float r = __fmul_rn(__fmul_rn(kNormLayer ? __fsub_rn(v, a) : v, b), scale);
  if (kNormLayer && kNormBias) r = __fadd_rn(r, bias);
  // fp16 I/O with a layer norm: ORT's fp16 LayerNormalization kernel writes fp16, as the stock body does
  return kNormRoundHalf ? __half2float(__float2half_rn(r)) : r;
}
