// o2f_wide_launch.cuh: what the wide design's main unit (<chain>_cuda.cu) and its CUTLASS kernel instance
// units (o2f_inst_*.cu, codegen.wide_instances) share: the arguments of an instance's launcher, and the
// shared-memory opt-in its kernels take once a device. Static code
// included at file scope, before the namespaces, by both (one definition in every unit of a library).
#pragma once
#include <atomic>

#include <cuda_runtime.h>

namespace o2f_wide {
// Sets a kernel's dynamic shared-memory size (over 48 KiB: an opt-in) once a device: `done` holds the
// devices (ids < 64) already set, one word a kernel; idempotent, so racing threads may both set it.
template <class Kernel>
cudaError_t smem_opt_in_once(Kernel kernel, int smem, int dev, std::atomic<unsigned long long>& done) {
  const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0ull;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

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
