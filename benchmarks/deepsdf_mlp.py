"""DeepSDF's decoder (Park et al. 2019, as its reference code writes it), for `onnx2fused bench` and the tests.

    x = [latent code (256) | xyz (3)], 259 features a row
    h = relu(L_i(h)) for 8 layers of 512, the fourth writing 512 - 259 = 253 so that h = cat([h, x]) is 512
    again; sdf = tanh(L(h)) (512 -> 1)

convert finds the skip (passes/skip.py) but keeps the two halves apart: joined, the chain would run the
streamed kernel, while split each half runs the wide design's GEMMs, which the cost model puts ahead
(plan.choose.skip_refused; `inspect` says so).

    python benchmarks/deepsdf_mlp.py build/deepsdf     # writes deepsdf_mlp.onnx (TorchScript, opset 17), rows dynamic
    onnx2fused bench build/deepsdf/deepsdf_mlp.onnx --batches 16384,262144 --reps 50 --no-torch
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from model_export import builder_main


class DeepSDF(nn.Module):
    def __init__(self, latent: int = 256, width: int = 512, depth: int = 8, latent_in: int = 4):
        super().__init__()
        self.k0, self.latent_in = latent + 3, latent_in
        dims = [self.k0] + [width] * depth
        self.lins = nn.ModuleList(nn.Linear(dims[i], dims[i + 1] - (self.k0 if i + 1 == latent_in else 0))
                                  for i in range(depth))
        self.last = nn.Linear(width, 1)

    def forward(self, x):
        h = x
        for i, layer in enumerate(self.lins):
            if i == self.latent_in:
                h = torch.cat([h, x], -1)
            h = F.relu(layer(h))
        return torch.tanh(self.last(h))


def main() -> None:
    builder_main(__doc__, "deepsdf_mlp.onnx", DeepSDF, 259)


if __name__ == "__main__":
    main()
