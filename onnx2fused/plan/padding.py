"""How widths are padded: to a multiple of a tile, or of a 16-byte vector of 16-bit elements."""
from __future__ import annotations

ALIGN = 8   # elements per 16-byte vector of fp16/bf16: the wide design's GEMM K and hidden widths round to it
NORM_ALIGN = 4   # a block's norm scale and bias each start at a multiple of 4 floats (16-byte copies)


def round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def norm_floats(spec) -> int:
    """Floats the GPU kernels keep of a block's norm (MLPSpec.norm) after the layers' biases: the scale NS
    and, with a bias, NB, each K0 padded to NORM_ALIGN; 0 without a norm."""
    if spec.norm is None:
        return 0
    return round_up(spec.widths[0], NORM_ALIGN) * (2 if spec.norm.has_bias else 1)
