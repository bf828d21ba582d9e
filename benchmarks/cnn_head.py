"""MobileNetV2's classifier head (Sandler et al. 2018) on its last stage's feature map, for `onnx2fused bench`.

    x [B, 320, 7, 7] -> 1x1 Conv2d 320 -> 1280 + BatchNorm2d + ReLU6 -> global average pool -> Linear 1280 -> 1000

convert rewrites the 1x1 Conv over channels-last rows with the map's 49 positions flattened into one axis
(passes/pointwise_conv.py, passes/map_pools.py) and takes the average pool into its fused op (passes/pool.py):
the [B, 1280, 7, 7] map is never written. The classifier is a chain of its own.

    python benchmarks/cnn_head.py build/cnn_head                # cnn_head.onnx: the batch dynamic, a 7 x 7 map
    python benchmarks/cnn_head.py build/cnn_head --any-size     # cnn_head_any.onnx: the map's size dynamic too
    onnx2fused bench build/cnn_head/cnn_head.onnx --batches 32,256 --reps 50 --no-torch
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import nn


class MobileNetV2Head(nn.Module):
    def __init__(self, channels: int = 320, features: int = 1280, classes: int = 1000):
        super().__init__()
        bn = nn.BatchNorm2d(features)
        bn.running_mean.uniform_(-0.2, 0.2)   # (a trained network's statistics are not 0 and 1)
        bn.running_var.uniform_(0.5, 2.0)
        self.features = nn.Sequential(nn.Conv2d(channels, features, 1, bias=False), bn, nn.ReLU6())
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(features, classes))

    def forward(self, x):
        return self.classifier(nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


def export(module: nn.Module, path: Path, any_size: bool = False) -> Path:
    """TorchScript at opset 17: the batch dynamic (and the map's height and width where `any_size`)."""
    module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    axes = {0: "b", 2: "h", 3: "w"} if any_size else {0: "b"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.randn(2, module.features[0].in_channels, 7, 7)
        torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"],
                          opset_version=17, dynamic_axes={"x": axes, "y": {0: "b"}}, dynamo=False)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for cnn_head.onnx")
    ap.add_argument("--any-size", action="store_true", help="the map's height and width dynamic (cnn_head_any.onnx)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    print(export(MobileNetV2Head(), args.out / ("cnn_head_any.onnx" if args.any_size else "cnn_head.onnx"),
                 args.any_size))


if __name__ == "__main__":
    main()
