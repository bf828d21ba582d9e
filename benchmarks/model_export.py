"""The benchmark model builders' shared parts: a PyTorch module exported with the rows dynamic, and the
command line every builder has (`python benchmarks/<builder>.py OUT [--seed N]`)."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn


def export(module: nn.Module, path: Path, features: int | tuple[int, ...], dynamo: bool = False) -> Path:
    """`module` (eval mode) exported at opset 17 with the rows dynamic: x [N, features] -> y [N, ...]
    (`features` a tuple: x [N, *features], PointNet's [N, 3, points]); TorchScript, or the dynamo exporter."""
    module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    x = torch.randn(4, *(features if isinstance(features, tuple) else (features,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, (x,), str(path), dynamo=True, verbose=False, input_names=["x"],
                              output_names=["y"], dynamic_shapes=({0: torch.export.Dim("n")},))
        else:
            torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"], opset_version=17,
                              dynamic_axes={"x": {0: "n"}, "y": {0: "n"}}, dynamo=False)
    return path


def builder_main(doc: str, filename: str, make: Callable[[], nn.Module], features: int) -> None:
    """A builder's command line: OUT (the folder for `filename`), --seed; prints the written path."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path, help=f"folder for {filename}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    print(export(make(), args.out / filename, features))
