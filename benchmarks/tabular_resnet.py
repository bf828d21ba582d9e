"""RTDL's ResNet for tabular data (Gorishniy et al., "Revisiting Deep Learning Models for Tabular Data",
2021), for `onnx2fused bench` and the tests:

    h = Linear(x)                                            (d_in -> d)
    h = h + Linear(Dropout(ReLU(Linear(BatchNorm1d(h)))))    per block (d -> hidden -> d)
    y = Linear(ReLU(BatchNorm1d(h)))                         (d -> d_out)

Each block's BatchNorm is a per-channel scale and shift of its input, which folds into the block's first
layer (passes/input_affine.py), and the block's Add adds that same input: one fused op per block.

    python benchmarks/tabular_resnet.py build/tab        # writes tabular_resnet.onnx (TorchScript, opset 17)
    onnx2fused bench build/tab/tabular_resnet.onnx --batches 65536,1048576 --reps 50 --no-torch
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import model_export
from model_export import builder_main


class ResNetBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(d)
        self.linear_first, self.linear_second = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.linear_second(self.dropout(torch.relu(self.linear_first(self.norm(x)))))


def tabular_resnet(d_in: int = 20, d: int = 192, hidden: int = 384, blocks: int = 2, d_out: int = 3) -> nn.Module:
    """The model in eval mode, each block's BatchNorm with statistics and affine parameters that are not
    the identity's (as after training)."""
    body = [ResNetBlock(d, hidden) for _ in range(blocks)]
    with torch.no_grad():
        for b in body:
            b.norm.running_mean.copy_(torch.randn(d) * 0.5)
            b.norm.running_var.copy_(torch.rand(d) * 2 + 0.5)
            b.norm.weight.copy_(torch.rand(d) + 0.5)
            b.norm.bias.copy_(torch.randn(d) * 0.2)
    return nn.Sequential(nn.Linear(d_in, d), *body, nn.BatchNorm1d(d), nn.ReLU(), nn.Linear(d, d_out)).eval()


def export(module: nn.Module, path: Path, d_in: int, dynamo: bool = False) -> Path:
    """`module` exported with the rows dynamic (x [N, d_in] -> y [N, d_out])."""
    return model_export.export(module, path, d_in, dynamo)


def main() -> None:
    builder_main(__doc__, "tabular_resnet.onnx", tabular_resnet, 20)


if __name__ == "__main__":
    main()
