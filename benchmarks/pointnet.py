"""PointNet's classifier without its input and feature transforms (Qi et al. 2017, "vanilla PointNet"), for
`onnx2fused bench` and the tests.

    x [B, 3, N] -> shared MLP 3 -> 64 -> 64 -> 64 -> 128 -> 1024 (Conv1d(k=1) + BatchNorm1d + ReLU; the last
    without ReLU) -> max over the N points -> 1024 -> 512 -> 256 -> 40 (Linear + BatchNorm1d + ReLU) -> logits

The exporters fold each BatchNorm into its Conv or Linear. convert rewrites the five pointwise Convs as one
chain over channels-last rows (passes/pointwise_conv.py: a Transpose of x in front), takes the max over the
points into that chain's op (passes/pool.py: the [B, N, 1024] rows are never written) and fuses the head as a
second chain.

`--variant stn` / `--variant seg`: PointNet as fxia22's pointnet.pytorch writes it (PointNetSTN below): the
input transform net STN3d (its own shared MLP, max pool and head, a 3 x 3 matrix that bmm applies to the
points), the pool as torch.max(x, 2, keepdim=True)[0].view(-1, 1024), and the classifier, or the segmentation
head (the global feature repeated beside the 64-wide point features, 1088 -> 512 -> 256 -> 128 -> k).

    python benchmarks/pointnet.py build/pointnet                # pointnet.onnx: batch dynamic, N = 1024 points
    python benchmarks/pointnet.py build/pointnet --variant stn  # pointnet_stn.onnx (seg: pointnet_seg.onnx)
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


def _mlp(widths, last_relu: bool = True) -> nn.Sequential:
    """Conv1d(k=1) + BatchNorm1d + ReLU per layer (the last without ReLU unless last_relu)."""
    layers = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Conv1d(k, n, 1), _bn(n)] + ([nn.ReLU()] if last_relu or i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def _head(widths) -> nn.Sequential:
    """Linear + BatchNorm1d + ReLU per layer, the last Linear alone."""
    layers = []
    for k, n in zip(widths[:-2], widths[1:-1]):
        layers += [nn.Linear(k, n), _bn(n), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]))


class STN3d(nn.Module):
    """fxia22's input transform net: a 3 x 3 matrix a cloud, identity plus what its MLP predicts."""

    def __init__(self):
        super().__init__()
        self.mlp, self.head = _mlp((3, 64, 128, 1024)), _head((1024, 512, 256, 9))

    def forward(self, x):
        g = torch.max(self.mlp(x), 2, keepdim=True)[0].view(-1, 1024)
        return (self.head(g) + torch.eye(3, device=x.device).flatten()).view(-1, 3, 3)


class PointNetSTN(nn.Module):
    """PointNet as fxia22's pointnet.pytorch writes it: STN3d, the points transformed by bmm, the shared MLP
    3 -> 64 -> 128 -> 1024 and the max pool (keepdim, then view); `seg`: the per-point head instead of the
    classifier."""

    def __init__(self, classes: int = 40, seg: bool = False):
        super().__init__()
        self.seg = seg
        self.stn = STN3d()
        self.mlp1, self.mlp2 = _mlp((3, 64)), _mlp((64, 128, 1024), last_relu=False)
        self.head = _mlp((1088, 512, 256, 128)) if seg else _head((1024, 512, 256, classes))
        self.out = nn.Conv1d(128, classes, 1) if seg else None

    def forward(self, x):
        n = x.size(2)
        x = torch.bmm(x.transpose(2, 1), self.stn(x)).transpose(2, 1)
        pointfeat = self.mlp1(x)
        g = torch.max(self.mlp2(pointfeat), 2, keepdim=True)[0].view(-1, 1024)
        if not self.seg:
            return self.head(g)
        h = torch.cat([g.view(-1, 1024, 1).repeat(1, 1, n), pointfeat], 1)
        return self.out(self.head(h)).transpose(2, 1)


def export(module: nn.Module, path: Path, points: int = 1024, dynamo: bool = False) -> Path:
    """`module` exported with the batch dynamic and `points` fixed (TorchScript at opset 17, or dynamo)."""
    return model_export.export(module, path, (3, points), dynamo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for pointnet.onnx")
    ap.add_argument("--points", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", choices=("vanilla", "stn", "seg"), default="vanilla",
                    help="vanilla (default): PointNetCls; stn: fxia22's classifier with STN3d; seg: its segmentation net")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    module = {"vanilla": PointNetCls, "stn": PointNetSTN, "seg": lambda: PointNetSTN(classes=4, seg=True)}[args.variant]()
    name = {"vanilla": "pointnet.onnx", "stn": "pointnet_stn.onnx", "seg": "pointnet_seg.onnx"}[args.variant]
    print(export(module, args.out / name, args.points))


if __name__ == "__main__":
    main()
