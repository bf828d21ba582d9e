"""A Fourier-feature MLP (Tancik et al. 2020, "Fourier features let networks learn high frequency functions"),
for `onnx2fused bench` and the tests: gamma(v) = [sin(2 pi B v), cos(2 pi B v)], B ~ N(0, sigma^2) (m x 2), then
a ReLU MLP to RGB. convert makes the sin/cos pair one sin layer of 2m outputs (passes/sincos.py), so the whole
network is one chain: 2 -> 2m (sin) -> 256 x 4 -> 3 (sigmoid).

    python benchmarks/fourier_mlp.py build/ff      # writes fourier_mlp.onnx (TorchScript, opset 17), rows dynamic
    onnx2fused bench build/ff/fourier_mlp.onnx --batches 262144,1048576 --reps 50 --no-torch
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from model_export import builder_main


class FourierMLP(nn.Module):
    def __init__(self, d_in: int = 2, m: int = 128, width: int = 256, depth: int = 4, sigma: float = 10.0):
        super().__init__()
        self.d_in = d_in
        self.register_buffer("B", torch.randn(m, d_in) * sigma)
        dims = [2 * m] + [width] * depth
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        x_proj = (2 * np.pi * x) @ self.B.T
        h = torch.cat([torch.sin(x_proj), torch.cos(x_proj)], dim=-1)
        for layer in self.lins:
            h = torch.relu(layer(h))
        return torch.sigmoid(self.out(h))


def main() -> None:
    builder_main(__doc__, "fourier_mlp.onnx", FourierMLP, 2)


if __name__ == "__main__":
    main()
