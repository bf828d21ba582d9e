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
};
}  // namespace o2f_wide
