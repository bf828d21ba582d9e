"""NeuS's SDF network (Wang et al. 2021, as its reference code writes it; IDR's and VolSDF's alike), for
`onnx2fused bench` and the tests.

    x: the positionally encoded point (3 + 3 x 2 x 6 = 39 features)
    h = softplus_100(L_i(h)) for 8 layers of 256 (weight_norm on each), the fourth writing 256 - 39 = 217 so
    that h = cat([h, x]) / sqrt(2) is 256 again; out = L(h): 1 + 256 (the SDF and a feature vector)

convert joins the whole network into one chain (passes/skip.py takes the scaled Concat; the 1/sqrt(2) goes
into the layer's weight; plan.wgmma takes the 257-wide last layer).

    python benchmarks/neus_sdf.py build/neus     # writes neus_sdf.onnx (TorchScript, opset 17), rows dynamic
    onnx2fused bench build/neus/neus_sdf.onnx --batches 65536,262144 --reps 50 --no-torch
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from model_export import builder_main


class SDFNetwork(nn.Module):
    def __init__(self, d_in: int = 39, d_out: int = 257, width: int = 256, n_layers: int = 8, skip_in=(4,)):
        super().__init__()
        dims = [d_in] + [width] * n_layers + [d_out]
        self.d_in, self.skip_in, self.n = d_in, skip_in, len(dims)
        self.lins = nn.ModuleList(
            nn.utils.weight_norm(nn.Linear(dims[i], dims[i + 1] - (d_in if i + 1 in skip_in else 0)))
            for i in range(self.n - 1))
        self.act = nn.Softplus(beta=100)

    def forward(self, inputs):
        x = inputs
        for i, lin in enumerate(self.lins):
            if i in self.skip_in:
                x = torch.cat([x, inputs], 1) / np.sqrt(2)
            x = lin(x)
            if i < self.n - 2:
                x = self.act(x)
        return x


def main() -> None:
    builder_main(__doc__, "neus_sdf.onnx", SDFNetwork, 39)


if __name__ == "__main__":
    main()
