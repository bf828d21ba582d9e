"""Deep Sets' permutation-invariant classifier (Zaheer et al. 2017), for `onnx2fused bench` and the tests.

    x [B, N, 3] (a set of N points a row of the batch) -> phi: 3 -> 256 -> 256 -> 256 (Linear + ReLU each) ->
    sum (or mean) over the N elements -> rho: 256 -> 256 -> 40 (Linear + ReLU, Linear) -> logits

convert fuses phi with the ReduceSum behind it into one op (passes/pool.py: the [B, N, 256] rows are never
written; the kernels add each set's rows into its entries) and rho as a second chain.

    python benchmarks/deepsets.py build/deepsets                 # deepsets.onnx: batch dynamic, N = 1024
    python benchmarks/deepsets.py build/deepsets --pool mean     # deepsets_mean.onnx
    onnx2fused bench build/deepsets/deepsets.onnx --batches 32,256 --reps 50 --no-torch
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import model_export


class DeepSets(nn.Module):
    def __init__(self, pool: str = "sum", features: int = 3, width: int = 256, classes: int = 40):
        super().__init__()
        self.pool = pool
        self.phi = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU())
        self.rho = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x):
        h = self.phi(x)
        return self.rho(h.sum(dim=1) if self.pool == "sum" else h.mean(dim=1))


def export(module: nn.Module, path: Path, points: int = 1024, dynamo: bool = False) -> Path:
    """`module` exported with the batch dynamic and the set size fixed (TorchScript at opset 17, or dynamo)."""
    return model_export.export(module, path, (points, 3), dynamo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for deepsets.onnx")
    ap.add_argument("--points", type=int, default=1024, help="elements a set (default 1024)")
    ap.add_argument("--pool", choices=("sum", "mean"), default="sum")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    name = "deepsets.onnx" if args.pool == "sum" else f"deepsets_{args.pool}.onnx"
    print(export(DeepSets(args.pool), args.out / name, args.points))


if __name__ == "__main__":
    main()
