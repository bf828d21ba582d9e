"""MLPs that normalise their input first, for `onnx2fused bench`: the scale and shift folds into the first
layer (passes/input_affine.py), so that the fused kernel reads the model's input rows itself instead of
a stock elementwise kernel first writing a normalised copy (RESULTS.md, thirty-sixth run).

    nerf_std     (x - mean) / std, then issue 15's nerf 32 -> 64 x4 -> 16 ReLU (buffers of feature statistics)
    sdf_cube     x * 2 - 1 (coordinates in [0, 1] to [-1, 1]), then sdf 3 -> 128 x4 -> 1 Tanh
    tabular_bn   BatchNorm1d(24) on the features, then 24 -> 256 -> 256 -> 1 with BatchNorm1d + ReLU (+ Dropout)

    python benchmarks/input_norm_models.py build/inorm    # writes the three .onnx files (TorchScript, opset 17)
    onnx2fused bench build/inorm/nerf_std.onnx --batches 2097152 --reps 50 --no-torch
"""
from __future__ import annotations

import sys
from pathlib import Path


def modules():
    import torch
    from torch import nn

    class Standardise(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.register_buffer("mean", torch.rand(k) - 0.5)
            self.register_buffer("std", torch.rand(k) + 0.5)

        def forward(self, x):
            return (x - self.mean) / self.std

    class UnitCube(nn.Module):
        def forward(self, x):
            return x * 2 - 1

    def mlp(widths, act):
        layers = []
        for i, (k, n) in enumerate(zip(widths, widths[1:])):
            layers += [nn.Linear(k, n)] + ([act()] if i < len(widths) - 2 else [])
        return layers

    def tabular():
        bn = nn.BatchNorm1d(24)
        hidden = [nn.Linear(24, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.1),
                  nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 1)]
        m = nn.Sequential(bn, *hidden)
        with torch.no_grad():   # trained-looking statistics (|mean| / std < 2: the fold's shift limit)
            for b in (m[0], m[2], m[6]):
                b.running_mean.copy_(torch.rand(b.num_features) * 2 - 1)
                b.running_var.copy_(torch.rand(b.num_features) + 0.5)
        return m

    torch.manual_seed(0)
    return {"nerf_std": (nn.Sequential(Standardise(32), *mlp([32, 64, 64, 64, 64, 16], nn.ReLU)), 32),
            "sdf_cube": (nn.Sequential(UnitCube(), *mlp([3, 128, 128, 128, 128, 1], nn.Tanh)), 3),
            "tabular_bn": (tabular(), 24)}


def export(out_dir: Path, names: tuple[str, ...] | None = None) -> list[Path]:
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (m, k) in modules().items():
        if names is not None and name not in names:
            continue
        path = out_dir / f"{name}.onnx"
        torch.onnx.export(m.eval(), (torch.rand(4, k),), str(path), input_names=["x"], output_names=["y"],
                          opset_version=17, dynamo=False, dynamic_axes={"x": {0: "batch"}})
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in export(Path(sys.argv[1] if len(sys.argv) > 1 else "build/inorm")):
        print(f"wrote {p}")
