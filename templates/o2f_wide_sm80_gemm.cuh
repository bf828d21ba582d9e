// o2f_wide_sm80_gemm.cuh: the wide design's CUTLASS 2.x GEMM (sm80 mma.sync) with a bias + activation
// epilogue, and its launch. Static code included inside a kernel instance unit's namespace o2f_inst_*
// (templates/cuda_wide_instance.cu.j2), after elem_t.
#pragma once
// y = Act(a @ w + bias): A row-major [M, K] activations, B the packed weights, n-major [N][K] (column-
// major K x N: both operands K-contiguous, the layout mma.sync wants), D row-major [M, N] in `Out`.
template <template <typename> class Act, typename Out, int Align, typename Tile>
using LayerGemm = cutlass::gemm::device::Gemm<
    elem_t, cutlass::layout::RowMajor,
    elem_t, cutlass::layout::ColumnMajor,
    Out, cutlass::layout::RowMajor,
    float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    typename Tile::Block, typename Tile::Warp, cutlass::gemm::GemmShape<16, 8, 16>,
    cutlass::epilogue::thread::LinearCombinationGeneric<
        Act, Out, Align, float, float, cutlass::epilogue::thread::ScaleType::NoBetaScaling>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>,
    Tile::kStages, 8, 8>;

// The source operand C: the bias as a broadcast row (stride 0), or with the instance's kResidual (a
// block's last layer) the output rows in place, which hold x + bias: D = Act(acc + C) either way.
template <typename G>
cudaError_t run_gemm(int m, int n, int k, const elem_t* a, const elem_t* w, const typename G::ElementC* bias,
                     typename G::ElementC* d, int ldd, cudaStream_t s) {
  typename G::Arguments args({m, n, k}, {a, k}, {w, k}, {kResidual ? d : bias, kResidual ? ldd : 0}, {d, ldd},
                             typename G::EpilogueOutputOp::Params(1.0f, 1.0f));
  G op;
  if (G::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorMisalignedAddress;
  if (op.initialize(args, nullptr, s) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (op.run(s) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}
