// o2f_wide_sm90_gemm.cuh: the wide design's CUTLASS 3.x Hopper GEMM (TMA + wgmma, collective builders),
// its strides, and the relaunch cache of an identical call. Static code included inside a Hopper kernel
// instance unit's namespace o2f_inst_* (templates/cuda_wide_instance.cu.j2).
#pragma once
// Same operands as LayerGemm (A row-major [M, K], weights n-major = column-major K x N, D row-major),
// D = Act(alpha * acc + beta * C + bias[n]) by the predefined fusion LinCombPerColBiasEltAct, which the
// collective builder maps onto an EVT: alpha 1; no C operand (ElementC void: nothing is read, beta 0)
// except with the instance's kResidual (a block's last layer), where C is the block's input rows and
// beta 1, so the residual Add costs one read of x in the epilogue and no pass of its own.
template <class Kern, template <typename> class Act, typename Out, int Align>
struct Gemm {
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<Act, Out, float, Out, Out, float, Align>;
  using ElementC = std::conditional_t<kResidual, Out, void>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Kern::Tile, typename Kern::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, cutlass::layout::RowMajor, Align,
      Out, cutlass::layout::RowMajor, Align,
      typename Kern::EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      typename Kern::Element, cutlass::layout::RowMajor, Kern::kAlignAB,
      typename Kern::Element, cutlass::layout::ColumnMajor, Kern::kAlignAB,
      float, typename Kern::Tile, typename Kern::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Kern::Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      typename Kern::Scheduler>;
  using Op = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Packed strides (row stride ld, unit stride, no batch) of CuTe's (int64, _1, int64) stride types.
template <typename Stride>
Stride packed(int64_t ld) {
  Stride st{};
  cute::get<0>(st) = ld;
  cute::get<2>(st) = 0;
  return st;
}

// Everything a GEMM's initialized CUTLASS operator depends on.
struct LaunchKey {
  int dev = -1, sms = 0, m = 0, n = 0, k = 0, ldd = 0, mode = 0, splits = 0, swizzle = 1, raster = 0;
  const void* a = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;
  const void* src = nullptr;
  const void* d = nullptr;
  const void* scratch = nullptr;
  bool operator==(const LaunchKey& o) const {
    return dev == o.dev && sms == o.sms && m == o.m && n == o.n && k == o.k && ldd == o.ldd && mode == o.mode &&
           splits == o.splits && swizzle == o.swizzle && raster == o.raster && a == o.a && w == o.w && bias == o.bias && src == o.src && d == o.d &&
           scratch == o.scratch;
  }
};

// The last GEMM this thread launched with one kernel instantiation. initialize() costs host time on
// every call (TMA descriptors, function attributes, the scheduler's decomposition). ORT hands a session
// the same buffers run after run, so an identical call relaunches the stored operator. (Measured on the
// H100 cases, RESULTS.md fifth run: no end-to-end change, the setup overlaps the previous kernel; it
// saves host work, and the tuning's timings no longer include the setup.) Only operators that need no
// workspace are reused (stream-K and split-K reductions initialize theirs per launch).
template <class G>
struct LastLaunch {
  LaunchKey key;
  G op;
  bool reusable = false;
};
