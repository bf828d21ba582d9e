// onnx2fused ORT plugin: the kernel table that the generated registry.cc fills.
// Hand-written; compiled into every plugin library. Needs no ONNX Runtime or CUDA headers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace onnx2fused {

// CPU kernel of one spec: rows x widths[0] -> rows x widths[num_layers]. x/y are float or uint16_t (fp16)
// per io_is_half; w[i] is the [K_i, N_i] float32 weight (MatMul layout), b[i] the [N_i] float32 bias.
// A transformer block's norm (norm_inputs > 0): w[num_layers] is its scale NS [K0], b[num_layers] its
// bias NB [K0] (a layer norm; nullptr for an RMS norm). A residual needs nothing: the kernel adds x.
// threads <= 1 runs on the calling thread; more splits the rows over that many std::threads.
typedef void (*CpuFn)(const void* x, void* y, int64_t rows, const float* const* w, const float* const* b,
                      int threads);
// CUDA kernel of one spec. `w`/`b` are HOST arrays of DEVICE pointers; streams are cudaStream_t.
typedef size_t (*CudaWorkspaceBytesFn)();
typedef int (*CudaPackFn)(const float* const* w, const float* const* b, void* workspace, void* stream);
typedef int (*CudaRunFn)(const void* x, void* y, int64_t rows, const void* workspace, void* stream);
// A pooled spec's run (KernelEntry::pool): rows = groups * (rows per group) input rows -> y [groups, N_last].
// float16 I/O also takes `scratch`, a device buffer of groups * N_last floats (the entries are raised in
// float, then rounded into y); float32 I/O raises y itself and takes nullptr.
typedef int (*CudaRunPoolFn)(const void* x, void* y, int64_t rows, int64_t groups, const void* workspace,
                             void* scratch, void* stream);

struct KernelEntry {
  const char* name;               // op type in domain "onnx2fused" (= MLPSpec.name)
  int num_layers;
  const int64_t* widths;          // num_layers + 1 values: K0, N0, N1, ...
  const char* const* activations; // num_layers strings: expr.to_text of each layer's activation
  int io_is_half;                 // 1: X/Y are float16, 0: float32
  int rows_per_task;              // CPU: rows one parallel task should take (multiple of the kernel's row block)
  CpuFn cpu;                      // null: no generated CPU kernel (the plugin runs the node's stock body)
  CudaWorkspaceBytesFn cuda_workspace_bytes;  // these three null when built without CUDA
  CudaPackFn cuda_pack;
  CudaRunFn cuda_run;
  int cuda_uses_scratch;          // 1: cuda_run also writes the workspace (scratch), so runs on different
                                  // streams must not overlap; 0: it only reads the packed weights
  const int64_t* weight_cols = nullptr;  // num_layers values: columns of W_i and length of B_i (2 N_i for a
                                         // gated layer); nullptr: N_i for every layer (no gated layer)
  int norm_inputs = 0;            // inputs after the layers' W_i, B_i: 1 (RMS norm: NS [K0]), 2 (layer norm:
                                  // NS, NB [K0]), 0 (no norm in front)
  uint64_t skip_mask = 0;         // bit j: layer j (> 0) reads [x zero-padded to skip_width, the layer before's
  int skip_width = 0;             // output], its W [skip_width + N_{j-1}, N_j]; 0: no skip connection
  int pool = 0;                   // 1: Y is the pool (pool_op) over axis -2 of the chain's rows, X [..., M, K0] ->
                                  // Y [..., N_last]; 2: the same with that axis kept, Y [..., 1, N_last]
  CudaRunPoolFn cuda_run_pool = nullptr;  // a pooled spec's CUDA run (cuda_run is null then)
  int pool_op = 0;                // the pool: 0 max (NaN wins, -inf over no rows), 1 sum, 2 mean (0 over no rows)
};

// Defined by the generated registry.cc.
extern const KernelEntry kKernels[];
extern const int kNumKernels;
extern const char* const kLibraryVersion;  // onnx2fused version that generated the sources

}  // namespace onnx2fused
