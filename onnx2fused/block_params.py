"""The template parameters of a transformer block's prologue (the norm of each input row) and epilogue (the
residual Add of the block's input), shared by the CPU template and the fused CUDA templates (resident,
streamed, fp32, wgmma). Every key is present for every spec ('' / False without a block), so a template
under StrictUndefined can test them, and a spec without a block renders exactly as before.
"""
from __future__ import annotations

import numpy as np

from .plan.padding import NORM_ALIGN, round_up
from .spec import MLPSpec


def c_float(v: float) -> str:
    """v as an exact C float literal (hexadecimal: no decimal rounding on either side)."""
    mantissa, exponent = float(np.float32(v)).hex().split("p")
    return f"{mantissa.rstrip('0').rstrip('.')}p{exponent}f"


def block_params(spec: MLPSpec) -> dict:
    norm = spec.norm
    return {
        "norm": norm.kind if norm is not None else "",
        "norm_eps": c_float(norm.eps) if norm is not None else "",
        "norm_has_bias": norm is not None and norm.has_bias,
        # the bias NB's offset from the scale NS in the kernels' copy (norm_floats)
        "norm_bias_offset": round_up(spec.widths[0], NORM_ALIGN),
        # fp16 I/O: ORT runs a model's LayerNormalization with its fp16 kernel, whose output is fp16 (the
        # ops around it are cast to fp32): the kernels round the normalised row the same way
        "norm_round_half": spec.io_dtype == "f16" and norm is not None and norm.kind == "layernorm",
        "residual": spec.residual,
        "has_block": spec.has_block,
    }
