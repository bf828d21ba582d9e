// o2f_wide_launch.cuh: what the wide design's main unit (<chain>_cuda.cu) and its CUTLASS kernel instance
// units (o2f_inst_*.cu, codegen.wide_instances) share: the arguments of an instance's launcher. Static code
// included at file scope, before the namespaces, by both (one definition in every unit of a library).
#pragma once
namespace o2f_wide {
// A Hopper kernel choice (plan.sm90.Sm90Choice): the kernel configuration, the stream-K scheduler's
// decomposition (an index into kModes) and split-K's splits.
struct Choice {
  int kernel, mode, splits;
  int swizzle, raster;   // the tile scheduler's max_swizzle_size and RasterOrderOptions (plan.sm90.RASTERS order)
};

struct DeviceInfo {
  int id = 0, major = 0, minor = 0, sms = 0;
  bool sm90 = false;  // run the sm_90a kernels: compiled in, a 9.0 device, not overridden by the env
  bool reuse_launch = true;  // an sm90 launcher may relaunch an identical GEMM without re-initializing it
  // An sm90 ping-pong GEMM (no workspace) is launched with programmatic dependent launch (PDL): its CTAs
  // may start (barriers, TMA descriptors) while the kernel before it in the stream finishes its last
  // blocks, and CUTLASS's producer warps wait (griddepcontrol.wait) for that kernel's completion and
  // its memory before their first load. What it saves is the launch gap and prologue per GEMM.
  bool pdl = true;
};

// Lets the stream's next kernel, if it was launched with PDL, be scheduled while this grid's last
// blocks run (it still waits for this grid's completion before it reads anything). A hint: no effect on
// results, none before sm_90.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
}  // namespace o2f_wide
