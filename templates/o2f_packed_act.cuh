// o2f_packed_act.cuh: activations of fp16 hidden layers in packed fp16x2 arithmetic (expr.PACKED_FORMS).
// A hidden layer's output is rounded to fp16 for the next layer's MMA anyway; these forms round the
// pre-activation pair first and evaluate the activation on both halves at once: HFMA2-pipe instructions
// handle two elements each, and tanh.approx.f16x2 is one instruction for two values (on sm_90 it issues
// two MUFU.TANH.F16, one a half: RESULTS.md, thirty-second run), where fp32 tanhf costs ~2 MUFU operations
// and ~15 FMA-pipe instructions per element (MUFU issue, 16 a clock per SM, bounded the tanh and GELU
// chains). The error is about 1.5-2x fp16's rounding
// alone; the numerics model (precision.py) evaluates the same forms op by op in numpy float16, and a
// chain that fails it gets act_math "fp32" (the fp32 forms) instead.
// Static device code included inside the generated kernel's anonymous namespace (sm_80 or newer).
#pragma once
__device__ __forceinline__ uint32_t o2f_h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 o2f_h2_const(float v) { return __float2half2_rn(v); }
// tanh.approx.f16x2: max relative error ~2^-10.7 (PTX ISA), about one fp16 ulp.
__device__ __forceinline__ __half2 o2f_h2_tanh(__half2 x) {
#ifdef O2F_DIAG_NO_MUFU   // a diagnostic build (kernel_check.py --diag): what the MUFU operations cost
  return x;
#endif
  uint32_t r;
  asm("tanh.approx.f16x2 %0, %1;\n" : "=r"(r) : "r"(o2f_h2_bits(x)));
  return *reinterpret_cast<__half2*>(&r);
}
// The _h forms take h = x/2 (expr.PackedForm.prescale: the wgmma and mma.sync kernels pack the producing
// layer's weights and bias halved, so its accumulators hold h): the same values without the first HMUL2
// (gelu in wgmma: 2 % faster, RESULTS.md twenty-third run).
// sigmoid(x) = 1/2 + tanh(x/2)/2: one MUFU operation a value instead of two (ex2 and rcp).
__device__ __forceinline__ __half2 o2f_h2_sigmoid_h(__half2 h) {
  const __half2 half = o2f_h2_const(0.5f);
  return __hfma2(o2f_h2_tanh(h), half, half);
}
__device__ __forceinline__ __half2 o2f_h2_sigmoid(__half2 x) { return o2f_h2_sigmoid_h(__hmul2(x, o2f_h2_const(0.5f))); }
// SiLU as x/2 + x/2 tanh(x/2) (= x sigmoid(x)): one HMUL2, the tanh and one HFMA2, where x times the
// sigmoid above takes an HMUL2 more (and rounds twice after the tanh, this once).
__device__ __forceinline__ __half2 o2f_h2_silu_h(__half2 h) { return __hfma2(h, o2f_h2_tanh(h), h); }
__device__ __forceinline__ __half2 o2f_h2_silu(__half2 x) { return o2f_h2_silu_h(__hmul2(x, o2f_h2_const(0.5f))); }
// CLIP's QuickGELU, x sigmoid(1.702 x) = x/2 + x/2 tanh(1.702 x/2): on h = x/2, h + h tanh(1.702 h), one
// HMUL2 more than SiLU (1.702 rounds to fp16 1.7021484, as expr._quickgelu16 models it).
__device__ __forceinline__ __half2 o2f_h2_quickgelu_h(__half2 h) {
  return __hfma2(h, o2f_h2_tanh(__hmul2(h, o2f_h2_const(1.702f))), h);
}
__device__ __forceinline__ __half2 o2f_h2_quickgelu(__half2 x) { return o2f_h2_quickgelu_h(__hmul2(x, o2f_h2_const(0.5f))); }
// GELU in its tanh form, x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), for both GELUs: it is within
// 4.7e-4 absolute of the erf form (the largest gap, at x = 2.7, is half of fp16's half step there). Large
// |x| overflow x^3 to inf in fp16, where tanh saturates to +-1 and the result is x or 0 as it should be.
// Evaluated on h = x/2 (the form of x halves first): u = h (2a + 8b h^2) for u = a x + b x^3 (a =
// sqrt(2/pi), b = 0.044715 a), then h + h tanh(u). Against the same in x op by op (x^2, u, x/2 + x/2 t:
// expr._gelu16) every rounding is scaled by a power of two, and h^2 overflows where x^2 does or later,
// tanh at +-1 either way: the same fp16 values for every input (tests/test_precision.py).
__device__ __forceinline__ __half2 o2f_h2_gelu_h(__half2 h) {
  const __half2 h2 = __hmul2(h, h);
  const __half2 u = __hmul2(__hfma2(h2, o2f_h2_const(8.0f * 0.7978845608f * 0.044715f), o2f_h2_const(2.0f * 0.7978845608f)), h);
  return __hfma2(h, o2f_h2_tanh(u), h);
}
__device__ __forceinline__ __half2 o2f_h2_gelu(__half2 x) { return o2f_h2_gelu_h(__hmul2(x, o2f_h2_const(0.5f))); }
