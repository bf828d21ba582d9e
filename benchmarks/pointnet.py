"""PointNet's classifier without its input and feature transforms (Qi et al. 2017, "vanilla PointNet"), for
`onnx2fused bench` and the tests.

    x [B, 3, N] -> shared MLP 3 -> 64 -> 64 -> 64 -> 128 -> 1024 (Conv1d(k=1) + BatchNorm1d + ReLU; the last
    without ReLU) -> max over the N points -> 1024 -> 512 -> 256 -> 40 (Linear + BatchNorm1d + ReLU) -> logits

The exporters fold each BatchNorm into its Conv or Linear. convert rewrites the five pointwise Convs as one
chain over channels-last rows (passes/pointwise_conv.py: a Transpose of x in front; the max pool reads the
[B, N, 1024] rows, so the widest tensor is never transposed) and fuses the head as a second chain.

    python benchmarks/pointnet.py build/pointnet                # pointnet.onnx: batch dynamic, N = 1024 points
    onnx2fused bench build/pointnet/pointnet.onnx --batches 32,256 --reps 50 --no-torch
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import model_export


def _bn(n: int) -> nn.BatchNorm1d:
    """A BatchNorm1d with running statistics drawn at random (a trained one's are not 0 and 1)."""
    bn = nn.BatchNorm1d(n)
    bn.running_mean.uniform_(-0.2, 0.2)
    bn.running_var.uniform_(0.5, 2.0)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.1, 0.1)
    return bn


class PointNetCls(nn.Module):
    def __init__(self, classes: int = 40, widths=(3, 64, 64, 64, 128, 1024), head=(512, 256)):
        super().__init__()
        feat = []
        for i, (k, n) in enumerate(zip(widths, widths[1:])):
            feat += [nn.Conv1d(k, n, 1), _bn(n)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
        self.feat = nn.Sequential(*feat)
        cls, k = [], widths[-1]
        for n in head:
            cls += [nn.Linear(k, n), _bn(n), nn.ReLU(), nn.Dropout(0.3)]
            k = n
        self.head = nn.Sequential(*cls, nn.Linear(k, classes))

    def forward(self, x):
        return self.head(torch.max(self.feat(x), 2)[0])


def export(module: nn.Module, path: Path, points: int = 1024, dynamo: bool = False) -> Path:
    """`module` exported with the batch dynamic and `points` fixed (TorchScript at opset 17, or dynamo)."""
    return model_export.export(module, path, (3, points), dynamo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for pointnet.onnx")
    ap.add_argument("--points", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    print(export(PointNetCls(), args.out / "pointnet.onnx", args.points))


if __name__ == "__main__":
    main()
