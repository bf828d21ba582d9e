"""ViT-B's FFN block with and without LayerScale (x + gamma * FFN(LN(x)), as in DeiT-III, CaiT, DINOv2), rows
2-D, for `onnx2fused bench`: the per-channel gamma after the last layer folds into its weights, so both plan
the wide design (RESULTS.md, thirty-fifth run).

    python benchmarks/layerscale_block.py build/ls      # writes vitb_ls.onnx and vitb_plain.onnx
    python benchmarks/layerscale_block.py build/ls 14   # the same at opset 14 (vitb_ls_op14.onnx, ...), where
                                                        # the exporter writes nn.LayerNorm as ReduceMean, Sub, ...
    onnx2fused bench build/ls/vitb_ls.onnx --batches 16384 --reps 50 --no-torch
"""
from __future__ import annotations

import sys
from pathlib import Path


def export(out_dir: Path, opset: int = 17) -> list[Path]:
    import torch

    class Block(torch.nn.Module):
        def __init__(self, d=768, layerscale=True):
            super().__init__()
            self.n = torch.nn.LayerNorm(d)
            self.f = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
            self.gamma = torch.nn.Parameter(torch.rand(d) * 0.1 + 0.01) if layerscale else None

        def forward(self, x):
            y = self.f(self.n(x))
            return x + (self.gamma * y if self.gamma is not None else y)

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    paths = []
    for name, ls in (("vitb_ls", True), ("vitb_plain", False)):
        path = out_dir / (f"{name}.onnx" if opset == 17 else f"{name}_op{opset}.onnx")
        torch.onnx.export(Block(layerscale=ls).eval(), (torch.randn(4, 768),), str(path), input_names=["x"],
                          output_names=["y"], opset_version=opset, dynamo=False, dynamic_axes={"x": {0: "batch"}})
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in export(Path(sys.argv[1] if len(sys.argv) > 1 else "build/ls"), int(sys.argv[2]) if len(sys.argv) > 2 else 17):
        print(f"wrote {p}")
