"""Whether a chain's generated CPU kernel is registered, or the node falls back to its stock-op body.

The fused CPU kernel wins where fusion keeps every intermediate in L1/L2 and the layers are too narrow
for MLAS's GEMMs to run at full speed; on wide layers MLAS's packed GEMMs win. The threshold is
checked against `onnx2fused bench --cpu` on the 2-core AVX-512 development host (benchmarks/RESULTS.md):
32->64x4->16 ReLU 2.0x stock; 64->128x4->64 GELU 0.86x; 256->256x3->256 SiLU 1.08x (noise level);
784->512x2->10 ReLU 0.48x. Where the kernel is not registered, ONNX Runtime runs the node's
model-local function (the original stock ops), so the CPU is never slower than the original model.
"""
from __future__ import annotations

from .spec import MLPSpec

MAX_HIDDEN_WIDTH = 64


def cpu_kernel_wins(spec: MLPSpec) -> tuple[bool, str]:
    widest = max(spec.widths)
    if widest <= MAX_HIDDEN_WIDTH:
        return True, f"fused CPU kernel (all widths <= {MAX_HIDDEN_WIDTH})"
    return False, f"stock ops on the CPU (width {widest} > {MAX_HIDDEN_WIDTH}: MLAS GEMMs are faster there)"
