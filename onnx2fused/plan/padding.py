"""How widths are padded: to a multiple of a tile, or of a 16-byte vector of 16-bit elements."""
from __future__ import annotations

ALIGN = 8   # elements per 16-byte vector of fp16/bf16: the wide design's GEMM K and hidden widths round to it


def round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m
